"""The swarm's DHT layer: every key (`keys`), versioned record schemas (`schema`), validators
(`validators`), storing and reading signed records (`records`), node start-up with identities (`node`).

May import: hivemind and `peer.errors` only; the training peer builds on this layer, never the reverse.
"""
