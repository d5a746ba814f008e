"""Real processes that start safely: the monitor and a joiner refuse a manifest over the grid caps from
the DHT, a peer refuses a run whose artifacts its disk cannot hold before it fetches a byte of them,
and the swarm monitor listens on loopback unless told otherwise."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import time

import psutil
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from dht.keys import manifest_key
from dht.records import store_record
from monitoring.swarm.poller import find_manifest
from peer.artifacts.ref import MAX_ARTIFACT_BYTES, ArtifactRef
from peer.artifacts.room import free_bytes
from peer.cli.local_swarm import LOOPBACK, LocalSwarm
from peer.config import RunManifest
from peer.data.sources import DatasetSpec
from peer.errors import SwarmError
from peer.model.grid import MAX_PATHS
from peer.run.record import MAX_MANIFEST_BYTES, save_record, sign_manifest
from peer.swarm.manifest import fetch_manifest
from tests.swarm_harness import RUN, wait_for, write_manifest
from tests.test_manifest_caps import signed, with_grid

pytestmark = pytest.mark.swarm


@pytest.mark.timeout(60)
def test_the_monitor_and_a_joiner_refuse_a_manifest_over_the_grid_caps_from_the_dht_naming_the_cap(
    dht_factory,
):
    dht, key = dht_factory(run_name="huge")
    record = signed(with_grid(8, 64), key)  # 64**8 paths: walking them killed the monitor (MemoryError)
    assert store_record(dht, manifest_key("huge"), key, record, 60)
    for find in (find_manifest, fetch_manifest):
        started = time.monotonic()
        with pytest.raises(SwarmError) as err:
            find(dht, "huge", None, timeout_seconds=2)
        message = str(err.value)
        assert "\n" not in message and f"exceeds the cap of {MAX_PATHS} paths" in message, message
        assert time.monotonic() - started < 15


def shard(i: int) -> ArtifactRef:
    digest = hashlib.sha256(b"shard %d" % i).hexdigest()
    return ArtifactRef(
        name=f"{i:05d}.txt", sha256=digest, size_bytes=MAX_ARTIFACT_BYTES, chunk_bytes=2 << 20,
        chunks_sha256=digest,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_a_peer_refuses_a_run_whose_artifacts_exceed_its_free_disk_before_fetching_any(tmp_path):
    ckpt = tmp_path / "ckpt"
    n = free_bytes(tmp_path) // MAX_ARTIFACT_BYTES + 2  # more than this disk holds, by the manifest's word
    manifest = RunManifest(name=RUN, dataset=DatasetSpec(kind="text", shards=[shard(i) for i in range(n)]))
    if len(manifest.canonical_json()) > MAX_MANIFEST_BYTES:
        pytest.skip(f"this disk has {free_bytes(tmp_path)} bytes free: more than a signed manifest can claim")
    path = tmp_path / "manifest.json"
    save_record(sign_manifest(manifest, RSAPrivateKey()), path)
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "peer", "--run", RUN, "--new_swarm", "--manifest_path", str(path),
         "--host_maddrs", LOOPBACK, "--checkpoint_dir", str(ckpt), "--device", "cpu"],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pathswarm ")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("pathswarm peer: error: the run's artifacts (dataset.shards) need "), lines
    assert "--artifacts_dir" in lines[0]
    # nothing was fetched, not even the folder made
    assert not (ckpt / "artifacts").exists()


def listening_addresses(pid: int, port: int) -> set[str]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {
        c.laddr.ip
        for p in procs
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


@pytest.mark.timeout(150)
def test_the_monitor_serves_its_metrics_and_page_on_loopback_by_default(tmp_path):
    manifest, run_id = write_manifest(tmp_path)
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(manifest)])
        monitor = swarm.spawn("monitor", [
            "monitor", "--initial_peers", *swarm.initial_peers, "--host_maddrs", LOOPBACK,
            "--run", f"{RUN}@{run_id[:16]}", "--metrics_port", "0", "--http_port", "0",
        ])  # fmt: skip

        def ports():
            text = swarm.log_path("monitor").read_text()
            metrics = re.search(r"metrics on http://[^:]+:(\d+)/metrics", text)
            page = re.search(r"status page on http://[^:]+:(\d+)/", text)
            return (int(metrics.group(1)), int(page.group(1))) if metrics and page else None

        for port in wait_for(ports, 90, "the monitor to serve", swarm):
            started = time.monotonic()
            while not (found := listening_addresses(monitor.pid, port)) and time.monotonic() - started < 10:
                time.sleep(0.2)
            assert found == {"127.0.0.1"}, (port, found)
