"""A run: creating it from a researcher's choices (`create`), its manifest as a signed record and
file (`record`), and what every peer rebuilds from the manifest alone (`rebuild`); `options` declares
`run create`'s settings, each once.

May import: the leaves, `peer.model`, `peer.data`, `peer.config`.
"""
