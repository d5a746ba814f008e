"""The hybrid genetic search of Yuan et al. (arXiv 2206.01288, section 3.3) over balanced partitions.

Structure, as in the paper (which builds on Bui & Moon's hybrid GA for graph partitioning): a
population of random balanced partitions; each generation, parents produce offspring by five-point
crossover followed by re-balancing; each offspring is improved by local search; the best
individuals survive (elitism). The local search uses the paper's gain: for two groups, only the
fastest intra-group link of each is considered, and a swap is made when that gain is positive.

Two additions of ours (`local.py`), whose effect `benchmarks/scheduler.py` measures (ablation):

* the fastest-link gain stops paying once every peer has one fast neighbour in its group (a group
  of two Tokyo and two London peers looks perfect to it), so a Kernighan-Lin pass over the summed
  link costs follows it, swapping sets of peers between two groups at once;
* both gains are proxies for the true objective (the slowest group's DATAP-COST), so a final
  descent tries swapping each of the slowest group's worst-connected members with every other
  peer (or moving it to a smaller group), scored exactly, and keeps the best strict improvement.

Everything random draws from one `numpy.random.Generator` seeded by the caller, peers are in
sorted-id order and costs are integers, so a (snapshot, seed) pair always yields the same plan.
The search stops after a number of generations scaled with N, or earlier once the best plan has
not improved for `stall_generations`; both depend only on the search itself. A wall-clock budget
is available but off by default because it would make the plan depend on the machine's speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from peer.scheduler.cost import CostModel
from peer.scheduler.local import State, bottleneck_descent, fastest_link_pass, summed_link_pass


@dataclass(frozen=True)
class SearchConfig:
    """Knobs of the genetic search; defaults plan N=1000 in a few seconds on 2 cores."""

    population: int = 10
    #: None: scaled with N so that large swarms stay within the planning budget
    generations: int | None = None
    offspring_per_generation: int = 4
    #: Yuan et al. use five-point crossover (after Bui & Moon)
    crossover_points: int = 5
    #: passes of the paper's fastest-link swaps, then of the summed-link (Kernighan-Lin) swaps;
    #: each stops early once a pass finds nothing
    local_search_passes: int = 6
    kl_passes: int = 64
    descent_steps: int = 48
    #: worst-connected members of the slowest group tried as the outgoing peer of a swap
    descent_candidates: int = 4
    #: use exact enumeration when it scores at most this many partitions
    exhaustive_max_partitions: int = 5000
    #: stop once the best plan has not improved for this many generations (deterministic)
    stall_generations: int = 10
    #: stop after this many seconds; None keeps the plan deterministic
    time_budget_seconds: float | None = None

    def generations_for(self, n: int) -> int:
        if self.generations is not None:
            return self.generations
        return int(np.clip(6000 // max(n, 1), 4, 30))


def local_search(model: CostModel, labels: np.ndarray, config: SearchConfig) -> np.ndarray:
    if model.n_groups <= 1 or model.n_groups >= model.n:
        return labels
    st = State(model, labels)
    for _ in range(config.local_search_passes):
        if fastest_link_pass(st) == 0:
            break
    for _ in range(config.kl_passes):
        if summed_link_pass(st) == 0:
            break
    bottleneck_descent(st, config.descent_steps, config.descent_candidates)
    return st.labels


def _align(parent: np.ndarray, to: np.ndarray, g: int) -> np.ndarray:
    """Relabels `parent`'s groups to overlap `to`'s most (greedy matching), so crossover mixes
    like with like: labels are arbitrary names and would otherwise scramble both parents."""
    overlap = np.zeros((g, g), dtype=np.int64)
    np.add.at(overlap, (parent, to), 1)
    mapping = np.full(g, -1, dtype=np.int64)
    taken = np.zeros(g, dtype=bool)
    for i in np.lexsort((np.arange(g), -overlap.max(axis=1))):
        j = int(np.argmax(np.where(taken, -1, overlap[i])))
        mapping[i], taken[j] = j, True
    return mapping[parent]


def crossover(
    p1: np.ndarray, p2: np.ndarray, model: CostModel, rng: np.random.Generator, points: int
) -> np.ndarray:
    """k-point crossover on the label strings (peers in sorted-id order), then re-balancing:
    over-full groups give randomly chosen members to under-full ones."""
    n, g = model.n, model.n_groups
    p2 = _align(p2, p1, g)
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(points, n - 1), replace=False))
    segment = np.searchsorted(cuts, np.arange(n), side="right")
    child = np.where(segment % 2 == 0, p1, p2)
    counts = np.bincount(child, minlength=g)
    # The groups already largest keep the larger target sizes (ties: lower label).
    target = np.empty(g, dtype=np.int64)
    target[np.lexsort((np.arange(g), -counts))] = model.sizes()
    pool = []
    for grp in np.flatnonzero(counts > target):
        ms = np.flatnonzero(child == grp)
        pool.extend(rng.choice(ms, size=int(counts[grp] - target[grp]), replace=False).tolist())
    pool = [pool[i] for i in rng.permutation(len(pool))]
    for grp in np.flatnonzero(counts < target):
        for _ in range(int(target[grp] - counts[grp])):
            child[pool.pop()] = grp
    return child


def canonical(labels: np.ndarray) -> bytes:
    """A key equal for partitions that differ only by group names."""
    _, first = np.unique(labels, return_index=True)
    rename = np.empty(first.size, dtype=np.int64)
    rename[np.argsort(first)] = np.arange(first.size)
    return rename[labels].astype(np.int32).tobytes()


def genetic_search(
    model: CostModel, rng: np.random.Generator, config: SearchConfig
) -> tuple[np.ndarray, int]:
    """Returns the best labels found and the number of generations run."""
    from peer.scheduler.partition import random_labels

    start = time.monotonic()
    pop: dict[bytes, tuple[tuple[int, int], np.ndarray]] = {}
    for labels in [random_labels(model, rng) for _ in range(max(config.population, 2))]:
        labels = local_search(model, labels, config)
        pop.setdefault(canonical(labels), (model.objective(labels), labels))
    generations = config.generations_for(model.n)
    ran = stalled = 0
    best_score = min(v[0] for v in pop.values())
    for _ in range(generations):
        if stalled >= config.stall_generations:
            break
        if config.time_budget_seconds is not None and time.monotonic() - start > config.time_budget_seconds:
            break
        ranked = [v for _, v in sorted(pop.items(), key=lambda kv: (kv[1][0], kv[0]))]
        for _ in range(config.offspring_per_generation):
            # Parents from the better half more often: a binary tournament on rank.
            i, j = (min(rng.integers(0, len(ranked), size=2)) for _ in range(2))
            if i == j:
                j = (i + 1) % len(ranked)
            child = crossover(ranked[i][1], ranked[j][1], model, rng, config.crossover_points)
            child = local_search(model, child, config)
            key = canonical(child)
            if key not in pop:
                pop[key] = (model.objective(child), child)
        # Elitism: the best `population` individuals, ties broken by their canonical key.
        keep = sorted(pop.items(), key=lambda kv: (kv[1][0], kv[0]))[: config.population]
        pop = dict(keep)
        ran += 1
        score = keep[0][1][0]
        stalled = 0 if score < best_score else stalled + 1
        best_score = min(best_score, score)
    best = min(pop.items(), key=lambda kv: (kv[1][0], kv[0]))
    return best[1][1], ran
