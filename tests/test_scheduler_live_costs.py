"""The live swarm's cost model (peer/scheduler/cost.py, `GridSpec.exchange="all_to_all"` and the
shared trunk): each member sends its whole part to every other member of its path group, and the
trunk to every placed peer; by hand, against the float formula, and in the search's exact scores."""

from __future__ import annotations

import numpy as np
import pytest

from peer.scheduler import (
    Assignment,
    GridSpec,
    SwarmSnapshot,
    make_scenario,
    paper_grid,
    plan,
    random_assignment,
    round_cost,
)
from tests.test_scheduler import two_sites


def test_a_robust_round_costs_each_member_its_whole_part_to_every_other_member_and_the_trunk_to_all():
    snap = two_sites(h=10).with_grid(exchange="all_to_all", shared_fragment_bytes=1e6)
    near = round_cost(Assignment({"A": 0, "B": 0, "C": 1, "D": 1}, 2), snap)
    # path part, A -> B: 5 x 1 ms + 1e7 / 1e9 = 0.015 s (the whole part, not a 1/|C| share);
    # trunk, A -> every other peer: B 5 x 1 ms + 1e6 / 1e9 = 0.006, C and D 5 x 0.1 + 1e6 / 1e7 = 0.6
    assert near.group_seconds == pytest.approx((0.015 + 1.206, 0.015 + 1.206))
    assert near.round_seconds == pytest.approx(10.0 + 1.221)
    far = round_cost(Assignment({"A": 0, "C": 0, "B": 1, "D": 1}, 2), snap)
    # the part across: 5 x 0.1 + 1e7 / 1e7 = 1.5 s, the trunk as before
    assert far.round_seconds == pytest.approx(10.0 + 1.5 + 1.206)
    # a lone holder of a path still averages the trunk with everyone
    alone = round_cost(Assignment({"A": 0, "B": 1, "C": 1, "D": 1}, 2), snap)
    assert alone.group_seconds[0] == pytest.approx(1.206)
    assert plan(snap, 0).cost.round_seconds == pytest.approx(near.round_seconds)
    # in rotating subgroups of 2 the trunk costs A one partner a round: its mean link, 1.206 / 3
    pairs = round_cost(Assignment({"A": 0, "B": 0, "C": 1, "D": 1}, 2), snap.with_grid(shared_group_size=2))
    assert pairs.group_seconds == pytest.approx((0.015 + 0.402, 0.015 + 0.402))


def test_the_search_scores_each_swap_and_move_exactly_with_the_trunk_priced():
    # The descent takes the best-scored operation: each score must be the objective the operation
    # really gives, shared links included (8 peers on 3 paths: sizes 3, 3, 2, so moves are tried).
    from peer.scheduler.cost import CostModel
    from peer.scheduler.local import State, _move_scores, _swap_scores

    # seed 3: in some moves the mover itself is its new group's slowest member (its trunk links)
    snap = make_scenario("world_wide_uneven", 8, paper_grid(3), seed=3)
    snap = snap.with_grid(exchange="all_to_all", shared_fragment_bytes=3e8)
    model = CostModel(snap)
    assert model.shared_ns.min() > 0
    labels = np.array([0, 0, 0, 1, 1, 1, 2, 2], dtype=np.int64)
    checked = 0
    for u in range(model.n):
        st = State(model, labels)
        own, gc = st.own(), st.gcost()
        assert st.objective(gc) == model.objective(st.labels)
        top = np.argsort(-gc, kind="stable")[:3]
        g = model.n_groups
        intra = st.links(st.mem[:, :, None], st.mem[:, None, :], np.arange(g)[:, None, None])
        pad = ~(st.valid[:, :, None] & st.valid[:, None, :]) | np.eye(st.mem.shape[1], dtype=bool)[None]
        ops = _swap_scores(st, u, own, gc, top, intra, pad, model.balance_varies)
        ops += _move_scores(st, u, own, gc, top, model.balance_varies)
        for score, (kind, a, b) in ops:
            after = State(model, labels)
            after.swap(a, b) if kind == "swap" else after.move(a, b)
            # the round time and the tie-break (every group's cost summed) both
            assert score == model.objective(after.labels), (kind, a, b)
            assert after.objective() == score
            checked += 1
    assert checked > model.n  # swaps for every peer, moves for the larger groups' members


def test_integer_costs_match_the_float_formula_for_whole_parts_and_the_trunk():
    rng = np.random.default_rng(5)
    n = 9
    lat, bw = rng.uniform(0.001, 0.2, (n, n)), rng.uniform(1e6, 1e8, (n, n))
    grid = GridSpec(3, 5e7, 2, 100, exchange="all_to_all", shared_fragment_bytes=2e6)
    snap = SwarmSnapshot.from_matrices([f"p{i}" for i in range(n)], lat, bw, grid, None)
    a = random_assignment(snap, 2)
    L, B = snap.latency_seconds, snap.bandwidth_bytes_per_second
    with np.errstate(divide="ignore"):
        part = 5 * L + 5e7 / B
        trunk = 5 * L + 2e6 / B
    np.fill_diagonal(part, 0.0)
    np.fill_diagonal(trunk, 0.0)
    expected = []
    for g in a.groups():
        ix = [snap.peer_ids.index(p) for p in g]
        expected.append(max(part[i, ix].sum() + trunk[i].sum() for i in ix))
    assert round_cost(a, snap).group_seconds == pytest.approx(expected, abs=1e-8)


def test_a_grid_with_an_unknown_exchange_or_negative_shared_bytes_fails_with_one_line():
    with pytest.raises(ValueError, match="exchange must be one of all_reduce, all_to_all, got 'gossip'"):
        GridSpec(2, 1.0, exchange="gossip")
    with pytest.raises(ValueError, match="shared_fragment_bytes must be finite and >= 0"):
        GridSpec(2, 1.0, shared_fragment_bytes=-1.0)
