"""The robust aggregators on their own: what each does with a hostile input, that CenteredClip really
iterates, that a pair's caps are the receiver's, and how a part on probation is weighed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from peer.sync.aggregate import (
    AGGREGATORS,
    SUM_LANES,
    AggregatorConfig,
    Contribution,
    _combine,
    _combine_all,
    _median,
    aggregate,
    exact_dot,
    exact_norm,
)


def _parts(n: int, seed: int = 0, scale: float = 1.0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.normal(size=512).astype(np.float32)
    return [(base + 0.3 * rng.normal(size=512)).astype(np.float32) * scale for _ in range(n)]


def _contributions(parts, weights=None, admitted=None) -> list[Contribution]:
    weights = weights or [1.0] * len(parts)
    admitted = admitted or [True] * len(parts)
    return [
        Contribution(f"p{i}", x, w, a)
        for i, (x, w, a) in enumerate(zip(parts, weights, admitted, strict=True))
    ]


def test_centered_clip_iterates_from_the_coordinate_median_towards_the_honest_mean():
    parts = _parts(5, seed=1)
    parts[4] = parts[4] * 30  # one far member
    honest_mean = np.mean(parts[:4], axis=0)
    median = np.median(np.stack(parts), axis=0)
    result = aggregate(_contributions(parts), AggregatorConfig(method="centered_clip", norm_cap=100.0))
    none = aggregate(
        _contributions(parts), AggregatorConfig(method="centered_clip", norm_cap=100.0, iterations=0)
    )
    # with no iteration it would stay at the median; the iterations move it to the honest members' mean
    assert np.allclose(none, median, atol=1e-6)
    assert np.linalg.norm(result - honest_mean) < 0.75 * np.linalg.norm(median - honest_mean)


@pytest.mark.parametrize("method", ["median", "trimmed_mean", "centered_clip"])
def test_robust_methods_stay_near_the_honest_mean_with_one_member_at_1000_times(method):
    parts = _parts(5, seed=2)
    parts[4] = parts[4] * 1000
    honest_mean = np.mean(parts[:4], axis=0)
    plain = aggregate(_contributions(parts), AggregatorConfig(method="mean"))
    robust = aggregate(_contributions(parts), AggregatorConfig(method=method))
    assert np.linalg.norm(plain - honest_mean) > 100 * np.linalg.norm(honest_mean)
    assert np.linalg.norm(robust - honest_mean) < 0.5 * np.linalg.norm(honest_mean)


def test_the_median_aggregator_is_the_coordinate_median():
    parts = _parts(5, seed=3)
    result = aggregate(_contributions(parts), AggregatorConfig(method="median", norm_cap=100.0))
    assert np.allclose(result, np.median(np.stack(parts), axis=0), atol=1e-6)


def test_neither_member_of_a_pair_can_scale_outweigh_or_reverse_the_others_update():
    mine, theirs = _parts(2, seed=4)
    config = AggregatorConfig(method="centered_clip")  # two members: the pair rule
    for forged in (theirs * 100, -theirs * 100, -mine * 1000):
        result = aggregate(_contributions([mine, forged], weights=[1.0, 1e6]), config)
        # clipped to the smaller norm, weighed alike: never longer than ours, never against it
        assert exact_norm(result) <= exact_norm(mine) * 1.0001
        assert float(np.dot(result.astype(np.float64), mine)) >= -1e-6 * exact_norm(mine) ** 2  # rounding
    # an honest pair computes the same bits whichever member it is (the rule is symmetric)
    assert np.array_equal(
        aggregate(_contributions([mine, theirs]), config),
        aggregate(_contributions([mine, theirs])[::-1], config),
    )
    # the plain mean is what the other member could have set
    plain = aggregate(
        _contributions([mine, -mine * 1000], weights=[1.0, 1e6]), AggregatorConfig(method="mean")
    )
    assert float(np.dot(plain.astype(np.float64), mine)) < 0


def test_parts_on_probation_are_weighed_against_the_admitted_aggregate():
    parts = _parts(3, seed=5)
    admitted_only = aggregate(_contributions(parts[:2]), AggregatorConfig())
    flipped = -50 * parts[0]
    # pointing away from the admitted result: nothing at all, whatever its claimed weight
    result = aggregate(
        _contributions([*parts[:2], flipped], [1, 1, 1e9], [True, True, False]), AggregatorConfig()
    )
    assert np.array_equal(result, admitted_only)
    # the same direction, 50 times longer, a billion tokens: rescaled and weighed like the smallest admitted
    along = 50 * admitted_only
    result = aggregate(
        _contributions([*parts[:2], along], [1, 1, 1e9], [True, True, False]), AggregatorConfig()
    )
    assert np.allclose(result, admitted_only, atol=1e-6)
    # where no part is admitted, every part counts alike (an open run without an authority)
    alike = aggregate(_contributions(parts, admitted=[False] * 3), AggregatorConfig(method="mean"))
    assert np.allclose(alike, np.mean(parts, axis=0), atol=1e-6)


def test_every_aggregator_can_be_chosen_for_a_run():
    from peer.config import SyncConfig

    assert [SyncConfig(aggregator=method).aggregator for method in AGGREGATORS] == list(AGGREGATORS)


@pytest.mark.parametrize("n", range(1, 12))
def test_the_coordinate_median_is_the_mean_of_the_middle_sorted_values_whatever_the_sign_of_zero(n):
    """Up to NETWORK_MEDIAN_MAX_INPUTS parts the median comes from a sorting network, beyond from a
    sort: both must give the sorted middle exactly, ties and repeated values included, and a -0.0
    where another member's copy holds +0.0 must not change a bit of the result."""
    rng = np.random.default_rng(n)
    parts = [rng.integers(-3, 4, size=2048).astype(np.float32) * np.float32(0.25) for _ in range(n)]
    ordered = np.sort(np.stack(parts).astype(np.float64), axis=0)
    expected = (ordered[(n - 1) // 2] + ordered[n // 2]) * 0.5
    result = _median(parts)
    assert np.array_equal(result, expected)
    signed = [np.where(p == 0, np.float32(-0.0), p) for p in parts]
    assert np.signbit(signed[0][parts[0] == 0]).all()
    assert _median(signed).tobytes() == result.tobytes()


@pytest.mark.parametrize("method", AGGREGATORS)
def test_sparse_parts_aggregate_on_their_support_to_what_every_coordinate_gives(method):
    """Where at most half the coordinates hold a nonzero value in some part, the aggregate is taken
    on those alone (+0.0 elsewhere): every method must give what it gives on all coordinates (up to
    the order in which norms add their squares), negative zeros in the parts included."""
    rng = np.random.default_rng(7)
    for n in (2, 3, 4, 5, 9):
        parts = []
        for _ in range(n):
            x = np.zeros(40960, dtype=np.float32)
            kept = rng.choice(40960, 900, replace=False)
            x[kept] = rng.normal(size=900).astype(np.float32)
            x[rng.choice(40960, 2000, replace=False)] *= np.float32(-1)  # -0.0 where x was 0
            parts.append(x)
        assert np.signbit(parts[0][parts[0] == 0]).any()
        contributions = _contributions(parts, weights=[float(w) for w in rng.uniform(1, 3, n)])
        config = AggregatorConfig(method=method)
        on_support = _combine(contributions, config)
        everywhere = _combine_all(contributions, config)
        assert np.count_nonzero(on_support) <= 900 * n
        assert not np.signbit(on_support[on_support == 0]).any()
        assert np.array_equal(on_support == 0, everywhere == 0), n
        assert np.allclose(on_support, everywhere, rtol=1e-12, atol=0), n


def test_norms_and_dot_products_add_their_terms_in_the_documented_order():
    """Every holder must get the same bits for a norm, whatever its CPU: term i goes to lane
    i mod SUM_LANES, each lane adds its terms in index order, then the lanes are added in order.
    Python's float additions (one IEEE-754 rounding each) spell that order out."""
    rng = np.random.default_rng(3)
    for size in (0, 1, 5, SUM_LANES - 1, SUM_LANES, 2 * SUM_LANES + 17):
        x = (rng.normal(size=size) * 10.0 ** rng.uniform(-6, 3, size)).astype(np.float32)
        y = rng.normal(size=size)
        lanes, dot_lanes = [0.0] * SUM_LANES, [0.0] * SUM_LANES
        for i in range(size):
            lanes[i % SUM_LANES] += float(x[i]) * float(x[i])
            dot_lanes[i % SUM_LANES] += float(x[i]) * float(y[i])
        total, dot = 0.0, 0.0
        for lane, dot_lane in zip(lanes[: min(size, SUM_LANES)], dot_lanes, strict=False):
            total, dot = total + lane, dot + dot_lane
        assert exact_norm(x) == math.sqrt(total), size
        assert exact_dot(x, y) == dot, size
    # the prefix sum it replaced orders the additions otherwise: this order is not a tautology
    x = rng.normal(size=3 * SUM_LANES).astype(np.float32)
    prefix = float(np.add.accumulate(np.square(x, dtype=np.float64))[-1])
    assert exact_norm(x) ** 2 != prefix or exact_norm(x[::-1]) ** 2 != prefix


@pytest.mark.parametrize("n", [3, 4, 9])
def test_the_aggregate_does_not_depend_on_the_block_size_it_is_worked_through_in(monkeypatch, n):
    """CenteredClip and the median work through their vectors in blocks (aggregate.BLOCK), for the
    cache; every block size (a multiple of the norms' lanes) must give the bits of one whole-vector
    pass, at sizes on and across a block's edge."""
    import peer.sync.aggregate as aggregate_module

    rng = np.random.default_rng(n)
    for size in (1, SUM_LANES, 3 * SUM_LANES + 5):
        parts = [(rng.normal(size=size) * (1 + 5 * (i == 0))).astype(np.float32) for i in range(n)]
        contributions = _contributions(parts, weights=[float(w) for w in rng.uniform(1, 3, n)])
        results = []
        for block in (SUM_LANES, 2 * SUM_LANES, 10**9):
            monkeypatch.setattr(aggregate_module, "BLOCK", block)
            config = AggregatorConfig(method="centered_clip")
            # float64, before the float32 the group applies (which would hide a last bit)
            results.append((_combine_all(contributions, config).tobytes(), _median(parts).tobytes()))
        assert results[0] == results[1] == results[2], (n, size)
