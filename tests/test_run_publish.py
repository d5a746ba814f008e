"""`pathswarm run create --initial_peers …` publishes the signed manifest where joiners find it, or
fails with the reason and a non-zero exit (it used to print "could not publish" and exit 0: the DHT
node signed with a throwaway identity, so every node refused the record)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dht.node import start_dht
from peer.cli.local_swarm import LocalSwarm
from peer.swarm.manifest import fetch_manifest
from tests.test_cli import DEAD_PEER, error_lines

pytestmark = pytest.mark.swarm

CREATE = ["run", "create", "--name", "published", "--grid", "1x1", "--preset", "tiny"]


def _create(out, *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "peer", *CREATE, "--out", str(out), *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(180)
def test_run_create_publishes_a_manifest_a_joiner_finds_by_name(tmp_path):
    with LocalSwarm(tmp_path) as swarm:
        initial_peers = swarm.start_bootstrap()
        proc = _create(tmp_path / "m.json", "--initial_peers", *initial_peers)
        assert proc.returncode == 0, proc.stderr
        assert "published to the DHT" in proc.stdout
        run_id = proc.stdout.split(" id ")[1].split()[0]
        dht, _ = start_dht(initial_peers=initial_peers, client_mode=True)
        try:
            manifest, record = fetch_manifest(dht, "published", timeout_seconds=20)
        finally:
            dht.shutdown()
    assert record.run_id == run_id and manifest.name == "published"


@pytest.mark.timeout(120)
def test_run_create_that_cannot_publish_exits_nonzero_with_the_reason(tmp_path):
    proc = _create(tmp_path / "m.json", "--initial_peers", DEAD_PEER)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "initial peer" in lines[0], proc.stderr
    assert (tmp_path / "m.json").exists()  # the signed file is kept: peers can still use it
