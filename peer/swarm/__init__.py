"""A peer's life in the DHT: the run manifest (`manifest`), path claims (`claims`), probes of compute
and links (`probes`), the scheduler's plan applied to claims and groups (`planning`), and one peer's
membership with its heartbeat (`membership`), which publishes the training's `progress` in its claim.

May import: the leaves, `dht`, `monitoring`, `peer.model`, `peer.data`, `peer.config`, `peer.run`,
`peer.scheduler`.
"""
