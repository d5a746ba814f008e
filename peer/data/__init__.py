"""A run's documents: where they come from and which are held out (`sources`), the built-in offline
corpus (`corpus`), the batches of one path's shard (`batches`), what a peer's passes found out about
where each document goes (`routed`), and the checks of a run's local files
(`files`: the format its --dataset reads, the fingerprint every peer's copy must match).

May import: the leaves and `peer.model`.
"""
