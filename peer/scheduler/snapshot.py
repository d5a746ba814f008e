"""What the scheduler plans from: a snapshot of the swarm's measurements plus the grid's workload.

The measurements come from the DHT (each peer publishes its tokens/s, memory and probes to a bounded
sample of other peers), so a snapshot is usually partial and asymmetric. `SwarmSnapshot` turns it
into the dense, symmetric, complete form the cost model needs, in one place and with documented
rules, so that every peer that sees the same records derives the same matrices:

* peers are sorted by id: the input order never changes a plan;
* a link measured in both directions keeps the *worse* of the two (max latency, min bandwidth),
  because an all-reduce pays for its slowest direction;
* a missing link, throughput or memory gets a conservative default (the worst value observed in
  this snapshot, or a fixed pessimistic constant when nothing was observed), so the planner prefers
  links it has evidence for rather than betting on unknown ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

#: Used only when a snapshot has no latency measurement at all: a slow intercontinental link
#: (Yuan et al. 2022, arXiv 2206.01288, measured up to ~265 ms between AWS regions).
DEFAULT_LATENCY_SECONDS = 0.25
#: Used only when a snapshot has no bandwidth measurement at all: 100 Mbit/s, below every
#: inter-region link Yuan et al. measured (>= 0.33 Gbps), i.e. pessimistic for a volunteer swarm.
DEFAULT_BANDWIDTH_BYTES_PER_SECOND = 100e6 / 8
#: Used only when no peer reported a throughput: the value is irrelevant to the ranking of plans
#: when all peers share it, it only scales the compute term.
DEFAULT_TOKENS_PER_SECOND = 1000.0
#: The ways a group can average, see `GridSpec.exchange`.
EXCHANGES = ("all_reduce", "all_to_all")


@dataclass(frozen=True)
class GridSpec:
    """The DiPaCo grid and the round's workload, as the cost model sees them.

    `fragment_bytes` is `c` in DATAP-COST: the bytes each holder contributes to one averaging of its
    path group (an outer-gradient fragment after quantization). A round is `inner_steps` (H) inner
    steps of `tokens_per_step` tokens each, then the averaging.
    """

    n_paths: int
    fragment_bytes: float
    inner_steps: int = 1
    tokens_per_step: int = 1
    #: Share of the data routed to each path (None: uniform). Sums to 1 after normalisation.
    path_token_weights: tuple[float, ...] | None = None
    #: Scale of the token-balance penalty (0 disables it); see `cost.token_balance_seconds`.
    token_balance_weight: float = 1.0
    #: Memory a peer needs to hold a whole path; peers below it are left out of the partition
    #: (they would need the path split across peers, see `cost.pipeline_cost`). None: no check.
    path_memory_bytes: int | None = None
    #: How a group averages (`cost.link_seconds`): "all_reduce" is Yuan et al.'s (each member sends
    #: a 1/|C| share to each other member); "all_to_all" is pathswarm's robust round, where each
    #: member sends its whole part to every other member (a robust aggregate needs every part).
    exchange: str = "all_reduce"
    #: Bytes of the modules every path holds (the trunk): each placed peer averages them with every
    #: other placed peer, whatever the partition, on top of its path group's `fragment_bytes`.
    shared_fragment_bytes: float = 0.0
    #: Subgroup size the shared modules average in (`sync.max_group_size`; 0: all placed peers).
    #: Subgroups rotate over the rounds, so a peer's shared cost is priced as its mean link times
    #: its partners per round: an expectation, not any one round.
    shared_group_size: int = 0

    def __post_init__(self) -> None:
        if self.n_paths < 1:
            raise ValueError(f"n_paths must be >= 1, got {self.n_paths}")
        if not (np.isfinite(self.fragment_bytes) and self.fragment_bytes >= 0):
            raise ValueError(f"fragment_bytes must be finite and >= 0, got {self.fragment_bytes}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {self.exchange!r}")
        if not (np.isfinite(self.shared_fragment_bytes) and self.shared_fragment_bytes >= 0):
            raise ValueError(
                f"shared_fragment_bytes must be finite and >= 0, got {self.shared_fragment_bytes}"
            )
        if self.shared_group_size < 0:
            raise ValueError(f"shared_group_size must be >= 0, got {self.shared_group_size}")
        if self.inner_steps < 0 or self.tokens_per_step < 0:
            raise ValueError("inner_steps and tokens_per_step must be >= 0")
        if self.token_balance_weight < 0:
            raise ValueError("token_balance_weight must be >= 0")
        if self.path_token_weights is not None:
            w = np.asarray(self.path_token_weights, dtype=float)
            if w.shape != (self.n_paths,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
                raise ValueError("path_token_weights needs n_paths finite non-negative values, not all 0")

    def demand(self) -> np.ndarray:
        """Normalised share of tokens per path, shape (n_paths,)."""
        if self.path_token_weights is None:
            return np.full(self.n_paths, 1.0 / self.n_paths)
        w = np.asarray(self.path_token_weights, dtype=float)
        return w / w.sum()


@dataclass(frozen=True)
class LinkMeasurement:
    """One probe result as read from the DHT: `src` measured `dst` (one direction)."""

    src: str
    dst: str
    latency_seconds: float | None = None
    bandwidth_bytes_per_second: float | None = None


@dataclass(frozen=True)
class PeerMeasurement:
    """One peer's self-reported capacity; None where the record lacks the field."""

    tokens_per_second: float | None = None
    memory_bytes: int | None = None


def _check_matrix(name: str, m: np.ndarray, n: int) -> None:
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {m.shape}")
    if m.shape[0] != n:
        raise ValueError(f"{name} is {m.shape[0]}x{m.shape[1]} but there are {n} peers")


@dataclass(frozen=True)
class SwarmSnapshot:
    """Dense, symmetric, complete measurements of N peers (sorted by id) plus the grid.

    Build it with `from_matrices` or `from_measurements`; both sort, symmetrise and fill defaults.
    The arrays are read-only. Diagonals: latency 0, bandwidth +inf (a peer does not send to itself).
    """

    peer_ids: tuple[str, ...]
    tokens_per_second: np.ndarray
    memory_bytes: np.ndarray  # float, so that unknown could be represented before filling
    latency_seconds: np.ndarray
    bandwidth_bytes_per_second: np.ndarray
    grid: GridSpec
    #: How many values were filled by defaults, for logs and the CLI (links count unordered pairs).
    filled: Mapping[str, int] = field(default_factory=dict)

    @property
    def n_peers(self) -> int:
        return len(self.peer_ids)

    def index(self) -> dict[str, int]:
        return {p: i for i, p in enumerate(self.peer_ids)}

    def with_grid(self, **changes) -> SwarmSnapshot:
        return replace(self, grid=replace(self.grid, **changes))

    def subset(self, peer_ids: Iterable[str]) -> SwarmSnapshot:
        """The same measurements restricted to some peers (unknown ids raise KeyError)."""
        idx = self.index()
        keep = np.array(sorted(idx[p] for p in set(peer_ids)), dtype=np.int64)
        if keep.size == self.n_peers:  # everyone: the same read-only arrays, no N x N copy
            return self
        return SwarmSnapshot(
            peer_ids=tuple(self.peer_ids[i] for i in keep),
            tokens_per_second=_ro(self.tokens_per_second[keep]),
            memory_bytes=_ro(self.memory_bytes[keep]),
            latency_seconds=_ro(self.latency_seconds[np.ix_(keep, keep)]),
            bandwidth_bytes_per_second=_ro(self.bandwidth_bytes_per_second[np.ix_(keep, keep)]),
            grid=self.grid,
            filled=dict(self.filled),
        )

    @classmethod
    def from_matrices(
        cls,
        peer_ids: Sequence[str],
        latency_seconds: Sequence[Sequence[float | None]] | np.ndarray,
        bandwidth_bytes_per_second: Sequence[Sequence[float | None]] | np.ndarray,
        grid: GridSpec,
        tokens_per_second: Sequence[float | None] | np.ndarray | None = None,
        memory_bytes: Sequence[int | None] | np.ndarray | None = None,
    ) -> SwarmSnapshot:
        """From N x N matrices in the order of `peer_ids`; NaN or None marks a missing value."""
        ids = [str(p) for p in peer_ids]
        n = len(ids)
        if n == 0:
            raise ValueError("a snapshot needs at least one peer")
        if len(set(ids)) != n:
            raise ValueError("peer ids must be unique")
        lat = _as_float(latency_seconds, "latency_seconds")
        bw = _as_float(bandwidth_bytes_per_second, "bandwidth_bytes_per_second")
        _check_matrix("latency_seconds", lat, n)
        _check_matrix("bandwidth_bytes_per_second", bw, n)
        tps = _as_float([None] * n if tokens_per_second is None else tokens_per_second, "tokens_per_second")
        mem = _as_float([None] * n if memory_bytes is None else memory_bytes, "memory_bytes")
        for name, v in (("tokens_per_second", tps), ("memory_bytes", mem)):
            if v.shape != (n,):
                raise ValueError(f"{name} has {v.size} values but there are {n} peers")
        order = np.argsort(np.array(ids, dtype=object), kind="stable")
        if np.array_equal(order, np.arange(n)):  # already sorted: no N x N reordering copies
            return cls._normalised(tuple(ids), tps, mem, lat, bw, grid)
        return cls._normalised(
            tuple(ids[i] for i in order),
            tps[order],
            mem[order],
            lat[np.ix_(order, order)],
            bw[np.ix_(order, order)],
            grid,
        )

    @classmethod
    def from_measurements(
        cls,
        peers: Mapping[str, PeerMeasurement],
        links: Iterable[LinkMeasurement],
        grid: GridSpec,
    ) -> SwarmSnapshot:
        """From DHT records: one measurement per peer, any subset of directed link probes.

        Links naming a peer not in `peers` are ignored (its record expired); a pair probed twice in
        the same direction keeps the worse value, for the same reason as symmetrisation.
        """
        ids = sorted(peers)
        n = len(ids)
        idx = {p: i for i, p in enumerate(ids)}
        lat = np.full((n, n), np.nan)
        bw = np.full((n, n), np.nan)
        for m in links:
            i, j = idx.get(m.src), idx.get(m.dst)
            if i is None or j is None or i == j:
                continue
            if m.latency_seconds is not None:
                lat[i, j] = np.fmax(lat[i, j], m.latency_seconds)
            if m.bandwidth_bytes_per_second is not None:
                bw[i, j] = np.fmin(bw[i, j], m.bandwidth_bytes_per_second)
        tps = [peers[p].tokens_per_second for p in ids]
        mem = [peers[p].memory_bytes for p in ids]
        return cls.from_matrices(ids, lat, bw, grid, tps, mem)

    @classmethod
    def _normalised(cls, ids, tps, mem, lat, bw, grid) -> SwarmSnapshot:
        # Written for N in the tens of thousands: checks and fills work in place on the new
        # symmetrised arrays (the inputs are never modified), with no N^2 boolean gathers.
        n = len(ids)
        off = ~np.eye(n, dtype=bool)
        with np.errstate(invalid="ignore"):
            if np.any(np.isinf(lat)) or np.any(lat < 0):
                raise ValueError("latency_seconds must be finite and >= 0")
            if np.any((bw <= 0) & off):
                raise ValueError("bandwidth_bytes_per_second must be > 0 between distinct peers")
        if np.any(tps[~np.isnan(tps)] <= 0) or np.any(np.isinf(tps)):
            raise ValueError("tokens_per_second must be finite and > 0")
        if np.any(mem[~np.isnan(mem)] < 0) or np.any(np.isinf(mem)):
            raise ValueError("memory_bytes must be finite and >= 0")
        # The slower direction decides an exchange; fmax/fmin ignore a missing direction.
        lat = np.fmax(lat, lat.T)
        bw = np.fmin(bw, bw.T)
        np.fill_diagonal(lat, np.nan)  # the diagonal is neither observed nor missing: set below
        np.fill_diagonal(bw, np.nan)
        lat_gap, bw_gap = np.isnan(lat), np.isnan(bw)
        filled = {
            "links": int((np.count_nonzero(lat_gap | bw_gap) - n) // 2),
            "tokens_per_second": int(np.isnan(tps).sum()),
            "memory_bytes": int(np.isnan(mem).sum()),
        }
        lat[lat_gap] = np.nanmax(lat) if not lat_gap.all() else DEFAULT_LATENCY_SECONDS
        bw[bw_gap] = np.nanmin(bw) if not bw_gap.all() else DEFAULT_BANDWIDTH_BYTES_PER_SECOND
        del lat_gap, bw_gap
        np.fill_diagonal(lat, 0.0)
        np.fill_diagonal(bw, np.inf)
        seen_tps = tps[~np.isnan(tps)]
        tps = np.where(np.isnan(tps), seen_tps.min() if seen_tps.size else DEFAULT_TOKENS_PER_SECOND, tps)
        seen_mem = mem[~np.isnan(mem)]
        # Unknown memory: the smallest reported one; with no report at all, assume the path fits
        # (the peer checks for itself when it loads the path and leaves if it cannot).
        mem = np.where(np.isnan(mem), seen_mem.min() if seen_mem.size else np.inf, mem)
        return cls(
            peer_ids=tuple(ids),
            tokens_per_second=_ro(tps),
            memory_bytes=_ro(mem),
            latency_seconds=_ro(lat),
            bandwidth_bytes_per_second=_ro(bw),
            grid=grid,
            filled=filled,
        )


def _as_float(values, name: str) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype.kind in "fiu":
        return values.astype(float, copy=False)  # never written to: no copy of an N x N input
    try:
        arr = np.array(values, dtype=object)
        out = np.array(np.where(arr == None, np.nan, arr), dtype=float)  # noqa: E711 (elementwise)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must hold numbers: {e}") from None
    return out


def _ro(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=float)
    a.setflags(write=False)
    return a
