"""Training: the inner step every trainer shares (`inner`), a peer's round history (`history`), and
the `Peer` that ties membership, sync and the loop together (`peer`).

May import: every layer below it (not `peer.offline`, not `peer.cli`).
"""
