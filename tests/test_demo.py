"""`pathswarm demo` end to end: a bootstrap node and four peers as real processes on loopback."""

from __future__ import annotations

import json
import subprocess
import sys


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
    assert summary["module_divergence_max"] <= 1e-3
    assert summary["bytes_sent_total"] > 0
