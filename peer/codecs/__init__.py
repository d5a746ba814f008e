"""Codecs for outer gradients on the wire: a pure-data table (`specs`) and the implementations
(`formats`, with `elias_fano` for sparse indices) that take over hivemind's compression slots.

A leaf: imports nothing from the rest of pathswarm but `peer.errors`. The config tree reads only
`peer.codecs.specs` (names, for validation); the sync layer installs `peer.codecs.formats`.
"""
