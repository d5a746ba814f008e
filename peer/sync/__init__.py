"""Keeping a module's holders in sync: fragments (`fragments`), hivemind's all-reduce with validated
parts and one identical average (`allreduce`), one averager per module (`averager`), DiLoCo state
per module (`module_sync`), the Streaming DiLoCo outer loop (`outer`), and the sync layer of one
peer (`path_sync`).

May import: the leaves, `dht`, `monitoring`, `peer.model`, `peer.config`. Not `peer.swarm`: what the
sync layer needs from the swarm's view (holders, donors, planned groups) is handed in.
"""
