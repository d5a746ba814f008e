"""Robust, deterministic aggregation of the outer gradients a group of holders gathered.

Every member of a group holds the same decoded inputs (the all-gather of `peer.sync.rounds`) and
runs the same code on them, so every member must compute the *same bits* even on different CPUs.
Hence: inputs in a fixed order (sorted by peer id); only element-wise float operations, each
rounded once (no fused multiply-add, whose use differs between machines and vector widths); norms
summed in one fixed order (`exact_norm`); scalar factors computed in Python floats. Sparse parts
are aggregated on the coordinates where some part is nonzero (`_combine`): what all coordinates give
up to the order of the norms' additions, at a tenth of the time for sparse2bit's parts.

Aggregators (the run's `sync.aggregator`):

* `mean` — the token-weighted mean (DiLoCo); one hostile member can set it.
* `clipped_mean` — weights capped at `weight_cap` × the group's median weight, each input's norm
  clipped to `norm_cap` × the group's median norm, then the weighted mean: a ×1000 or huge-weight
  member counts as one ordinary member.
* `trimmed_mean` — coordinate-wise: the largest and smallest ⌊trim·n⌋ values of every coordinate
  are dropped (at least one each side from 3 members on), the rest averaged (norms clipped first).
* `median` — the coordinate-wise median of the (norm-clipped) inputs.
* `centered_clip` (default) — CenteredClip (Karimireddy et al. 2021, used by BTARD, Gorbunov et al. 2022):
  starting from the coordinate-wise median, v ← v + Σ wᵢ·clip(xᵢ − v, τ) / Σ wᵢ for a few
  iterations, τ = the median distance of the inputs from the start; a member far from the others
  moves the result by at most τ·wᵢ/Σw.

With fewer than three members nobody can be outvoted, and the median of two is their mean, which
either member sets alone: a pair's two parts are weighed equally and each is clipped to the smaller
of their norms (`_pair`), so neither can scale, outweigh or reverse the other's update — the worst
one member can do is cancel it. The rule is symmetric, so an honest pair still computes the same
bits (caps from each receiver's own part, which the threat model first asked for, would leave two
honest members of different speeds with different copies every round).

Standing (peer/run/admission.py): the methods above combine the parts of admitted members. A part of
a member still on probation is weighed against that result as FLTrust weighs a client's update
against the server's (Cao et al., NDSS 2021): rescaled to the admitted result's norm, its weight at
most the smallest admitted weight, times the cosine of its angle to the admitted result, and nothing
when it points away. So a fresh key can add at most one small member's worth of the admitted
direction, and can neither reverse, scale nor redirect the update. Where no part is admitted (an
open run without an authority) every part is treated as admitted.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

AGGREGATORS = ("mean", "clipped_mean", "trimmed_mean", "median", "centered_clip")


@dataclass(frozen=True)
class Contribution:
    """One member's decoded outer gradient, its claimed weight (tokens since its last sync) and
    whether the member is admitted (its standing, the same on every member of the round)."""

    peer_id: str
    delta: np.ndarray  # float32, flat
    weight: float
    admitted: bool = True


@dataclass(frozen=True)
class AggregatorConfig:
    """How a group combines its members' outer gradients; identical on every member (manifest)."""

    method: str = "centered_clip"
    #: a member's weight counts at most this many times the group's median weight
    weight_cap: float = 2.0
    #: a member's outer gradient is clipped to this many times the group's median norm
    norm_cap: float = 2.0
    #: trimmed_mean: fraction of members dropped at each end of every coordinate
    trim_fraction: float = 0.25
    #: centered_clip: iterations
    iterations: int = 3


#: sums of float64 terms (norms, dot products) deal term i to lane i mod SUM_LANES; each lane adds its
#: terms in index order, then the lanes are added in index order. One fixed order of additions, each
#: an IEEE-754 operation on one element, so every machine and vector width gives the same bits; at a
#: fifth of a single prefix sum's time (0.44 against 2.3 ms for 810,000 values), whose one chain of
#: dependent additions no CPU can run in parallel.
SUM_LANES = 8192
#: long vectors are worked through in blocks of this many values (a multiple of SUM_LANES, so a
#: block's terms start at lane 0): a block's float64 temporaries (512 kB each) stay in a core's cache,
#: where whole-vector passes streamed 6.5 MB arrays through memory a dozen times per iteration
BLOCK = 8 * SUM_LANES


def _spans(size: int):
    """(start, stop) of each block of a vector of `size` values, in order."""
    return ((start, min(start + BLOCK, size)) for start in range(0, size, BLOCK))


def _add_to_lanes(lanes: np.ndarray, terms: np.ndarray) -> None:
    """Adds `terms`, whose first one is a multiple of SUM_LANES terms into the sum, to their lanes."""
    for row in range(0, terms.size, lanes.size):
        k = min(lanes.size, terms.size - row)
        np.add(lanes[:k], terms[row : row + k], out=lanes[:k])


def _lanes_total(lanes: np.ndarray) -> float:
    return float(np.add.accumulate(lanes)[-1]) if lanes.size else 0.0


def _fixed_order_sum(x: np.ndarray, y: np.ndarray | None = None) -> float:
    """Σ xᵢ² (or Σ xᵢ·yᵢ), each term in float64, added in the order `SUM_LANES` defines."""
    x = x.reshape(-1)
    y = None if y is None else y.reshape(-1)
    lanes, term = np.zeros(min(x.size, SUM_LANES)), np.empty(min(x.size, BLOCK))
    for start, stop in _spans(x.size):
        t = term[: stop - start]
        if y is None:
            np.square(x[start:stop], out=t, dtype=np.float64)
        else:
            np.multiply(x[start:stop], y[start:stop], out=t, dtype=np.float64)
        _add_to_lanes(lanes, t)
    return _lanes_total(lanes)


def exact_norm(x: np.ndarray) -> float:
    """The L2 norm, identical on every machine (`_fixed_order_sum`). `np.sum`'s pairwise blocks and
    vector lanes depend on the build and the CPU; `math.fsum` would be correctly rounded too, but
    ~75x slower, and norms were most of a robust aggregation's cost."""
    return math.sqrt(_fixed_order_sum(x))


def exact_dot(x: np.ndarray, y: np.ndarray) -> float:
    """⟨x, y⟩ in float64, identical on every machine (`_fixed_order_sum`)."""
    return _fixed_order_sum(x, y)


def _capped_weights(contributions: Sequence[Contribution], cap: float | None) -> list[float]:
    weights = [float(c.weight) for c in contributions]
    if cap is not None and len(weights) > 1:
        limit = cap * statistics.median(weights)
        weights = [min(w, limit) for w in weights]
    return weights


def _weights(contributions: Sequence[Contribution], cap: float | None) -> list[float]:
    weights = _capped_weights(contributions, cap)
    total = math.fsum(weights)
    return [w / total for w in weights]


def _clip_norms(contributions: Sequence[Contribution], cap: float) -> list[np.ndarray]:
    """Each input scaled down to at most `cap` × the median input norm (identical everywhere)."""
    norms = [exact_norm(c.delta) for c in contributions]
    if len(norms) < 2:
        return [c.delta for c in contributions]
    limit = cap * statistics.median(norms)
    out = []
    for c, norm in zip(contributions, norms, strict=True):
        factor = 1.0 if norm <= limit or norm == 0 else limit / norm
        out.append(c.delta if factor == 1.0 else np.multiply(c.delta, np.float32(factor)))
    return out


def _weighted_sum(inputs: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Σ wᵢ·xᵢ in float64, one rounding per operation, in the given order."""
    acc = np.zeros(inputs[0].shape, dtype=np.float64)
    for x, w in zip(inputs, weights, strict=True):
        term = np.multiply(x, np.float64(w), dtype=np.float64)
        acc = np.add(acc, term)
    return acc


def _trimmed_mean(inputs: Sequence[np.ndarray], trim_fraction: float) -> np.ndarray:
    n = len(inputs)
    k = max(1, math.floor(trim_fraction * n)) if n >= 3 else 0
    stacked = np.sort(np.stack(inputs).astype(np.float64), axis=0)
    kept = stacked[k : n - k]
    acc = np.zeros(kept.shape[1:], dtype=np.float64)
    for row in kept:  # fixed order: the sorted values of each coordinate
        acc = np.add(acc, row)
    return np.divide(acc, np.float64(len(kept)))


def _centered_clip(inputs: Sequence[np.ndarray], weights: Sequence[float], iterations: int) -> np.ndarray:
    """CenteredClip from the coordinate-wise median. Each iteration takes two passes over the blocks
    of the vectors (`BLOCK`): the distances' norms, then the clipped step; xᵢ − v is computed anew in
    each (a float32 input widened inside the subtraction, exactly as a float64 copy would be), so
    that no vector beyond v is ever made."""
    v = _median(inputs)
    term, step = np.empty(min(v.size, BLOCK)), np.empty(min(v.size, BLOCK))
    tau = None
    for _ in range(iterations):
        lanes = [np.zeros(min(v.size, SUM_LANES)) for _ in inputs]
        for start, stop in _spans(v.size):
            d = term[: stop - start]
            for x, lane in zip(inputs, lanes, strict=True):
                np.subtract(x[start:stop], v[start:stop], out=d, dtype=np.float64)
                _add_to_lanes(lane, np.square(d, out=d))
        norms = [math.sqrt(_lanes_total(lane)) for lane in lanes]
        tau = statistics.median(norms) if tau is None else tau  # the first distances' median
        factors = [
            np.float64(w * (1.0 if norm <= tau or norm == 0 else tau / norm))
            for norm, w in zip(norms, weights, strict=True)
        ]
        for start, stop in _spans(v.size):
            d, s = term[: stop - start], step[: stop - start]
            s.fill(0.0)
            for x, factor in zip(inputs, factors, strict=True):
                np.subtract(x[start:stop], v[start:stop], out=d, dtype=np.float64)
                np.add(s, np.multiply(d, factor, out=d), out=s)
            np.add(v[start:stop], s, out=v[start:stop])
    return v


#: up to this many inputs the median comes from a sorting network (np.minimum / np.maximum over whole
#: rows): 4 parts of 810,000 values in 16 ms where np.sort along the stacked axis took 60 ms
NETWORK_MEDIAN_MAX_INPUTS = 8


def _median(inputs: Sequence[np.ndarray]) -> np.ndarray:
    """The coordinate-wise median in float64: the mean of the two middle values (one when n is odd).
    Negative zeros become +0 first (x + 0.0), so that equal values have equal bits and no ordering of
    ties (which sorts and min/max leave to the build and the CPU) can change the result. The values
    are ordered in their own precision (float32 parts: half the memory traffic), which widening to
    float64 cannot change; only the middle two are widened. Block by block (`BLOCK`)."""
    n, size = len(inputs), inputs[0].size
    dtype = np.result_type(*inputs, np.float32)
    out = np.empty(size, dtype=np.float64)
    buffers = [np.empty(min(size, BLOCK), dtype=dtype) for _ in range(n + 1)]
    for start, stop in _spans(size):
        rows = [
            np.add(x[start:stop], dtype.type(0.0), out=b[: stop - start])
            for x, b in zip(inputs, buffers[:n], strict=True)
        ]
        if n <= NETWORK_MEDIAN_MAX_INPUTS:
            spare = buffers[n][: stop - start]
            for p in range(n):  # odd-even transposition: n passes sort any n rows coordinate-wise
                for i in range(p % 2, n - 1, 2):
                    low = np.minimum(rows[i], rows[i + 1], out=spare)
                    np.maximum(rows[i], rows[i + 1], out=rows[i + 1])
                    rows[i], spare = low, rows[i]
        else:
            rows = list(np.sort(np.stack(rows), axis=0))
        middle = np.add(rows[(n - 1) // 2], rows[n // 2], out=out[start:stop], dtype=np.float64)
        np.multiply(middle, np.float64(0.5), out=middle)
    return out


def _pair(ordered: list[Contribution]) -> np.ndarray:
    """Two parts, weighed equally, each clipped to the smaller of their norms: ⟨result, either part⟩
    is never negative, so neither member can reverse (or scale, or outweigh) the other's update."""
    norms = [exact_norm(c.delta) for c in ordered]
    limit = min(norms)
    scaled = [
        c.delta if norm <= limit or norm == 0 else np.multiply(c.delta, np.float32(limit / norm))
        for c, norm in zip(ordered, norms, strict=True)
    ]
    return _weighted_sum(scaled, [0.5, 0.5])


#: aggregate on the coordinates where some part is nonzero when they are at most this share of all
SUPPORT_SHARE = 0.5


def _combine(ordered: list[Contribution], config: AggregatorConfig) -> np.ndarray:
    """`_combine_all` on the coordinates where some part is nonzero, +0.0 elsewhere: what it gives on
    all of them, since every method gives +0.0 where all its inputs are zero, but for the order in
    which the norms add their squares (the lanes of `_fixed_order_sum` take other terms). Every holder
    takes the same branch on the same parts, so all compute the same bits; sparse parts (2.2% nonzero
    each) cost a tenth of the time."""
    nonzero = np.logical_or.reduce([np.not_equal(c.delta, 0) for c in ordered])
    if np.count_nonzero(nonzero) > SUPPORT_SHARE * nonzero.size:
        return _combine_all(ordered, config)
    support = np.flatnonzero(nonzero)
    out = np.zeros(nonzero.shape, dtype=np.float64)
    if support.size:
        kept = [Contribution(c.peer_id, c.delta[support], c.weight, c.admitted) for c in ordered]
        out[support] = _combine_all(kept, config)
    return out


def _combine_all(ordered: list[Contribution], config: AggregatorConfig) -> np.ndarray:
    method = config.method
    if method == "mean":
        return _weighted_sum([c.delta for c in ordered], _weights(ordered, None))
    if len(ordered) == 2:
        return _pair(ordered)  # two members cannot outvote each other
    clipped = _clip_norms(ordered, config.norm_cap)
    if method == "clipped_mean":
        return _weighted_sum(clipped, _weights(ordered, config.weight_cap))
    if method == "trimmed_mean":
        return _trimmed_mean(clipped, config.trim_fraction)
    if method == "median":
        return _median(clipped)
    if method == "centered_clip":
        return _centered_clip(clipped, _weights(ordered, config.weight_cap), config.iterations)
    raise ValueError(f"unknown aggregator {method!r}; choose one of {', '.join(AGGREGATORS)}")


def _with_probation(
    core: np.ndarray, admitted: list[Contribution], probation: list[Contribution], config: AggregatorConfig
) -> tuple[np.ndarray, list[str]]:
    """The admitted result with the parts of members on probation weighed in, FLTrust's way, and the
    members on probation whose part went in."""
    core_norm = exact_norm(core)
    weights = _capped_weights(admitted, config.weight_cap)
    smallest = min(weights)
    acc = np.multiply(core, np.float64(math.fsum(weights)), dtype=np.float64)
    total = [math.fsum(weights)]
    taken = []
    for c in probation:
        norm = exact_norm(c.delta)
        if norm == 0 or core_norm == 0:
            continue
        cosine = exact_dot(c.delta, core) / (norm * core_norm)
        if cosine <= 0:
            continue  # pointing away from what the admitted members agree on: it adds nothing
        weight = min(float(c.weight), smallest) * cosine
        rescaled = np.multiply(c.delta, np.float64(core_norm / norm), dtype=np.float64)
        acc = np.add(acc, np.multiply(rescaled, np.float64(weight)))
        total.append(weight)
        taken.append(c.peer_id)
    return (np.divide(acc, np.float64(math.fsum(total))) if taken else core), taken


def aggregate_with_trust(
    contributions: Sequence[Contribution], config: AggregatorConfig
) -> tuple[np.ndarray, list[str]]:
    """`aggregate`, and the members whose part went in: every admitted one, and those on probation
    whose part did not point away from the admitted result (what their probation counts)."""
    if not contributions:
        raise ValueError("nothing to aggregate")
    ordered = sorted(contributions, key=lambda c: c.peer_id)
    if len({c.delta.shape for c in ordered}) != 1:
        raise ValueError("contributions of different shapes")
    admitted = [c for c in ordered if c.admitted]
    probation = [c for c in ordered if not c.admitted] if admitted else []
    admitted = admitted or ordered
    core = _combine(admitted, config)
    taken: list[str] = []
    if probation:
        core, taken = _with_probation(core, admitted, probation, config)
    return core.astype(np.float32), [c.peer_id for c in admitted] + taken


def aggregate(contributions: Sequence[Contribution], config: AggregatorConfig) -> np.ndarray:
    """The group's outer gradient (float32), identical on every member given the same inputs."""
    return aggregate_with_trust(contributions, config)[0]


def combine_copies(copies: Sequence[tuple[str, np.ndarray]], iterations: int = 3) -> np.ndarray:
    """One copy from the diverged copies of a fragment's state (θ̄ or momentum) that a group holds with
    no majority among them, e.g. the halves of a healed partition: the plain mean of two; from three
    on, CenteredClip from the coordinate-wise median with equal weights, so one member's copy moves
    the result by at most the median distance of the copies from it. No norm clipping: these are
    states, not gradients. Inputs are ordered by peer id, so every member computes the same bits."""
    if not copies:
        raise ValueError("nothing to combine")
    ordered = [x for _, x in sorted(copies, key=lambda c: c[0])]
    if len({x.shape for x in ordered}) != 1:
        raise ValueError("copies of different shapes")
    n = len(ordered)
    if n == 1:
        return ordered[0].astype(np.float32)
    weights = [1.0 / n] * n
    if n == 2:
        return _weighted_sum(ordered, weights).astype(np.float32)
    return _centered_clip(ordered, weights, iterations).astype(np.float32)
