"""`pathswarm demo` end to end: a bootstrap node and four peers as real processes on loopback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.swarm


@pytest.mark.timeout(450)
def test_demo_trains_and_holders_agree(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "demo", "--out", str(out), "--rounds", "3", "--inner_steps", "30"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["peers"] == 4 and summary["grid"] == "2x2"
    assert summary["rounds_completed"] == 3
    assert sorted(tuple(p) for p in summary["paths"].values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert summary["loss_last"] < summary["loss_first"]
    # every holder applies the same aggregate with the same outer step: equal bits, not "close"
    assert summary["module_divergence_max"] == 0.0, summary["module_divergence"]
    # the global copies, not the local ones, learned: held-out loss of the averaged grid falls by more
    # than a quarter from initialization (5.6 -> about 2.6 nats per byte here); a wrong outer step (a
    # sign, a missing momentum) leaves the training loss of a round falling but not this
    assert summary["heldout_docs"] >= 50
    assert summary["heldout_loss_final"] < 0.75 * summary["heldout_loss_initial"], summary
    assert summary["bytes_sent_total"] > 0
    # the corpus was routed once, beside the manifest, and every peer read that instead of routing it
    for peer in summary["paths"]:
        assert "fetching the run's routing index" in (out / "logs" / f"{peer}.log").read_text(), peer
        assert not [f for f in (out / peer / "routes").glob("*.idx") if f.stat().st_size], peer
