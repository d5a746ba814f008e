"""`benchmarks.goodput` counts a split once per round, however many of its members logged it: the
merge is logged by every member that merges (two of a module's two holders), and a count of lines
doubled every split (session 37's `rounds_split` 2 for one split). It reads moves and restarts off the
same logs."""

from __future__ import annotations

import logging

from benchmarks.goodput_logs import (
    count_double_moves,
    count_extra_moves,
    count_splits,
    describe_starts,
    start_seconds,
)
from peer.config import OuterOptimizerConfig
from peer.model.grid import ModelConfig
from peer.model.transformer import GridModel
from peer.sync.module_sync import ModuleSync
from peer.sync.settling import merge_note, repair_note
from peer.training.history import first_step_note


def _module() -> ModuleSync:
    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64)
    return ModuleSync(
        cfg, "l0m1", GridModel(cfg, seed=0).path_model((1, 0)).parts["l0m1"], OuterOptimizerConfig(), 1
    )


def test_a_split_merged_by_both_holders_counts_once_and_each_other_round_once_more(tmp_path):
    ms = _module()
    ms.forming = ms.settling = 0  # in step before: the merge is a split, logged at WARNING
    level, merged = merge_note(ms, 0, copies=2, members=2)
    assert level == logging.WARNING
    ms.fragment_rounds[0] += 1  # the round applied: a repair after it names the same round
    repaired_alike = repair_note(ms, 0, logging.WARNING)
    ms.fragment_rounds[0] += 1
    _, later = merge_note(ms, 0, copies=2, members=2)
    expected = repair_note(ms, 0, logging.INFO)  # just after a join: no split
    ms.fragment_rounds[0] += 5
    repaired = repair_note(ms, 0, logging.WARNING)
    (tmp_path / "p0.log").write_text(f"x WARNING {merged}\nx WARNING {later}\nx INFO {expected}\n")
    (tmp_path / "p1.log").write_text(f"x WARNING {merged}\nx WARNING {repaired_alike}\n")
    (tmp_path / "p1.1.log").write_text(f"{repaired}\n{repaired}\n")  # a restarted process's earlier log
    assert count_splits(tmp_path) == 3, [merged, later, repaired]  # rounds 0, 1 and 6


def test_two_peers_moving_onto_one_path_at_the_same_round_count_as_a_double_move(tmp_path):
    """Every peer plans the rotation alike from the claims, one mover per target: two movers onto one
    path at one round's end are peers whose views planned differently (goodput's rotation arm)."""
    line = "2026-12-05 02:12:{:02d},000 INFO peer.training.peer: {}\n"
    (tmp_path / "p0.log").write_text(
        line.format(1, "round 20 step 1099 loss 1.1 {} (own round 20)")
        + line.format(2, "rotating from path 1 to path 2 (path steps 0: 831)")
        + line.format(9, "round 24 step 1300 loss 1.0 {} (own round 24)")
        + line.format(9, "rotating from path 2 to path 3 (path steps 0: 900)")
    )
    (tmp_path / "p1.log").write_text(line.format(1, "round 20 step 1303 loss 1.3 {} (own round 20)"))
    # its restarted process moved onto path 2 at round 20 too; p2 moved there a round later
    (tmp_path / "p1.1.log").write_text(
        line.format(3, "round 20 step 1303 loss 1.3 {} (own round 20)")
        + line.format(3, "rotating from path 0 to path 2 (path steps 0: 832)")
    )
    (tmp_path / "p2.log").write_text(
        line.format(4, "round 21 step 1261 loss 1.0 {} (own round 21)")
        + line.format(4, "rotating from path 0 to path 2 (path steps 0: 840)")
    )
    assert count_double_moves(tmp_path) == 1
    # beyond one mover at round 20, onto any path: p1's restarted process (p1.log and p1.1.log are one peer)
    (tmp_path / "p3.log").write_text(
        line.format(5, "round 24 step 1400 loss 1.0 {} (own round 24)")
        + line.format(5, "rotating from path 1 to path 0 (path steps 0: 900)")
    )
    assert count_double_moves(tmp_path) == 1 and count_extra_moves(tmp_path) == 2


def test_a_restarted_peers_start_to_its_first_step_is_read_off_each_later_lifes_log(tmp_path):
    """Each peer's first life is its launch (pN.1.log once killed, else pN.log); every later life is a
    restart, the living one last; a later life killed before its first step is counted, not timed."""
    (tmp_path / "p0.1.log").write_text(f"x INFO {first_step_note(1.25)}\nx INFO round 1 step 50\n")
    (tmp_path / "p0.2.log").write_text(f"x INFO {first_step_note(6.04)}\n")
    (tmp_path / "p0.3.log").write_text("x INFO config: {}\n")  # killed while it started
    (tmp_path / "p0.log").write_text(f"x INFO {first_step_note(7.5)}\nx INFO {first_step_note(99)}\n")
    (tmp_path / "p1.log").write_text(f"x INFO {first_step_note(1.5)}\n")  # never killed
    (tmp_path / "bootstrap.log").write_text(f"{first_step_note(50)}\n")
    starts = start_seconds(tmp_path)
    assert starts == dict(launch=[1.2, 1.5], restart=[6.0, 7.5], restarts_without_a_step=1), starts
    assert describe_starts(starts) == "1.4 (1.5), 6.8 (7.5); 1 killed before a step"
