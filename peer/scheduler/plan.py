"""Entry points: plan a swarm from scratch, or re-plan on churn without moving peers for little.

`plan` picks exhaustive enumeration when the swarm is tiny and the genetic search otherwise.
`replan` keeps the running assignment (minus departed peers, plus newcomers on the least-covered
paths) unless a fresh plan is at least `min_gain` faster: moving a peer costs it a download of its
new path's modules and a warm-up, which a few percent of round time does not repay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from peer.scheduler.cost import Assignment, CostBreakdown, CostModel, round_cost
from peer.scheduler.partition import count_balanced_partitions, exhaustive_labels, random_labels
from peer.scheduler.search import SearchConfig, genetic_search
from peer.scheduler.snapshot import SwarmSnapshot

EXHAUSTIVE_HARD_LIMIT = 1_000_000


@dataclass(frozen=True)
class Plan:
    """A plan: who trains which path, what a round costs, and how it was found."""

    assignment: Assignment
    cost: CostBreakdown
    method: Literal["trivial", "exhaustive", "genetic"]
    seed: int
    generations: int = 0


def plan(
    snapshot: SwarmSnapshot,
    seed: int = 0,
    config: SearchConfig | None = None,
    method: Literal["auto", "exhaustive", "genetic"] = "auto",
) -> Plan:
    """The scheduler's plan for this snapshot; identical for identical (snapshot, seed, config)."""
    config = config or SearchConfig()
    model = CostModel(snapshot)
    if model.n_groups <= 1 or model.n_groups >= model.n:
        # One group, or everyone alone on a path: every balanced partition is the same one
        # (up to which paths the lone peers take, which `paths_of` settles by throughput).
        labels = np.zeros(model.n, dtype=np.int64) if model.n_groups <= 1 else np.arange(model.n)
        return _finish(model, labels, "trivial", seed)
    count = count_balanced_partitions(model.n, model.n_groups)
    if method == "exhaustive" or (method == "auto" and count <= config.exhaustive_max_partitions):
        # Forced enumeration is still refused beyond a million partitions (minutes of scoring).
        return _finish(model, exhaustive_labels(model, EXHAUSTIVE_HARD_LIMIT), "exhaustive", seed)
    labels, generations = genetic_search(model, np.random.default_rng(seed), config)
    return _finish(model, labels, "genetic", seed, generations)


def _finish(model: CostModel, labels: np.ndarray, method, seed: int, generations: int = 0) -> Plan:
    paths = model.paths_of(labels) if model.n else np.zeros(0, dtype=np.int64)
    return Plan(model.to_assignment(labels), model.breakdown(labels, paths), method, seed, generations)


def random_cost(snapshot: SwarmSnapshot, seeds: range = range(10)) -> float:
    """Mean round time of random balanced assignments (the no-scheduler baseline), seconds."""
    model = CostModel(snapshot)
    if model.n == 0:
        return 0.0
    total = 0
    for s in seeds:
        total += model.round_ns(random_labels(model, np.random.default_rng(s)))
    return total / len(seeds) / 1e9


@dataclass(frozen=True)
class Replan:
    """The outcome of `replan`: the assignment to follow and why."""

    assignment: Assignment
    cost: CostBreakdown
    #: True when the fresh plan won by at least min_gain and replaced the repaired current one
    replanned: bool
    #: round time of the current assignment after removing leavers and placing newcomers
    repaired_seconds: float
    #: round time of the fresh plan that was considered
    fresh_seconds: float
    #: peers present before and after whose path changed
    moved_peers: tuple[str, ...]


def replan(
    current: Assignment,
    snapshot: SwarmSnapshot,
    seed: int = 0,
    min_gain: float = 0.1,
    config: SearchConfig | None = None,
) -> Replan:
    """Re-plan on join/leave with hysteresis (see the module docstring)."""
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
    model = CostModel(snapshot)
    n_paths = snapshot.grid.n_paths
    placed = set(model.peers)
    kept = {p: path for p, path in current.path_of_peer.items() if p in placed and 0 <= path < n_paths}
    repaired = _repair(kept, sorted(placed - set(kept)), snapshot, n_paths)
    repaired_cost = round_cost(repaired, snapshot)
    fresh = plan(snapshot, seed, config)
    aligned = _align_paths(fresh.assignment, repaired, snapshot, fresh.cost.round_seconds)
    fresh_cost = round_cost(aligned, snapshot)
    # Strictly better as well: with min_gain=0 an equally good plan must not move anyone.
    take = (
        fresh_cost.round_seconds <= (1.0 - min_gain) * repaired_cost.round_seconds
        and fresh_cost.round_seconds < repaired_cost.round_seconds
    )
    chosen, cost = (aligned, fresh_cost) if take else (repaired, repaired_cost)
    moved = tuple(
        p
        for p in sorted(kept)
        if p in chosen.path_of_peer and chosen.path_of_peer[p] != current.path_of_peer[p]
    )
    return Replan(chosen, cost, take, repaired_cost.round_seconds, fresh_cost.round_seconds, moved)


def _repair(kept: dict[str, int], newcomers: list[str], snapshot: SwarmSnapshot, n_paths: int) -> Assignment:
    """Newcomers go to the least-covered paths (the cheapest of those for them); then, if leavers
    unbalanced the groups, members move from the largest groups to the smallest, cheapest first."""
    path_of = dict(kept)
    # members of each path, kept up to date, so that pricing a candidate costs its group's size
    # and not a scan of the whole swarm (thousands of candidates at 10k peers)
    members: list[set[str]] = [set() for _ in range(n_paths)]
    for q, x in path_of.items():
        members[x].add(q)

    def cost_with(p: str, path: int) -> float:
        group = members[path] | {p}
        return round_cost(Assignment(dict.fromkeys(group, path), n_paths), snapshot).communication_seconds

    def assign(p: str, path: int) -> None:
        if p in path_of:
            members[path_of[p]].discard(p)
        path_of[p] = path
        members[path].add(p)

    for p in newcomers:
        counts = np.array([len(m) for m in members])
        least = np.flatnonzero(counts == counts.min())
        assign(p, int(min(least, key=lambda x: (cost_with(p, int(x)), x))))
    while path_of:
        counts = np.array([len(m) for m in members])
        big, small = int(np.argmax(counts)), int(np.argmin(counts))
        if counts[big] - counts[small] <= 1:
            break
        pick = min(sorted(members[big]), key=lambda q: (cost_with(q, small), q))
        assign(pick, small)
    return Assignment(path_of, n_paths)


def _align_paths(
    fresh: Assignment, current: Assignment, snapshot: SwarmSnapshot, seconds: float
) -> Assignment:
    """Renames the fresh plan's paths to overlap the current one most, if that costs nothing
    (it does not when data shares are uniform): fewer peers then have to switch path."""
    n_paths = fresh.n_paths
    overlap = np.zeros((n_paths, n_paths), dtype=np.int64)
    for p, path in fresh.path_of_peer.items():
        if p in current.path_of_peer:
            overlap[path, current.path_of_peer[p]] += 1
    mapping = np.full(n_paths, -1, dtype=np.int64)
    taken = np.zeros(n_paths, dtype=bool)
    for k in np.lexsort((np.arange(n_paths * n_paths), -overlap.ravel())):
        i, j = divmod(int(k), n_paths)
        if mapping[i] < 0 and not taken[j]:
            mapping[i], taken[j] = j, True
    renamed = Assignment({p: int(mapping[x]) for p, x in fresh.path_of_peer.items()}, n_paths)
    if round_cost(renamed, snapshot).round_seconds <= seconds + 1e-9:
        return renamed
    return fresh
