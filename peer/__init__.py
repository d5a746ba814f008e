"""pathswarm's training peer and the tools around it, in layers; a module imports only from its own
layer or the layers before it (`tests/test_layout.py` checks this, and that nothing imports in a
circle):

1. leaves — `errors`, `seeding`, `faults`, `codecs/`, `checkpoint/` (atomic checkpoints and the
   directory lock), `artifacts/` (content-addressed files over P2P); and the sibling packages `dht`
   (keys, record schemas, validators, identities, node start-up, the P2P plumbing every service
   shares; it imports nothing from `peer`) and `monitoring.metrics` (the Prometheus metrics a peer
   serves)
2. `model/` — grid shape, transformer, tokenizer, router and routing
3. `data/` — dataset sources, the built-in corpus, a path's batches
4. `config/` — the typed config tree (run manifest, peer settings), each setting declared once
5. `run/` — creating a run, its signed manifest record, what a peer rebuilds from it
6. `scheduler/` — placement and averaging groups from measurements (imports only leaves)
7. `sync/` — fragments, per-module DiLoCo, robust aggregation, the sync protocol (no matchmaking),
   the streaming outer loop
8. `swarm/` — manifest in the DHT, claims, probes, planning, a peer's membership
9. `training/` — the inner step, the round history, the `Peer` (lifecycle and loop)
10. `offline/` — research tools without a swarm: simulator, experiments, evaluation, export;
    and, beside `peer`, `monitoring.swarm` — the maintainers' swarm monitor (imports dht,
    monitoring, config, model.grid and run only)
11. `cli/` — the `pathswarm` command and its commands: the demo, the local swarm launcher, and
    `reroute` (DiPaCo's re-routing of a live run by its creator, `pathswarm run reroute`); `flags`
    generates the `peer` and `run create` flags from the config tree
"""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("pathswarm")
except importlib.metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "unknown"
