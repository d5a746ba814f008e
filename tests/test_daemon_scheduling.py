"""A peer's p2p daemon yields to its training thread: its threads run under SCHED_BATCH (their
wake-ups do not preempt), unless the peer is told otherwise (dht/daemon_scheduling.py)."""

from __future__ import annotations

import os
import sys

import psutil
import pytest

from peer.config import PeerConfig
from peer.training.joining import start_node

pytestmark = [
    pytest.mark.swarm,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_BATCH is Linux's"),
]


def _daemon_policies() -> set[int]:
    daemons = [c for c in psutil.Process().children(recursive=True) if c.name() == "p2pd"]
    assert daemons, "no p2p daemon below this process"
    return {os.sched_getscheduler(t.id) for d in daemons for t in d.threads()}


@pytest.mark.timeout(90)
def test_a_peers_p2p_daemon_runs_under_batch_scheduling_unless_told_not_to(tmp_path):
    for batch in (True, False):
        config = PeerConfig(
            run="sched", new_swarm=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            manifest_path=tmp_path / "unused.json", checkpoint_dir=tmp_path / str(batch),
            p2p_daemon_batch_scheduling=batch,
        )  # fmt: skip
        dht, _ = start_node(config)
        try:
            assert _daemon_policies() == ({os.SCHED_BATCH} if batch else {os.SCHED_OTHER}), batch
        finally:
            dht.shutdown()
