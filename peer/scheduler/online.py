"""Online re-planning: whether the swarm's plan, re-run on fresh measurements, is worth its moves.

`replan` (peer/scheduler/plan.py) says which assignment the swarm should follow once a peer joined
or left or a probe changed a link or a speed; `online_decision` prices the moves that take it there
and says whether *one* peer (`me`) moves now. Every peer evaluates it on the same snapshot and claims,
so all of them reach the same verdict on the whole plan, and each acts only on its own line.

* gain: (round time of the current assignment - round time of the plan) x `horizon_rounds`; a plan
  that trains more paths than the current assignment is always worth its moves (an untrained path is
  not priced by the round time);
* cost: the slowest mover's move, since movers move at once and the swarm does not wait for them:
  the download of the modules its new path has and its old one lacks (state bytes from the fastest
  ready holder that keeps the module, at the measured link: latency + bytes / bandwidth), plus
  `lost_rounds` rounds of the plan (the rebuild and the wait until holders see its new claim);
* no orphan: a mover leaves a module only when another ready holder of it keeps it in the plan;
  otherwise it waits, and the plan is re-evaluated when claims change (the newcomer became ready).

The measurements are what peers sign about themselves (probe records), i.e. claims: a peer that lies
about its speed or links can make the plan move peers for nothing, which costs training time at
most: `min_gain` and the cost check bound how often, and no move leaves a module without a holder.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from peer.scheduler.cost import Assignment, round_cost
from peer.scheduler.plan import replan
from peer.scheduler.snapshot import SwarmSnapshot


@dataclass(frozen=True)
class GridState:
    """What moving between paths costs on this grid: each path's modules and each module's state."""

    #: module ids of each path index
    path_modules: Sequence[frozenset[str]]
    #: bytes a mover downloads for a module (its averaged weights and outer momentum)
    module_bytes: Mapping[str, float]


@dataclass(frozen=True)
class OnlineDecision:
    """The swarm's verdict on the re-run plan and this peer's line of it."""

    #: whether this peer moves from `source` to `target` now
    move: bool
    source: int | None
    target: int | None
    #: why (for the log and the monitor)
    reason: str
    current_round_seconds: float
    planned_round_seconds: float
    #: predicted saving over the horizon, seconds (inf: the plan trains a path nobody trains)
    gain_seconds: float
    #: the slowest mover's download plus its lost rounds, seconds
    cost_seconds: float
    #: this peer's own download if it moves (0 when it does not), seconds
    download_seconds: float
    #: peers the plan moves (all of them, not only us)
    movers: tuple[str, ...]
    #: the assignment the swarm follows if the plan is taken
    plan: Assignment


def download_seconds(
    peer: str,
    source: int,
    target: int,
    current: Assignment,
    planned: Assignment,
    snapshot: SwarmSnapshot,
    grid: GridState,
    ready: Collection[str],
) -> float:
    """Seconds for `peer` to fetch the modules `target` has and `source` lacks, each from its fastest
    ready holder (one that keeps the module in the plan, else any current holder); a module nobody
    holds costs nothing to fetch (it starts from its initial weights or a keeper)."""
    idx = snapshot.index()
    me = idx[peer]
    total = 0.0
    for module in sorted(grid.path_modules[target] - grid.path_modules[source]):
        holders = [q for q, k in current.path_of_peer.items() if q != peer and q in ready and q in idx
                   and module in grid.path_modules[k]]  # fmt: skip
        staying = [q for q in holders if module in grid.path_modules[planned.path_of_peer.get(q, -1)]]
        best = math.inf
        for q in staying or holders:
            j = idx[q]
            rate = snapshot.bandwidth_bytes_per_second[me, j]
            best = min(best, float(snapshot.latency_seconds[me, j] + grid.module_bytes[module] / rate))
        total += 0.0 if best == math.inf else best
    return total


def orphaned_by(
    peer: str, source: int, target: int, current: Assignment, planned: Assignment, grid: GridState,
    ready: Collection[str],
) -> list[str]:  # fmt: skip
    """Modules `peer` would leave without a holder: no other ready peer holds it now and keeps it."""
    out = []
    for module in sorted(grid.path_modules[source] - grid.path_modules[target]):
        kept = any(
            q != peer and q in ready and module in grid.path_modules[k]
            and module in grid.path_modules[planned.path_of_peer.get(q, k)]
            for q, k in current.path_of_peer.items()
        )  # fmt: skip
        if not kept:
            out.append(module)
    return out


def online_decision(
    current: Assignment,
    snapshot: SwarmSnapshot,
    me: str,
    grid: GridState,
    ready: Collection[str],
    *,
    seed: int,
    min_gain: float,
    horizon_rounds: float,
    lost_rounds: float,
) -> OnlineDecision:
    """Whether `me` moves now (see the module docstring). `current`: the claimed paths of the live
    peers; `ready`: those that can serve their modules' state."""
    placed = set(snapshot.peer_ids)
    current = Assignment({p: k for p, k in current.path_of_peer.items() if p in placed}, current.n_paths)
    result = replan(current, snapshot, seed=seed, min_gain=min_gain)
    planned = result.assignment
    now = round_cost(current, snapshot)
    later = result.cost
    movers = tuple(
        p for p in sorted(current.path_of_peer) if planned.path_of_peer.get(p, current.path_of_peer[p])
        != current.path_of_peer[p]
    )  # fmt: skip
    covers_more = len(later.uncovered_paths) < len(now.uncovered_paths)
    gain = math.inf if covers_more else (now.round_seconds - later.round_seconds) * horizon_rounds
    move_seconds = {
        p: download_seconds(
            p, current.path_of_peer[p], planned.path_of_peer[p], current, planned, snapshot, grid, ready
        )  # fmt: skip
        for p in movers
    }
    cost = max(move_seconds.values(), default=0.0) + (lost_rounds * later.round_seconds if movers else 0.0)
    source = current.path_of_peer.get(me)
    target = planned.path_of_peer.get(me)

    def verdict(move: bool, reason: str) -> OnlineDecision:
        seconds = (now.round_seconds, later.round_seconds, gain, cost, move_seconds.get(me, 0.0))
        return OnlineDecision(move, source, target, reason, *seconds, movers, planned)

    if source is None or target is None:
        return verdict(False, "we are not placed in the plan")
    if target == source:
        return verdict(False, f"the plan keeps us on path {source}")
    if not gain > cost:
        return verdict(False, f"the move costs {cost:.1f}s, more than its gain of {gain:.1f}s")
    orphans = orphaned_by(me, source, target, current, planned, grid, ready)
    if orphans:
        return verdict(False, f"waiting: no other ready holder keeps {', '.join(orphans)}")
    return verdict(True, f"gain {gain:.1f}s over the horizon beats the move's cost {cost:.1f}s")
