"""`benchmarks.goodput` counts a split once per round, however many of its members logged it: the
merge is logged by every member that merges (two of a module's two holders), and a count of lines
doubled every split (session 37's `rounds_split` 2 for one split)."""

from __future__ import annotations

import logging

from benchmarks.goodput import count_splits
from peer.config import OuterOptimizerConfig
from peer.model.grid import ModelConfig
from peer.model.transformer import GridModel
from peer.sync.module_sync import ModuleSync
from peer.sync.settling import merge_note, repair_note


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
