"""Yuan et al.'s cost model (arXiv 2206.01288, section 3) applied to a DiPaCo round.

A round is H inner steps on every peer, then each path group averages its outer-gradient fragment:

    round = compute + max over groups C of DATAP-COST(C) + token-balance penalty
    compute = H * max over peers of (tokens_per_step / tokens_per_second)
    DATAP-COST(C) = max_{d in C} sum_{d' in C \\ d} 2 * (alpha_dd' + c / (|C| * beta_dd'))

Groups are disjoint sets of peers that average at the same time, so they use disjoint links and
overlap in time: the round waits for the slowest group (max), not for their sum. Every peer runs
the same H steps, so compute is the slowest peer's H steps whatever the partition; what the
partition changes is the communication and how many tokens each path gets (the penalty).

Two ways to average (`GridSpec.exchange`, per link d -> d' in `link_seconds`): Yuan et al.'s
all-reduce, 2 * (alpha + c / (|C| * beta)), and pathswarm's robust round ("all_to_all"), where
every member sends its whole part to every other member, because a robust aggregate needs each
part whole: ALL_TO_ALL_LATENCIES * alpha + c / beta. A live swarm also averages the modules
every path holds (the trunk) with *every* placed peer, whatever the partition: each peer's
summed links to all others at `GridSpec.shared_fragment_bytes` (`shared_ns`) are added to its
cost in its path group, so the group's cost is max over d of (shared(d) + sum over C \\ d).
The search sees the same sums: a constant per peer moves no swap's gain, but the slowest member
of a group can be one with the costliest shared links. (Modules shared by some paths only, in a
grid of several levels, are priced inside the path group: an under-estimate there.)

Costs are integers in nanoseconds. Summing integers is exact and order-free, so every peer ranks
plans identically on any CPU; a float sum could round differently and break a tie another way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from peer.scheduler.snapshot import SwarmSnapshot

NS_PER_SECOND = 1e9
#: One-way latencies a robust round pays per pair (`docs/sync-protocol.md`): the part's header,
#: the receiver's accept, the payload; the signed report; the echo of the reports.
ALL_TO_ALL_LATENCIES = 5
#: Rows per block when filling or reducing N x N matrices: bounds temporaries to ~ROW_BLOCK x N.
ROW_BLOCK = 512
#: Above this many peers the (up to three) cached sums of two sizes' link matrices would cost more
#: memory (8 N^2 bytes each) than the time they save.
PAIR_CACHE_MAX_PEERS = 4096


@dataclass(frozen=True)
class Assignment:
    """Which path each placed peer trains. Peers absent from `path_of_peer` are not placed."""

    path_of_peer: Mapping[str, int]
    n_paths: int

    def groups(self) -> list[list[str]]:
        """Peers of each path (sorted ids), indexed by path."""
        out: list[list[str]] = [[] for _ in range(self.n_paths)]
        for peer, path in sorted(self.path_of_peer.items()):
            out[path].append(peer)
        return out

    def uncovered_paths(self) -> list[int]:
        return [p for p, g in enumerate(self.groups()) if not g]

    def peers(self) -> list[str]:
        return sorted(self.path_of_peer)

    def is_balanced(self) -> bool:
        """Sizes differ by at most one and no path is doubled while another is empty."""
        sizes = [len(g) for g in self.groups()]
        return max(sizes) - min(sizes) <= 1


@dataclass(frozen=True)
class CostBreakdown:
    """One plan's round time, in seconds, and its parts."""

    round_seconds: float
    compute_seconds: float
    communication_seconds: float
    token_balance_seconds: float
    #: DATAP-COST of each path's group (0 for an uncovered path or a lone holder)
    group_seconds: tuple[float, ...]
    uncovered_paths: tuple[int, ...] = ()
    #: Peers left out because they lack the memory for a whole path
    unplaced_peers: tuple[str, ...] = field(default=())


def datap_cost(
    latency_seconds: np.ndarray, bandwidth_bytes_per_second: np.ndarray, fragment_bytes: float
) -> float:
    """DATAP-COST of one group given its own |C| x |C| latency and bandwidth matrices, in seconds.

    Each member sends its share c/|C| to and receives it from every other member (the
    all-reduce of Yuan et al., eq. for DATAP-COST): the slowest member's sum is the group's time.
    """
    lat = np.asarray(latency_seconds, dtype=float)
    bw = np.asarray(bandwidth_bytes_per_second, dtype=float)
    n = lat.shape[0]
    if n <= 1:
        return 0.0
    with np.errstate(divide="ignore"):
        per_link = 2.0 * (lat + fragment_bytes / (n * bw))
    np.fill_diagonal(per_link, 0.0)
    return float(per_link.sum(axis=1).max())


def link_seconds(
    latency_seconds: np.ndarray, bandwidth_bytes_per_second: np.ndarray, fragment_bytes: float,
    size: int, exchange: str,
) -> np.ndarray:  # fmt: skip
    """Seconds d spends on its link to d' in one averaging of a group of `size` (elementwise; the
    diagonal is the caller's to zero). See the module docstring for the two exchanges."""
    with np.errstate(divide="ignore"):
        if exchange == "all_to_all":
            return ALL_TO_ALL_LATENCIES * latency_seconds + fragment_bytes / bandwidth_bytes_per_second
        return 2.0 * (latency_seconds + fragment_bytes / (size * bandwidth_bytes_per_second))


def pipeline_cost(stage_peer_ids: Sequence[str], activation_bytes: float, snapshot: SwarmSnapshot) -> float:
    """PIPELINE-COST of one path split over a chain of peers (stage i on `stage_peer_ids[i]`), seconds.

    Yuan et al. charge every stage boundary the activations forward and their gradients backward:
    sum over consecutive stages of 2 * (alpha + a / beta), with `a` the activation bytes of one
    batch at a boundary. Cost-model only: the trainer does not split paths yet, so the planner does
    not call it; it is here so that a peer too small for a whole path can be priced later.
    """
    idx = snapshot.index()
    total = 0.0
    for a, b in zip(stage_peer_ids, stage_peer_ids[1:], strict=False):
        i, j = idx[a], idx[b]
        if i == j:
            continue
        total += 2.0 * (
            snapshot.latency_seconds[i, j] + activation_bytes / snapshot.bandwidth_bytes_per_second[i, j]
        )
    return float(total)


class CostModel:
    """The snapshot's cost terms precomputed for fast, exact evaluation of many partitions.

    Works on *labels*: an int array over the placed peers (`self.peers`, sorted) giving each one's
    group 0..G-1, G = min(n_paths, placed peers). Groups are unlabelled while searching; `paths_of`
    maps them to paths afterwards (largest token throughput to largest data share).
    """

    def __init__(self, snapshot: SwarmSnapshot):
        self.snapshot = snapshot
        grid = snapshot.grid
        need = grid.path_memory_bytes
        fits = np.ones(snapshot.n_peers, bool) if need is None else snapshot.memory_bytes >= need
        self.peer_index = np.flatnonzero(fits)
        self.peers = tuple(snapshot.peer_ids[i] for i in self.peer_index)
        self.unplaced = tuple(snapshot.peer_ids[i] for i in np.flatnonzero(~fits))
        self.n = len(self.peers)
        self.n_paths = grid.n_paths
        self.n_groups = min(grid.n_paths, self.n)
        if self.n == snapshot.n_peers:  # the snapshot's read-only arrays: no N x N copy
            self._lat, self._bw = snapshot.latency_seconds, snapshot.bandwidth_bytes_per_second
        else:
            sub = np.ix_(self.peer_index, self.peer_index)
            self._lat = snapshot.latency_seconds[sub]
            self._bw = snapshot.bandwidth_bytes_per_second[sub]
        self._fragment = float(grid.fragment_bytes)
        self._exchange = grid.exchange
        self._by_size: dict[object, np.ndarray] = {}
        #: shared_ns[i]: i's summed links to every other placed peer for the modules all paths hold
        self.shared_ns = self._shared_ns(float(grid.shared_fragment_bytes), int(grid.shared_group_size))
        # Throughput in milli-tokens/s as integers: group sums are exact, hence order-free.
        self.tps = np.round(snapshot.tokens_per_second[self.peer_index] * 1000).astype(np.int64)
        step = grid.tokens_per_step / snapshot.tokens_per_second[self.peer_index]
        self.compute_ns = int(round(grid.inner_steps * float(step.max()) * NS_PER_SECOND)) if self.n else 0
        self.balance_weight = float(grid.token_balance_weight)
        # With equal throughputs, swaps (and size-preserving moves) cannot change the penalty.
        self.balance_varies = self.balance_weight > 0 and bool(np.any(self.tps != self.tps[:1]))
        self.demand = grid.demand()
        # Paths by data share, largest first; ties to the lower index, so labelling is deterministic.
        self.path_order = np.lexsort((np.arange(self.n_paths), -self.demand))

    def sizes(self) -> np.ndarray:
        """Balanced group sizes, larger groups first: sizes differ by at most one."""
        g = max(self.n_groups, 1)
        base, extra = divmod(self.n, g)
        return np.array([base + 1] * extra + [base] * (g - extra), dtype=np.int64)

    def links(self, size: int) -> np.ndarray:
        """Per-link cost (`link_seconds`) in integer ns for groups of `size` (diag 0).

        Filled in blocks of rows so that a 10k-peer swarm needs no N x N float temporaries."""
        m = self._by_size.get(size)
        if m is None:
            m = np.empty((self.n, self.n), dtype=np.int64)
            for start in range(0, self.n, ROW_BLOCK):
                rows = np.arange(start, min(start + ROW_BLOCK, self.n))
                m[rows] = self.block(size, rows, slice(None))
            m.setflags(write=False)
            self._by_size[size] = m
        return m

    def pair_links(self, size_a: int, size_b: int) -> np.ndarray | None:
        """links(size_a) + links(size_b), for gains that price a link in two groups at once; cached
        while such a matrix stays small (None above PAIR_CACHE_MAX_PEERS: sum two gathers instead)."""
        if self.n > PAIR_CACHE_MAX_PEERS:
            return None
        key = ("pair", min(size_a, size_b), max(size_a, size_b))
        m = self._by_size.get(key)
        if m is None:
            m = self.links(size_a) + self.links(size_b)
            m.setflags(write=False)
            self._by_size[key] = m
        return m

    def block(self, size: int, rows: np.ndarray, cols, fragment_bytes: float | None = None) -> np.ndarray:
        """`links(size)[rows][:, cols]` computed from the measurements (rows: an index array);
        element by element the same arithmetic as the full matrix, so the same integers."""
        c = self._fragment if fragment_bytes is None else fragment_bytes
        sec = link_seconds(self._lat[rows][:, cols], self._bw[rows][:, cols], c, size, self._exchange)
        col_ids = np.arange(self.n)[cols]
        sec[rows[:, None] == col_ids[None, :]] = 0.0
        return np.round(sec * NS_PER_SECOND).astype(np.int64)

    def _shared_ns(self, shared_bytes: float, group_size: int) -> np.ndarray:
        out = np.zeros(self.n, dtype=np.int64)
        if shared_bytes == 0 or self.n < 2:
            return out
        size = self.n if group_size == 0 else min(group_size, self.n)
        for start in range(0, self.n, ROW_BLOCK):
            rows = np.arange(start, min(start + ROW_BLOCK, self.n))
            total = self.block(size, rows, slice(None), shared_bytes).sum(axis=1)
            # rotating subgroups: (size - 1) partners a round, each link as often as any other
            out[rows] = total * (size - 1) // (self.n - 1)
        out.setflags(write=False)
        return out

    # --- evaluation -------------------------------------------------------------------------

    def group_sums(self, labels: np.ndarray) -> np.ndarray:
        """S[i, g] = sum of i's link costs to the members of group g (at g's size), (n, G) int64."""
        counts = np.bincount(labels, minlength=self.n_groups)
        out = np.zeros((self.n, self.n_groups), dtype=np.int64)
        for size in np.unique(counts):
            if size == 0:
                continue
            gs = np.flatnonzero(counts == size)
            cols = np.flatnonzero(np.isin(labels, gs))
            cols = cols[np.argsort(labels[cols], kind="stable")]
            starts = np.searchsorted(labels[cols], gs)
            links = self.links(int(size))
            for start in range(0, self.n, ROW_BLOCK):  # an N x |cols| gather would double the memory
                stop = min(start + ROW_BLOCK, self.n)
                out[start:stop, gs] = np.add.reduceat(links[start:stop][:, cols], starts, axis=1)
        # a peer's shared links count in whichever group it is: an offset on all of its row
        return out + self.shared_ns[:, None]

    def group_costs(self, labels: np.ndarray, sums: np.ndarray | None = None) -> np.ndarray:
        """DATAP-COST of every group in ns, with its members' shared links (`shared_ns`), shape (G,)."""
        out = np.zeros(self.n_groups, dtype=np.int64)
        if sums is None:
            # Each group's own block only: O(sum of squared sizes), and no matrix per group size
            # (a repaired assignment can have many sizes).
            order = np.argsort(labels, kind="stable")
            bounds = np.searchsorted(labels[order], np.arange(self.n_groups + 1))
            for g in range(self.n_groups):
                ms = order[bounds[g] : bounds[g + 1]]
                if ms.size > 1:
                    out[g] = (self.block(int(ms.size), ms, ms).sum(axis=1) + self.shared_ns[ms]).max()
                elif ms.size == 1:
                    out[g] = self.shared_ns[ms[0]]
            return out
        own = sums[np.arange(self.n), labels]
        np.maximum.at(out, labels, own)
        return out

    def balance_ns(self, group_tps: np.ndarray, paths: np.ndarray | None = None) -> np.ndarray:
        """Token-balance penalty in ns for one or many (..., G) rows of group throughputs.

        Path p gets share_p of the data; with throughput T_p it needs share_p / (T_p / sum T) >= 1
        times the balanced time to get through its tokens. The penalty is (max of that ratio - 1) *
        compute * weight: the extra time per round the most starved path would need to keep pace.
        0 when throughput follows the data. Without `paths`, groups are matched to paths by sorting
        (most tokens/s to most data), which minimises that max ratio.
        """
        t = np.asarray(group_tps, dtype=np.float64)
        if self.balance_weight == 0 or t.shape[-1] == 0:
            return np.zeros(t.shape[:-1], dtype=np.int64)
        if paths is None:
            t = np.sort(t, axis=-1)[..., ::-1]
            share = self.demand[self.path_order[: t.shape[-1]]]
        else:
            share = self.demand[paths]
        share = share / share.sum()
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.max(share * t.sum(axis=-1, keepdims=True) / t, axis=-1)
        return np.round((ratio - 1.0) * self.compute_ns * self.balance_weight).astype(np.int64)

    def group_tps(self, labels: np.ndarray) -> np.ndarray:
        # Integer milli-tokens summed as float64 stay exact below 2**53.
        return np.bincount(labels, weights=self.tps, minlength=self.n_groups).astype(np.int64)

    def round_ns(self, labels: np.ndarray) -> int:
        costs = self.group_costs(labels)
        return self.compute_ns + int(costs.max(initial=0)) + int(self.balance_ns(self.group_tps(labels)))

    def objective(self, labels: np.ndarray) -> tuple[int, int]:
        """What the search minimises: the round time, then the sum of group costs as tie-break
        (the max alone is flat wherever the slowest group cannot improve)."""
        costs = self.group_costs(labels)
        bal = int(self.balance_ns(self.group_tps(labels)))
        return self.compute_ns + int(costs.max(initial=0)) + bal, int(costs.sum())

    def paths_of(self, labels: np.ndarray) -> np.ndarray:
        """Path of each group: the group with most tokens/s gets the path with most data."""
        t = self.group_tps(labels)
        groups = np.lexsort((np.arange(self.n_groups), -t))
        out = np.empty(self.n_groups, dtype=np.int64)
        out[groups] = self.path_order[: self.n_groups]
        return out

    def to_assignment(self, labels: np.ndarray) -> Assignment:
        paths = self.paths_of(labels)
        return Assignment({p: int(paths[g]) for p, g in zip(self.peers, labels, strict=True)}, self.n_paths)

    def breakdown(self, labels: np.ndarray, paths: np.ndarray | None = None) -> CostBreakdown:
        if paths is None:
            paths = self.paths_of(labels)
        costs = self.group_costs(labels)
        per_path = np.zeros(self.n_paths)
        per_path[paths] = costs / NS_PER_SECOND
        bal = int(self.balance_ns(self.group_tps(labels), paths))
        comm = int(costs.max(initial=0))
        return CostBreakdown(
            round_seconds=(self.compute_ns + comm + bal) / NS_PER_SECOND,
            compute_seconds=self.compute_ns / NS_PER_SECOND,
            communication_seconds=comm / NS_PER_SECOND,
            token_balance_seconds=bal / NS_PER_SECOND,
            group_seconds=tuple(float(x) for x in per_path),
            uncovered_paths=tuple(sorted(set(range(self.n_paths)) - {int(p) for p in paths})),
            unplaced_peers=self.unplaced,
        )


def round_cost(assignment: Assignment, snapshot: SwarmSnapshot) -> CostBreakdown:
    """Cost of a given assignment (any sizes, not only balanced ones) under the snapshot.

    Peers of the assignment missing from the snapshot are ignored; snapshot peers missing from the
    assignment do not count (they are not training this round).
    """
    ids = set(snapshot.peer_ids)
    known = [p for p in assignment.peers() if p in ids]
    if not known:
        return CostBreakdown(
            0.0, 0.0, 0.0, 0.0, (0.0,) * assignment.n_paths, tuple(range(assignment.n_paths))
        )
    sub = snapshot.subset(known).with_grid(n_paths=assignment.n_paths, path_memory_bytes=None)
    model = CostModel(sub)
    paths = np.array([assignment.path_of_peer[p] for p in model.peers], dtype=np.int64)
    used, labels = np.unique(paths, return_inverse=True)
    model.n_groups = len(used)
    return model.breakdown(labels.astype(np.int64), paths=used)
