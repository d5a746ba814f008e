"""A volunteer who shares the machine caps the training rate: the loop keeps to it (a real peer)."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import datetime

import pytest

from tests.swarm_harness import peer_args, write_manifest

pytestmark = pytest.mark.swarm


def _stamp(line: str) -> datetime:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")


@pytest.mark.timeout(90)
def test_a_peer_capped_at_ten_steps_per_second_takes_at_least_a_tenth_of_a_second_per_step(tmp_path):
    path, run_id = write_manifest(tmp_path)
    args = peer_args(run_id, tmp_path / "ckpt", "--max_inner_steps_per_second", "10", "--max_steps", "30")
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "peer", "--new_swarm", "--manifest_path", str(path),
         "--host_maddrs", "/ip4/127.0.0.1/tcp/0", *args],
        capture_output=True, text=True, timeout=80,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    first = next(line for line in lines if "first inner step" in line)
    last = next(line for line in lines if re.search(r" round \d+ step 30 ", line))
    # 29 paced gaps between the first step's end and the 30th's; uncapped, this tiny model does ~80/s
    assert (_stamp(last) - _stamp(first)).total_seconds() >= 2.8, "\n".join(lines[-20:])
