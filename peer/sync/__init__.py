"""Keeping a module's holders in sync: fragments (`fragments`), DiLoCo state per module with a
deterministic outer step (`module_sync`), robust deterministic aggregation (`aggregate`), the sync
protocol on hivemind's P2P streams — framing with caps (`wire`), the bounded inbox (`inbox`), the
service (`service`) and what it says of refusals (`refusal_log`), a silent member asked whether it is
there or for its report (`probe`), one round without matchmaking (`rounds`), rounds sent already
that are sat out, never signed twice (`sent_rounds`, `sitting_out`), state download with
confirmation (`state_transfer`), a joiner's first rounds (`settling`), a lone lineage yielding to the
others' (`strays`) — the Streaming DiLoCo outer loop (`outer`) and its measured overlap τ
(`overlap`), and a peer's sync layer (`path_sync`).

May import: the leaves, `dht`, `monitoring`, `peer.model`, `peer.config`. Not `peer.swarm`: what the
sync layer needs from the swarm's view (holders, donors, planned groups) is handed in.
"""
