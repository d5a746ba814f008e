"""Balanced partitions of the peers into path groups: random, greedy and exhaustive.

A plan partitions the N placed peers into G = min(P, N) groups whose sizes differ by at most one:
when N >= P every path is covered before any is doubled; when N < P every peer is alone on its
own path and P - N paths stay uncovered (`CostBreakdown.uncovered_paths` names them).

`random_labels` and `greedy_labels` are the baselines the genetic search is measured against;
`exhaustive_labels` is the exact optimum for tiny swarms.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np

from peer.scheduler.cost import Assignment, CostModel
from peer.scheduler.snapshot import SwarmSnapshot


def random_labels(model: CostModel, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random balanced partition."""
    labels = np.empty(model.n, dtype=np.int64)
    labels[rng.permutation(model.n)] = np.repeat(np.arange(model.n_groups), model.sizes())
    return labels


def random_assignment(snapshot: SwarmSnapshot, seed: int) -> Assignment:
    """The no-scheduler baseline: peers dealt to paths at random, balanced."""
    model = CostModel(snapshot)
    return model.to_assignment(random_labels(model, np.random.default_rng(seed)))


def greedy_labels(model: CostModel) -> np.ndarray:
    """Greedy latency/bandwidth clustering, the "obvious" scheduler a maintainer would write.

    Groups are filled one at a time (larger sizes first). Each starts from the unplaced peer that
    is most remote from the other unplaced peers (largest summed link cost; remote peers first, so
    they are not left over for a group of strangers at the end), then repeatedly adds the unplaced
    peer with the smallest summed link cost to the group's current members until it is full.
    Ties go to the lower peer index (sorted id). No look-ahead and no repair: that is what the
    genetic search adds.
    """
    sizes = model.sizes()
    labels = np.full(model.n, -1, dtype=np.int64)
    if model.n == 0:
        return labels
    links = model.links(int(sizes[0])).astype(np.float64)
    free = np.ones(model.n, dtype=bool)
    for g, size in enumerate(sizes):
        idx = np.flatnonzero(free)
        seed = idx[np.argmax(links[np.ix_(idx, idx)].sum(axis=1))]
        labels[seed], free[seed] = g, False
        to_group = links[:, seed].copy()
        for _ in range(int(size) - 1):
            idx = np.flatnonzero(free)
            pick = idx[np.argmin(to_group[idx])]
            labels[pick], free[pick] = g, False
            to_group += links[:, pick]
    return labels


def greedy_assignment(snapshot: SwarmSnapshot) -> Assignment:
    model = CostModel(snapshot)
    return model.to_assignment(greedy_labels(model))


def count_balanced_partitions(n: int, n_groups: int) -> int:
    """Balanced partitions of n labelled peers into n_groups unlabelled groups."""
    if n_groups <= 0:
        return 1
    base, extra = divmod(n, n_groups)
    sizes = [base + 1] * extra + [base] * (n_groups - extra)
    count = math.factorial(n)
    for s in sizes:
        count //= math.factorial(s)
    # Groups of equal size are interchangeable: divide by the relabelings among them.
    return count // (math.factorial(extra) * math.factorial(n_groups - extra))


def iter_balanced_partitions(n: int, sizes: list[int]) -> Iterator[list[tuple[int, ...]]]:
    """Every partition of range(n) into groups of the given sizes, each once up to relabeling.

    The group holding the smallest unplaced peer is chosen first, once per distinct size left,
    so two enumerations never differ only by the order of their groups.
    """

    def rec(rest: tuple[int, ...], sizes_left: tuple[int, ...]) -> Iterator[list[tuple[int, ...]]]:
        if not rest:
            yield []
            return
        first, others = rest[0], rest[1:]
        for size in sorted(set(sizes_left), reverse=True):
            left = list(sizes_left)
            left.remove(size)
            for mates in itertools.combinations(others, size - 1):
                group = (first, *mates)
                remaining = tuple(x for x in others if x not in mates)
                for tail in rec(remaining, tuple(left)):
                    yield [group, *tail]

    yield from rec(tuple(range(n)), tuple(sizes))


def exhaustive_labels(model: CostModel, max_partitions: int = 50_000) -> np.ndarray:
    """The optimum by enumeration (ties: the first enumerated). Refuses sizes it cannot finish."""
    count = count_balanced_partitions(model.n, model.n_groups)
    if count > max_partitions:
        raise ValueError(
            f"exhaustive search over {model.n} peers and {model.n_groups} groups would score {count} "
            f"partitions (limit {max_partitions})"
        )
    best: tuple[tuple[int, int], np.ndarray] | None = None
    labels = np.empty(model.n, dtype=np.int64)
    for partition in iter_balanced_partitions(model.n, [int(s) for s in model.sizes()]):
        for g, group in enumerate(partition):
            labels[list(group)] = g
        score = model.objective(labels)
        if best is None or score < best[0]:
            best = (score, labels.copy())
    assert best is not None
    return best[1]
