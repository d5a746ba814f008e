"""A peer's own round count (what --max_rounds limits) across resumes, and how loudly a joiner's first
rounds report a dropped member or a repair."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from peer.sync.agreement import LEFT
from peer.sync.outer import FragmentDone
from peer.sync.rounds import RoundResult
from peer.sync.settling import SETTLING_ROUNDS, settle, went_on_without_us
from peer.training.history import RoundHistory


def _round(h: RoundHistory, swarm_round: int) -> None:
    done = FragmentDone(0, swarm_round * 10, {"trunk": RoundResult("averaged", torch.zeros(1), 2)})
    h.add_sync(done)
    h.end_round(swarm_round, swarm_round * 10, 100 * swarm_round, done)


def test_own_rounds_count_this_peers_rounds_whatever_the_swarms_round():
    h = RoundHistory()
    for swarm_round in (13, 14, 15):  # a late joiner: the swarm's clock started long before it
        _round(h, swarm_round)
    assert h.own_rounds == 3
    resumed = RoundHistory()
    resumed.restore(h.entries, 1.0, own_rounds=h.own_rounds)
    _round(resumed, 40)
    assert resumed.own_rounds == 4


def test_a_checkpoint_without_the_count_counts_its_history_entries():
    h = RoundHistory()
    h.restore([{"round": 12}, {"round": 13}], 0.0)
    assert h.own_rounds == 2
    h.restore([], 0.0)
    assert h.own_rounds == 0


def _result(outcome: str = "averaged", **kw) -> RoundResult:
    return RoundResult(outcome, torch.zeros(1), 2, **kw)


def test_a_joiners_first_rounds_say_drops_and_repairs_at_info_then_a_drift_warns():
    ms = SimpleNamespace(settling=SETTLING_ROUNDS)  # just downloaded
    # the holders saw the joiner at different moments: one averaged without it, the next round repairs
    assert settle(ms, _result(dropped={"a": "missing"})) == logging.INFO
    assert settle(ms, _result(repair_from=["a", "c"])) == logging.INFO
    assert settle(ms, _result()) == logging.INFO and ms.settling == 0  # in step: settled
    assert settle(ms, _result(repair_from=["a"])) == logging.WARNING  # drifted after it was in step


def test_settling_ends_after_a_few_rounds_even_without_a_clean_average():
    ms = SimpleNamespace(settling=SETTLING_ROUNDS)
    levels = [settle(ms, _result("alone")) for _ in range(SETTLING_ROUNDS)]
    assert levels == [logging.INFO] * SETTLING_ROUNDS
    assert settle(ms, _result(dropped={"a": "missing"})) == logging.WARNING
    assert settle(SimpleNamespace(settling=0), _result(dropped={"a": "missing"})) == logging.WARNING


def test_a_joiner_whose_holders_decided_its_first_round_without_it_takes_their_copy_not_its_own():
    """A holder that does not see a joiner's claim yet decides the round alone; the joiner, alone
    too, would apply its own Δ beside the holder's and their copies would split. While settling, it
    takes the holders' copy instead; holders that left, or a joiner that settled, change nothing."""
    joiner = SimpleNamespace(settling=SETTLING_ROUNDS)
    passed_by = _result("alone", dropped={"b": "missing", "a": "missing"})
    assert went_on_without_us(joiner, passed_by) == ["a", "b"]
    assert went_on_without_us(joiner, _result("alone", dropped={"a": LEFT})) == []
    assert went_on_without_us(joiner, _result("averaged", dropped={"a": "missing"})) == []
    settled = SimpleNamespace(settling=0)  # a member in step whose group stalled goes on with its own
    assert went_on_without_us(settled, _result("alone", dropped={"a": "missing"})) == []
