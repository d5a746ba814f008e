"""The scheduler in a live swarm: from DHT records to this peer's path and averaging group.

Every peer builds the same `SwarmSnapshot` from the probe and claim records it reads and runs the
same deterministic planner with the run's seed, so peers agree on the plan without talking about it
(views of the DHT can lag by a heartbeat; hysteresis keeps such differences from moving anyone).
A peer only ever acts on its own line of the plan: which path to claim when it joins, whether to
move at a round's end (`online_move`, runs with `scheduler.replan_online`), and which subgroup of a
module's holders it averages with in a round.
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache

from dht.schema import ClaimRecord, ProbeRecord
from peer.codecs.specs import codec_spec
from peer.config import RunManifest
from peer.model.grid import ModelConfig, all_module_ids, all_paths, path_index, path_module_ids
from peer.model.transformer import PathModel, build_module_shape_only, count_parameters, shapes_only
from peer.scheduler import (
    Assignment,
    GridSpec,
    GridState,
    LinkMeasurement,
    OnlineDecision,
    PeerMeasurement,
    Replan,
    SwarmSnapshot,
    averaging_groups,
    online_decision,
    replan,
)

logger = logging.getLogger(__name__)

#: what a mover downloads per parameter of a module: its averaged weights and outer momentum (fp32)
STATE_BYTES_PER_PARAMETER = 8


def fragment_bytes(manifest: RunManifest, path_parameters: int) -> float:
    """c in DATAP-COST: what one holder puts in one fragment sync of its path."""
    return path_parameters * codec_spec(manifest.sync.codec).wire_bytes_per_value / manifest.sync.fragments


def path_parameters(manifest: RunManifest) -> int:
    with shapes_only():
        model = PathModel(manifest.model, (0,) * manifest.model.n_levels)
    return count_parameters(model)


@lru_cache(maxsize=8)
def shared_parameters(cfg: ModelConfig) -> int:
    """Parameters of the modules every path holds (the trunk, and a level of one module): every
    placed peer averages them with every other, whatever the plan (shapes only)."""
    common = set.intersection(*(set(path_module_ids(cfg, p)) for p in all_paths(cfg)))
    return sum(count_parameters(build_module_shape_only(cfg, m)) for m in common)


def build_snapshot(
    manifest: RunManifest,
    probes: dict[str, ProbeRecord],
    claims: dict[str, ClaimRecord],
    n_parameters: int,
    batch_size: int = 8,
) -> SwarmSnapshot:
    """Peers are those with a live claim or probe record; missing measurements are filled in
    conservatively by the snapshot itself. The cost model prices the round this swarm runs: each
    member sends its whole part to every other member (`exchange="all_to_all"`), the path's own
    modules inside its group and the shared ones (`shared_parameters`) with every placed peer."""
    peers = {
        pid: PeerMeasurement(
            tokens_per_second=probes[pid].tokens_per_second if pid in probes else None,
            memory_bytes=probes[pid].memory_bytes if pid in probes else None,
        )
        for pid in set(probes) | {p for p, c in claims.items() if not c.client_mode}
    }
    links = [
        LinkMeasurement(src, dst, latency_seconds=lat, bandwidth_bytes_per_second=bw)
        for src, record in probes.items()
        for dst, (lat, bw) in record.links.items()
    ]
    shared = shared_parameters(manifest.model)
    grid = GridSpec(
        n_paths=manifest.model.n_paths,
        fragment_bytes=fragment_bytes(manifest, n_parameters - shared),
        shared_fragment_bytes=fragment_bytes(manifest, shared),
        exchange="all_to_all",
        shared_group_size=manifest.sync.max_group_size,
        inner_steps=manifest.sync.inner_steps,
        tokens_per_step=batch_size * manifest.seq_len,
    )
    return SwarmSnapshot.from_measurements(peers, links, grid)


def current_assignment(
    manifest: RunManifest, claims: dict[str, ClaimRecord], exclude: str | None = None
) -> Assignment:
    return Assignment(
        {pid: c.path for pid, c in claims.items() if pid != exclude and not c.client_mode},
        manifest.model.n_paths,
    )


def replan_claims(
    manifest: RunManifest,
    snapshot: SwarmSnapshot,
    claims: dict[str, ClaimRecord],
    seed: int,
    exclude: str | None = None,
) -> tuple[Assignment, Replan]:
    """The claims' assignment (of the peers the snapshot measured, less `exclude`) and the run's
    re-plan of it: what a joining peer follows, and what the monitor shows."""
    current = current_assignment(manifest, claims, exclude=exclude)
    current = Assignment(
        {p: k for p, k in current.path_of_peer.items() if p in snapshot.peer_ids}, current.n_paths
    )
    return current, replan(current, snapshot, seed=seed, min_gain=manifest.scheduler.replan_min_gain)


def planned_path(
    manifest: RunManifest,
    snapshot: SwarmSnapshot,
    claims: dict[str, ClaimRecord],
    me: str,
    seed: int,
    joining: bool = True,
) -> int | None:
    """This peer's path in the plan, keeping the others where they are unless the gain is large.
    `joining`: place us as a newcomer; otherwise our claim is part of the current assignment, as
    when peers that joined together re-check once all their claims are visible (every one of them
    then computes the same plan, so a doubled path is resolved by exactly the peers the plan moves)."""
    _, result = replan_claims(manifest, snapshot, claims, seed, exclude=me if joining else None)
    path = result.assignment.path_of_peer.get(me)
    logger.info(
        f"plan: path {path} for us; round {result.cost.round_seconds:.3f}s "
        f"({'re-planned' if result.replanned else 'kept current claims'}; moved {list(result.moved_peers)})"
    )
    return path


def module_paths(manifest: RunManifest, module_id: str) -> list[int]:
    cfg = manifest.model
    return [path_index(cfg, p) for p in all_paths(cfg) if module_id in path_module_ids(cfg, p)]


def my_averaging_group(
    manifest: RunManifest,
    snapshot: SwarmSnapshot,
    claims: dict[str, ClaimRecord],
    me: str,
    module_id: str,
    round_index: int,
) -> tuple[int, list[str]] | None:
    """(index, members) of the subgroup this peer averages `module_id` with in `round_index`, when
    the module has more holders than `sync.max_group_size`; None means one group of all holders."""
    limit = manifest.sync.max_group_size
    assignment = current_assignment(manifest, claims)
    paths = module_paths(manifest, module_id)
    holders = [p for p, k in assignment.path_of_peer.items() if k in paths and p in snapshot.peer_ids]
    if not limit or len(holders) <= limit or me not in holders:
        return None
    groups = averaging_groups(assignment, round_index, snapshot, limit, module_paths=paths)
    for index, members in enumerate(groups):
        if me in members:
            return index, sorted(members)
    return None


def group_bits(index: int, width: int = 8) -> str:
    return format(index % (1 << width), f"0{width}b")


def bits_for(n: int) -> int:
    return max(1, math.ceil(math.log2(max(2, n))))


@lru_cache(maxsize=8)
def grid_state(cfg: ModelConfig) -> GridState:
    """Each path's modules and each module's state bytes (shapes only: nothing is allocated)."""
    sizes = {m: count_parameters(build_module_shape_only(cfg, m)) for m in all_module_ids(cfg)}
    return GridState(
        tuple(frozenset(path_module_ids(cfg, p)) for p in all_paths(cfg)),
        {m: float(n * STATE_BYTES_PER_PARAMETER) for m, n in sizes.items()},
    )


def online_move(
    manifest: RunManifest, snapshot: SwarmSnapshot, claims: dict[str, ClaimRecord], me: str, seed: int
) -> OnlineDecision:
    """This peer's line of the re-run plan (peer/scheduler/online.py) on its views of the swarm: the
    live claims (not client-mode, not leaving) are the current assignment, their `ready` flags say
    who can serve state."""
    live = {p: c for p, c in claims.items() if not c.client_mode and not c.leaving}
    s = manifest.scheduler
    return online_decision(
        current_assignment(manifest, live),
        snapshot,
        me,
        grid_state(manifest.model),
        {p for p, c in live.items() if c.ready},
        seed=seed,
        min_gain=s.replan_min_gain,
        horizon_rounds=s.replan_horizon_rounds,
        lost_rounds=s.move_lost_rounds,
    )
