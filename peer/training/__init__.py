"""Training: the inner step every trainer shares (`inner`), a peer's round history (`history`), and
the `Peer` that ties membership, sync and the loop together (`peer`), with the parts it holds: the
router follower (`router_switch`), the rotation policy (`rotate`), its checkpoints (`checkpoints`), its
data streams of the paths it trained, kept across moves (`path_data`);
`joining` and `startup_checks` are what `Peer.start` does before it claims a path.

May import: every layer below it (not `peer.offline`, not `peer.cli`).
"""
