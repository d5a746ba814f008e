"""End-to-end swarms of real peer processes on loopback: joining late, crashing, resuming, leaving."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dht.node import start_dht
from peer.checkpoint import list_checkpoints, load_latest_checkpoint
from peer.cli.local_swarm import LocalSwarm
from peer.swarm.claims import live_claims
from tests.swarm_harness import RUN, peer_args, wait_for, write_manifest


@pytest.fixture(scope="module")
def manifest_file(tmp_path_factory) -> tuple[Path, str]:
    return write_manifest(tmp_path_factory.mktemp("run"))


def rounds_in_log(log: str) -> list[str]:
    return re.findall(r"round \d+ step \d+ loss [\d.]+ (\{.*\})", log)


def test_late_joiner_downloads_modules_and_averages(tmp_path, manifest_file):
    path, run_id = manifest_file
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(path)])
        watcher, _ = start_dht(
            initial_peers=swarm.initial_peers, client_mode=True, run_name=RUN, run_id=run_id
        )
        try:
            swarm.start_peer(
                "a",
                peer_args(
                    run_id,
                    tmp_path / "a",
                    "--path",
                    "0",
                    "--max_rounds",
                    "1000",
                    "--keep_checkpoints",
                    "1000",
                ),
            )

            def a_round():
                claims = live_claims(watcher, RUN, run_id)
                return max((c.outer_round for c in claims.values()), default=0) >= 2

            wait_for(a_round, 90, "peer a to finish two rounds", swarm)
            swarm.start_peer("b", peer_args(run_id, tmp_path / "b", "--path", "0", "--max_steps", "30"))
            assert swarm.wait("b", timeout=120) == 0, swarm.log_path("b").read_text()[-3000:]
            swarm.kill("a", signal.SIGTERM)
            assert swarm.wait("a", timeout=60) == 0
        finally:
            watcher.shutdown()
        log_b = swarm.log_path("b").read_text()

    downloaded = re.findall(r"(\w+): caught up to module round", log_b)
    assert sorted(downloaded) == ["l0m0", "l1m0", "trunk"], log_b[-3000:]
    rounds = rounds_in_log(log_b)
    assert rounds and "averaged/2" in rounds[-1], rounds

    # B's copy after its last round equals A's copy after the same module round.
    tensors_b, meta_b = load_latest_checkpoint(tmp_path / "b")
    by_round = {}
    for info in list_checkpoints(tmp_path / "a"):
        if info.complete:
            by_round.setdefault(
                info.manifest["meta"]["outer_round"], info.path
            )  # the one right after the sync
    assert meta_b["outer_round"] in by_round, (meta_b["outer_round"], sorted(by_round))
    tensors_a = load_file(str(by_round[meta_b["outer_round"]] / "tensors.safetensors"))
    # the same bits: every holder applies the identical aggregate with a deterministic outer step
    shared = [k for k in tensors_b if "/global/" in k or "/momentum/" in k]
    assert shared and all(torch.equal(tensors_a[k], tensors_b[k]) for k in shared)


def test_kill_during_checkpoint_then_resume(tmp_path, manifest_file):
    path, run_id = manifest_file
    ckpt = tmp_path / "ckpt"
    with LocalSwarm(tmp_path / "logs") as swarm:
        args = ["--new_swarm", "--manifest_path", str(path), "--max_rounds", "5"]
        # Killed while writing its second checkpoint (after round 2): round 1's must survive.
        swarm.spawn(
            "p",
            ["peer", "--host_maddrs", "/ip4/127.0.0.1/tcp/0", *peer_args(run_id, ckpt), *args],
            env={"PATHSWARM_FAULTS": "checkpoint.before_manifest@2=kill"},
        )
        assert swarm.wait("p", timeout=90) == -signal.SIGKILL
        swarm.stop()
        tensors, meta = load_latest_checkpoint(ckpt)
        assert meta["outer_round"] == 1 and meta["step"] == 10

        swarm.spawn(
            "p2",
            ["peer", "--host_maddrs", "/ip4/127.0.0.1/tcp/0", *peer_args(run_id, ckpt), *args, "--resume"],
        )
        assert swarm.wait("p2", timeout=90) == 0, swarm.log_path("p2").read_text()[-3000:]
        log = swarm.log_path("p2").read_text()
    assert "resumed from checkpoint at step 10, outer round 1" in log
    tensors2, meta2 = load_latest_checkpoint(ckpt)
    assert meta2["outer_round"] == 5 and meta2["step"] == 50
    assert not torch.equal(tensors["trunk/global/tok_emb.weight"], tensors2["trunk/global/tok_emb.weight"])


def test_sigterm_finishes_step_checkpoints_and_leaves(tmp_path, manifest_file):
    path, run_id = manifest_file
    ckpt = tmp_path / "ckpt"
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.spawn(
            "p",
            [
                "peer",
                "--host_maddrs",
                "/ip4/127.0.0.1/tcp/0",
                *peer_args(run_id, ckpt),
                "--new_swarm",
                "--manifest_path",
                str(path),
                "--max_rounds",
                "1000",
            ],
        )
        wait_for(lambda: list_checkpoints(ckpt), 90, "a first checkpoint", swarm)
        swarm.kill("p", signal.SIGTERM)
        started = time.monotonic()
        assert swarm.wait("p", timeout=60) == 0
        assert time.monotonic() - started < 30
    tensors, meta = load_latest_checkpoint(ckpt)
    assert meta["step"] >= 10


def test_resumed_p4_peer_keeps_each_fragments_round_and_rejoins_its_groups(tmp_path):
    """H = 8, P = 4: fragment p syncs after steps 2p, 2p + 8, ... Peers stopped after step 12 have
    fragments at rounds [1, 2, 2, 1]; resumed to step 16, fragment 3 (step 14) and fragment 0
    (step 16) sync again, with each other, and every fragment ends at round 2."""
    path, run_id = write_manifest(tmp_path, inner_steps=8, fragments=4)
    names = ("a", "b")
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(path)])
        for phase, extra in (("1", ["--max_steps", "12"]), ("2", ["--max_steps", "16", "--resume"])):
            for name in names:
                args = peer_args(run_id, tmp_path / name, "--path", "0", "--wait_for_peers", "2", *extra)
                swarm.start_peer(name + phase, args)
            for name in names:
                log = swarm.log_path(name + phase)
                assert swarm.wait(name + phase, timeout=120) == 0, log.read_text()[-3000:]
            if phase == "1":
                for name in names:
                    _, meta = load_latest_checkpoint(tmp_path / name)
                    assert meta["step"] == 12
                    assert meta["fragment_rounds"] == {m: [1, 2, 2, 1] for m in ("trunk", "l0m0", "l1m0")}
    for name in names:
        _, meta = load_latest_checkpoint(tmp_path / name)
        assert meta["step"] == 16
        assert meta["fragment_rounds"] == {m: [2, 2, 2, 2] for m in ("trunk", "l0m0", "l1m0")}
        last = meta["history"][-1]
        assert last["step"] == 16 and sorted(last["fragments"]) == ["0", "3"], last
        for fragment, outcomes in last["fragments"].items():
            assert set(outcomes.values()) == {"averaged/2"}, (name, fragment, outcomes)
