"""DiPaCo's discriminative re-routing on a live run: `pathswarm run reroute` fetches the paths from
their holders, publishes a creator-signed router version, the peers switch at a round boundary and
train their new shards; a router version signed by anyone else is refused, on the wire and on disk."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from dht.identity import load_identity
from dht.node import start_dht
from dht.schema import RouterRecord
from dht.validators import RecordSchemaValidator
from monitoring.metrics import PeerMetrics
from peer import faults
from peer.checkpoint import load_latest_checkpoint
from peer.cli.local_swarm import LOOPBACK, LocalSwarm
from peer.config import PeerConfig
from peer.errors import ConfigError
from peer.faults import ENV_VAR
from peer.run.record import load_verified_manifest
from peer.run.router_versions import (
    RouterVersion,
    latest_router_on_disk,
    publish_router_record,
    save_router_record,
    sign_router_version,
    verify_router_record,
)
from peer.training.router_switch import RouterFollower
from tests.swarm_harness import wait_for

pytestmark = pytest.mark.swarm

REPO = Path(__file__).resolve().parent.parent


def _create(folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out, key = folder / "manifest.json", folder / "creator.key"
    args = ["run", "create", "--name", "rr", "--out", str(out), "--grid", "1x2", "--inner_steps", "10",
            "--seq_len", "32", "--no_publish", "--identity_path", str(key)]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "peer", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, key


def _version(record, number: int, switch_round: int = 0) -> RouterVersion:
    ref = {"name": "router.json", "sha256": "ab" * 32, "size_bytes": 100, "chunks_sha256": "cd" * 32}
    return RouterVersion(
        run_id=record.run_id, router_version=number, switch_round=switch_round, router_file=ref
    )


@pytest.mark.timeout(120)
def test_only_the_creators_signature_makes_a_router_version(tmp_path):
    manifest_path, key_path = _create(tmp_path / "run")
    _, record = load_verified_manifest(manifest_path)
    creator, _ = load_identity(key_path)
    signed = sign_router_version(_version(record, 1), creator)
    assert verify_router_record(signed, record).router_version == 1
    with pytest.raises(ValueError, match="not signed by the run's creator"):
        verify_router_record(sign_router_version(_version(record, 1), RSAPrivateKey()), record)
    # the record's visible version must be the one signed: a relabelled record is refused
    with pytest.raises(ValueError, match="not signed|another run or version"):
        verify_router_record(signed.model_copy(update={"router_version": 9}), record)
    tampered = signed.model_copy(
        update={"payload_json": signed.payload_json.replace('"switch_round":0', '"switch_round":5')}
    )
    with pytest.raises(ValueError, match="not signed by the run's creator"):
        verify_router_record(tampered, record)
    # on disk: the highest verified version wins; a forged file stops the command in one line
    folder = tmp_path / "run"
    save_router_record(signed, folder)
    save_router_record(sign_router_version(_version(record, 2, 4), creator), folder)
    assert latest_router_on_disk(folder, record)[0].router_version == 2
    forged = sign_router_version(_version(record, 3), RSAPrivateKey())
    save_router_record(forged, folder)
    with pytest.raises(ConfigError, match="router-v3.json does not verify: not signed") as e:
        latest_router_on_disk(folder, record)
    assert "\n" not in str(e.value)


@pytest.mark.timeout(60)
def test_reroute_with_a_key_that_did_not_create_the_run_is_refused_in_one_line(tmp_path):
    manifest_path, _ = _create(tmp_path / "run")
    load_identity(tmp_path / "other.key")  # a key of its own, not the creator's
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "run", "reroute", "--manifest_path", str(manifest_path),
         "--identity_path", str(tmp_path / "other.key"), "--initial_peers", "/ip4/127.0.0.1/tcp/1/p2p/x"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "is not the key that created run rr" in err[0], proc.stderr[-2000:]


def _trained_after_switch(log: str) -> bool:
    at = _switched_at(log, 1)
    return at is not None and re.search(rf"round {at + 1} step \d+ loss", log) is not None


def _switched_at(log: str, version: int) -> int | None:
    m = re.search(rf"router version {version} from round (\d+) \(due at round (\d+)\)", log)
    if m is None:
        return None
    assert int(m[1]) >= int(m[2])  # never before the round the creator named
    return int(m[1])


@pytest.mark.timeout(300)
def test_a_live_run_is_rerouted_by_its_creator_and_the_peers_switch_at_a_round_boundary(tmp_path):
    manifest_path, key_path = _create(tmp_path / "run")
    _, record = load_verified_manifest(manifest_path)
    common = ["--torch_threads", "1", "--batch_size", "4", "--heartbeat_seconds", "1", "--max_rounds", "1000",
              "--wait_for_peers", "2"]  # fmt: skip
    # a has the run folder (it could take the new router from there); b joins by name and can only
    # fetch it by hash from a peer
    joins = {
        "a": ["--run", "rr", "--manifest_path", str(manifest_path)],
        "b": ["--run", f"rr@{record.run_id[:16]}"],
    }
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(manifest_path)])
        for name, path in (("a", "0"), ("b", "1")):
            swarm.start_peer(
                name, [*joins[name], *common, "--path", path, "--checkpoint_dir", str(tmp_path / name)]
            )
        logs = {n: (lambda n=n: swarm.log_path(n).read_text()) for n in ("a", "b")}
        wait_for(
            lambda: "round 2 step" in logs["a"]() or not swarm.alive("a"), 150, "a's second round", swarm
        )
        assert swarm.alive("a") and swarm.alive("b"), logs["a"]()[-3000:]
        # someone without the creator's key publishes a higher version: the peers must never take it
        dht, forger = start_dht(initial_peers=swarm.initial_peers, run_name="rr", run_id=record.run_id)
        try:
            dht.add_validators([RecordSchemaValidator("rr", record.run_id)])
            forged = sign_router_version(_version(record, 7), forger)
            # the run's nodes refuse to store it (tests/test_record_limits.py); a node that does not
            # know the run's creator may, and every reader checks the signature again
            publish_router_record(dht, forger, "rr", forged)
            swarm.spawn("reroute", ["run", "reroute", "--manifest_path", str(manifest_path),
                        "--identity_path", str(key_path), "--initial_peers", *swarm.initial_peers,
                        "--host_maddrs", LOOPBACK, "--switch_after_rounds", "1", "--docs", "200",
                        "--eval_docs", "40", "--serve_seconds", "120", "--force"])  # fmt: skip
            assert swarm.wait("reroute", timeout=180) == 0, swarm.log_path("reroute").read_text()[-3000:]
        finally:
            dht.shutdown()
        said = swarm.log_path("reroute").read_text()
        # both switched (the tool waited for that); each then trains a round on its new shard
        for n in ("a", "b"):
            wait_for(lambda n=n: _trained_after_switch(logs[n]()), 60, f"{n}'s round after the switch", swarm)
        for n in ("a", "b"):  # together: a peer left alone waits out its round's averaging timeout
            swarm.kill(n, signal.SIGTERM)
        for n in ("a", "b"):
            assert swarm.wait(n, timeout=60) == 0, logs[n]()[-3000:]
        a_log, b_log = logs["a"](), logs["b"]()
        # the run paused (its peers stopped, the bootstrap up): version 2 from the peers' checkpoints,
        # which b takes as it resumes, before its first step
        swarm.spawn("paused", ["run", "reroute", "--manifest_path", str(manifest_path),
                    "--identity_path", str(key_path), "--initial_peers", *swarm.initial_peers,
                    "--host_maddrs", LOOPBACK, "--switch_after_rounds", "0", "--docs", "200",
                    "--eval_docs", "0", "--serve_seconds", "120", "--force",
                    "--checkpoints", str(tmp_path / "a"), str(tmp_path / "b")])  # fmt: skip
        paused = lambda: swarm.log_path("paused").read_text()  # noqa: E731
        wait_for(
            lambda: "router version 2:" in paused() or not swarm.alive("paused"), 120, "version 2", swarm
        )
        swarm.start_peer("b2", [*joins["b"], *common, "--wait_for_peers", "1", "--resume", "--path", "1",
                         "--checkpoint_dir", str(tmp_path / "b")])  # fmt: skip
        assert swarm.wait("paused", timeout=120) == 0, paused()[-3000:]
        # the tool saw the switch (b2 republished version 2): its first step may still be to come
        b2_said = lambda: swarm.log_path("b2").read_text()  # noqa: E731
        wait_for(lambda: "first inner step" in b2_said(), 60, "b2's first inner step", swarm)
        swarm.kill("b2", signal.SIGTERM)
        assert swarm.wait("b2", timeout=60) == 0
        b2_log = swarm.log_path("b2").read_text()
    # the tool fetched both modules from their holders, scored, and saw both peers switch
    assert re.search(r"router version 1: \d+ of 200 training documents change path", said), said[-2000:]
    assert "held-out loss of the current paths (40 documents): routed as now" in said
    assert "2 of 2 peer(s) switched to router version 1" in said, said[-2000:]
    v1 = RouterRecord.model_validate_json((tmp_path / "run" / "router-v1.json").read_text())
    switch_round = verify_router_record(v1, record).switch_round
    for log in (a_log, b_log):
        at = _switched_at(log, 1)
        assert at is not None and at >= switch_round, log[-3000:]
        assert "router version 7" not in log  # the forged version never reached a peer's data
    assert "fetching router version 1" in b_log, b_log[-3000:]
    assert "1 of 1 peer(s) switched to router version 2" in paused()
    resumed = b2_log.index("resumed from checkpoint")
    assert resumed < b2_log.index("router version 2 from round") < b2_log.index("first inner step")
    # each peer holds its router, checked by hash, and its checkpoints say which router it trained with
    for name, version in (("a", 1), ("b", 2)):
        _, meta = load_latest_checkpoint(tmp_path / name)
        assert meta["router_version"] == version
        assert (tmp_path / name / "artifacts" / meta["router_file"]["sha256"]).is_file()
    # evaluation routes with the latest router the checkpoints trained with
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "eval", "--manifest_path", str(manifest_path), "--checkpoints",
         str(tmp_path / "a"), str(tmp_path / "b"), "--max_docs", "30", "--baseline_steps", "0",
         "--swarm_baseline_steps", "0",
         "--json", str(tmp_path / "eval.json")],
        capture_output=True, text=True, cwd=REPO, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "routing with router version 2" in proc.stdout
    assert json.loads((tmp_path / "eval.json").read_text())["composite"]["ppl"] > 1


@contextmanager
def _follower_of_a_slow_dht(tmp_path, monkeypatch, stall_seconds: float):
    """A router follower of a real DHT whose reads of the router versions each stall that long."""
    manifest_path, _ = _create(tmp_path / "run")
    manifest, record = load_verified_manifest(manifest_path)
    monkeypatch.setenv(ENV_VAR, f"router.read=stall:{stall_seconds}")
    faults.reset_faults()
    dht, key = start_dht(run_name="rr", run_id=record.run_id)
    try:
        config = PeerConfig.model_construct(run="rr", checkpoint_dir=tmp_path / "ckpt")
        metrics = PeerMetrics("rr", "me", "0", "test")
        follower = RouterFollower(dht, key, config, manifest, record, None, None, metrics)
        yield follower
        follower.shutdown()
    finally:
        faults.reset_faults()
        dht.shutdown()


@pytest.mark.timeout(60)
def test_a_round_end_never_waits_for_the_dht_read_of_the_router_versions(tmp_path, monkeypatch):
    with _follower_of_a_slow_dht(tmp_path, monkeypatch, 5) as follower:  # a DHT that takes 5 s to answer
        assert follower.due(1, 0) is None
        reading = follower._reading
        assert reading is not None and not reading.done()  # the round's end came back mid-read
        assert follower.due(2, 0) is None and follower._reading is reading  # one read at a time
        assert reading.result(timeout=30) is None  # no version published: the read found none
        follower.due(3, 0)
        assert follower._reading is not reading  # the next boundary starts the next read


@pytest.mark.timeout(60)
def test_every_round_ends_reads_go_to_one_reader_thread(tmp_path, monkeypatch):
    """A thread started at every round's end cost the training thread 0.6-0.9% of its time."""
    with _follower_of_a_slow_dht(tmp_path, monkeypatch, 0.05) as follower:
        threads = set()
        for outer_round in range(1, 6):
            follower.due(outer_round, 0)
            threads.add(follower._reader)
            assert follower._reading.result(timeout=30) is None
        names = [t for t in threading.enumerate() if t.name == "router-versions"]
        assert len(threads) == 1 and names == [follower._reader]


@pytest.mark.timeout(60)
def test_a_leaving_peer_waits_for_its_router_versions_read_before_its_dht_goes_down(tmp_path, monkeypatch):
    """A read thread left running into the interpreter's exit aborted a peer that had finished cleanly."""
    with _follower_of_a_slow_dht(tmp_path, monkeypatch, 2) as follower:
        follower.due(1, 0)
        reading = follower._reading
        assert reading is not None and not reading.done()
        follower.shutdown()
        assert reading.done()
        reading_threads = lambda: [t for t in threading.enumerate() if t.name == "router-versions"]  # noqa: E731
        assert not reading_threads()
        assert follower.due(2, 0) is None and not reading_threads()  # no read starts once it left
