"""A run: creating it from a researcher's choices (`create`), its manifest as a signed record and
file (`record`), what every peer rebuilds from the manifest alone (`rebuild`), and the corpus routed
once for every peer (`routing_index`); `options` declares `run create`'s settings, each once.

May import: the leaves, `peer.model`, `peer.data`, `peer.config`, `peer.artifacts`.
"""
