"""A peer's own round count (what --max_rounds limits) across resumes, and how loudly a module's first
rounds (a joiner's, or a new swarm's) report a dropped member, a repair or a merge."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

from peer.config import OuterOptimizerConfig
from peer.model.grid import ModelConfig
from peer.model.transformer import GridModel
from peer.sync.agreement import LEFT
from peer.sync.module_sync import ModuleSync
from peer.sync.pending import FragmentDone
from peer.sync.rounds import RoundResult
from peer.sync.settling import SETTLING_ROUNDS, merge_note, settle, went_on_without_us
from peer.training.history import LOOP_PARTS, RoundHistory


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


def test_a_rounds_entry_says_where_every_part_of_the_loops_time_went():
    # the loop laps its parts in order; a slow batch and a slow sync show under their own names
    h = RoundHistory()
    h.start_clock()
    for slow in ("batches", "sync"):
        time.sleep(0.05 if slow == "batches" else 0.0)
        h.lap("batches")
        h.add_step(1.0)
        h.lap("loop")
        time.sleep(0.05 if slow == "sync" else 0.0)
        h.lap("sync")
        h.lap("pace")
    done = FragmentDone(0, 10, {"trunk": RoundResult("averaged", torch.zeros(1), 2)})
    parts = h.end_round(1, 2, 100, done)["loop_parts_seconds"]
    assert set(parts) == set(LOOP_PARTS) and parts["rotation"] == 0.0
    assert 0.05 <= parts["batches"] < 0.5 and 0.05 <= parts["sync"] < 0.5
    assert parts["step"] == h.entries[-1]["step_seconds"]
    # the laps hold the whole of the loop's time: nothing falls between two parts
    assert abs(sum(parts.values()) - h.entries[-1]["train_seconds"]) < 0.01
    assert sum(h.end_round(2, 2, 100, done)["loop_parts_seconds"].values()) < 0.01  # per round


def test_a_checkpoint_without_the_count_counts_its_history_entries():
    h = RoundHistory()
    h.restore([{"round": 12}, {"round": 13}], 0.0)
    assert h.own_rounds == 2
    h.restore([], 0.0)
    assert h.own_rounds == 0


def _result(outcome: str = "averaged", **kw) -> RoundResult:
    return RoundResult(outcome, torch.zeros(1), 2, **kw)


def test_a_joiners_first_rounds_say_drops_and_repairs_at_info_then_a_drift_warns():
    ms = SimpleNamespace(settling=SETTLING_ROUNDS, forming=0)  # just downloaded
    # the holders saw the joiner at different moments: one averaged without it, the next round repairs
    assert settle(ms, _result(dropped={"a": "missing"})) == logging.INFO
    assert settle(ms, _result(repair_from=["a", "c"])) == logging.INFO
    assert settle(ms, _result()) == logging.INFO and ms.settling == 0  # in step: settled
    assert settle(ms, _result(repair_from=["a"])) == logging.WARNING  # drifted after it was in step


def test_settling_ends_after_a_few_rounds_even_without_a_clean_average():
    ms = SimpleNamespace(settling=SETTLING_ROUNDS, forming=0)
    levels = [settle(ms, _result("alone")) for _ in range(SETTLING_ROUNDS)]
    assert levels == [logging.INFO] * SETTLING_ROUNDS
    assert settle(ms, _result(dropped={"a": "missing"})) == logging.WARNING
    assert (
        settle(SimpleNamespace(settling=0, forming=0), _result(dropped={"a": "missing"})) == logging.WARNING
    )


def test_a_joiner_whose_holders_decided_its_first_round_without_it_takes_their_copy_not_its_own():
    """A holder that does not see a joiner's claim yet decides the round alone; the joiner, alone
    too, would apply its own Δ beside the holder's and their copies would split. While settling, it
    takes the holders' copy instead; holders that left, or a joiner that settled, change nothing."""
    joiner = SimpleNamespace(settling=SETTLING_ROUNDS, forming=0)
    passed_by = _result("alone", dropped={"b": "missing", "a": "missing"})
    assert went_on_without_us(joiner, passed_by) == ["a", "b"]
    assert went_on_without_us(joiner, _result("alone", dropped={"a": LEFT})) == []
    assert went_on_without_us(joiner, _result("averaged", dropped={"a": "missing"})) == []
    settled = SimpleNamespace(
        settling=0, forming=0
    )  # a member in step whose group stalled goes on with its own
    assert went_on_without_us(settled, _result("alone", dropped={"a": "missing"})) == []


def _fresh_module() -> ModuleSync:
    """A module as a peer of a new swarm starts it: its initial weights, nothing downloaded."""
    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64)
    return ModuleSync(
        cfg, "l0m1", GridModel(cfg, seed=0).path_model((1, 0)).parts["l0m1"], OuterOptimizerConfig(), 1
    )


def test_a_new_swarms_holders_meeting_merge_at_info_in_plain_words_and_a_later_split_warns():
    """Holders of a new swarm start from the same weights but take their first rounds alone, before
    they see each other's claims: their copies differ when they meet, and the merge that follows is
    how a swarm forms, not an alarm. Copies that were in step (a clean average) and then split are."""
    ms = _fresh_module()
    assert ms.settling == 0  # nothing was downloaded: no joiner's grace
    for _ in range(2 * SETTLING_ROUNDS):  # alone, nobody else holds it yet: no company, no count
        assert settle(ms, _result("alone", members=["me"])) == logging.INFO
    level, text = merge_note(ms, 0, copies=2, members=2)
    assert level == logging.INFO and "merged the diverged copies of 2 members" in text, text
    assert "first rounds" in text and "split" not in text, text
    assert settle(ms, _result(dropped={"b": "missing"})) == logging.INFO  # the group still forming
    assert settle(ms, _result(members=["me", "b"])) == logging.INFO and ms.forming == 0  # in step
    level, text = merge_note(ms, 0, copies=2, members=2)
    assert level == logging.WARNING and "split" in text and "merged the diverged copies" in text, text
    assert settle(ms, _result(dropped={"b": "missing"})) == logging.WARNING


def test_a_fresh_modules_grace_ends_after_a_few_rounds_with_company_that_never_average_cleanly():
    ms = _fresh_module()
    for _ in range(SETTLING_ROUNDS):
        assert settle(ms, _result("alone", members=["me"], dropped={"b": "missing"})) == logging.INFO
    assert merge_note(ms, 0, copies=3, members=3)[0] == logging.WARNING
    assert settle(ms, _result(dropped={"b": "missing"})) == logging.WARNING
