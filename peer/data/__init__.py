"""A run's documents: where they come from and which are held out (`sources`), the built-in offline
corpus (`corpus`), and the batches of one path's shard (`batches`).

May import: the leaves and `peer.model`.
"""
