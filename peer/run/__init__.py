"""A run: creating it from a researcher's choices (`create`), its manifest as a signed record and
file (`record`), and what every peer rebuilds from the manifest alone (`rebuild`).

May import: the leaves, `peer.model`, `peer.data`, `peer.config`.
"""
