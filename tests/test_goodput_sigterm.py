"""The goodput benchmark sent SIGTERM (a `timeout`) stops its swarm: killed outright, its peers and
their daemons trained on, orphaned, and slowed every later run on the machine (session 51)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[1]


def test_a_goodput_run_sent_sigterm_leaves_no_peer_behind(tmp_path):
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "benchmarks.goodput",
        "--out",
        str(out),
        "--arms",
        "rotation",
        "--seed",
        "1",
    ]
    bench = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    children: list[psutil.Process] = []
    try:
        logs = out / "runs" / "rotation" / "logs"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the peers train
            if any("first inner step" in f.read_text(errors="replace") for f in logs.glob("p*.log")):
                break
            time.sleep(0.5)
        else:
            pytest.fail("no peer trained within 120 s")
        children = psutil.Process(bench.pid).children(recursive=True)
        assert len(children) >= 3
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.cmdline()[:4] for p in alive]
    finally:
        if bench.poll() is None:
            bench.kill()
        for child in children:  # what a broken benchmark left running
            if child.is_running():
                child.kill()
