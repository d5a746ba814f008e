"""The swarm's DHT layer: every key (`keys`), versioned record schemas (`schema`), validators
(`validators`), storing and reading signed records (`records`), node start-up with identities (`node`),
the project's base errors (`errors`), the p2p daemon's scheduling beside training
(`daemon_scheduling`), and the P2P plumbing the peer's services share: an event loop in a thread
(`background_loop`) and one protobuf handler on a replica of the daemon (`p2p_handler`).

May import: hivemind only, never `peer`: the training peer builds on this layer, not the reverse
(tests/test_layout.py checks it).
"""
