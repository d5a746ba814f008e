"""End-to-end swarms of real peer processes on loopback: joining late, crashing, resuming, leaving."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import torch

from dht.node import start_dht
from peer.checkpoint import list_checkpoints, load_latest_checkpoint
from peer.cli.local_swarm import LocalSwarm
from peer.codecs.specs import codec_spec
from peer.model.transformer import PathModel
from peer.run.record import load_verified_manifest
from peer.swarm.claims import live_claims, read_shards
from peer.sync.module_sync import ModuleSync
from tests.swarm_harness import (
    RUN,
    checkpoints_by_count,
    downloaded_state,
    logs_of,
    module_state,
    module_tensors,
    peer_args,
    shared_state,
    wait_for,
    write_manifest,
)

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def manifest_file(tmp_path_factory) -> tuple[Path, str]:
    return write_manifest(tmp_path_factory.mktemp("run"))


def rounds_in_log(log: str) -> list[str]:
    return re.findall(r"round \d+ step \d+ loss [\d.]+ (\{.*\})", log)


@pytest.mark.timeout(300)
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
                claims = live_claims(watcher, RUN, run_id, 4)
                return max((c.outer_round for c in claims.values()), default=0) >= 2

            wait_for(a_round, 90, "peer a to finish two rounds", swarm)
            # --max_rounds counts b's own rounds, not the swarm's (already past 2 when b joins)
            b_args = peer_args(run_id, tmp_path / "b", "--path", "0", "--keep_checkpoints", "100")
            swarm.start_peer("b", [*b_args, "--max_rounds", "2"])
            assert swarm.wait("b", timeout=120) == 0, swarm.log_path("b").read_text()[-3000:]
            _, meta_joined = load_latest_checkpoint(tmp_path / "b")
            # resumed with --max_rounds 4, it goes on to 4 rounds of its own in all
            swarm.start_peer("b2", [*b_args, "--max_rounds", "4", "--resume"])
            assert swarm.wait("b2", timeout=120) == 0, swarm.log_path("b2").read_text()[-3000:]
            swarm.kill("a", signal.SIGTERM)
            assert swarm.wait("a", timeout=60) == 0
        finally:
            watcher.shutdown()
        log_b = swarm.log_path("b").read_text()
        log_resumed = swarm.log_path("b2").read_text()
        log_a = swarm.log_path("a").read_text()

    def round_lines(round_: int) -> str:  # what each side logged about the round, should its copies differ
        near = re.compile(rf"round {round_ - 1} |round {round_} |repair|merg|differ|left out|took their")
        return "\n".join(
            f"{name}: {line}"
            for name, log in (("a", log_a), ("b", log_b), ("b2", log_resumed))
            for line in log.splitlines()
            if near.search(line)
        )[-6000:]

    downloaded = re.findall(r"(\w+): caught up to module round", log_b)
    assert sorted(downloaded) == ["l0m0", "l1m0", "trunk"], log_b[-3000:]
    rounds = rounds_in_log(log_b)
    assert rounds and "averaged/2" in rounds[-1], rounds
    # a normal join is quiet: nothing at WARNING or above (a first round's repair is said at INFO)
    loud = [line for line in log_b.splitlines() if re.search(r" (WARN|WARNING|ERROR|CRITICAL) ", line)]
    assert not loud, "\n".join(loud)
    assert len(meta_joined["history"]) == 2 and meta_joined["own_rounds"] == 2, meta_joined["history"]
    assert meta_joined["history"][0]["round"] > 2  # the swarm's round, in the history and the log
    assert "(own round 2)" in log_b
    assert "(own rounds 2)" in log_resumed, log_resumed[-3000:]
    _, meta_resumed = load_latest_checkpoint(tmp_path / "b")
    assert meta_resumed["own_rounds"] == 4 and len(meta_resumed["history"]) == 4, meta_resumed["history"]

    # What b downloaded, checkpointed before its first step (later rounds' averaging and repair would
    # make the copies agree even after a wrong download): every module's global copy and momentum are
    # a's at the same module round, bit for bit, and b's local weights start from that global copy.
    joined, meta_download = downloaded_state(tmp_path / "b")
    for module in ("trunk", "l0m0", "l1m0"):
        count = meta_download["fragment_rounds"][module][0]
        by_count = checkpoints_by_count(tmp_path / "a", module)
        assert count in by_count, (module, count, sorted(by_count))
        donor, ours = module_state(by_count[count], module), module_tensors(joined, module)
        assert donor.keys() == ours.keys() and any("/momentum/" in k for k in ours)
        assert all(torch.equal(donor[k], ours[k]) for k in donor), module
        for name, value in ours.items():
            if "/global/" in name:
                local = joined[f"local/parts.{module}.{name.split('/global/')[1]}"]
                assert torch.equal(local, value), name

    # After each round in which a module of a and b averaged together (the same group of two, as each
    # of them records it), b's copy of it equals a's bit for bit at the same module round: every
    # holder applies the identical aggregate with a deterministic outer step. Compared by the module's
    # own round, not the peers' round counts: a joiner that caught one module up a round further than
    # the others (its donor finished a round mid-download) numbers its rounds one behind that module's.
    # A round one side ran alone (a timeout on a loaded machine) is not such a round, but there must
    # be one.
    ours, theirs = modules_averaged_in_pairs(tmp_path / "b"), modules_averaged_in_pairs(tmp_path / "a")
    together = sorted(r for r in ours if r in theirs and ours[r][1] == theirs[r][1])
    assert together, (meta_resumed["history"], logs_of(swarm, "a", "b", "b2"))
    for module, count in together:
        tensors_b, tensors_a = (module_state(side[module, count][0], module) for side in (ours, theirs))
        differ = [k for k in tensors_b if not torch.equal(tensors_a[k], tensors_b[k])]
        where = (ours[module, count][0], theirs[module, count][0])
        assert tensors_b and tensors_a.keys() == tensors_b.keys() and not differ, (
            module,
            count,
            differ[:4],
            where,
            round_lines(ours[module, count][2]),
        )


def modules_averaged_in_pairs(ckpt: Path) -> dict[tuple[str, tuple[int, ...]], tuple[Path, frozenset, int]]:
    """A peer's checkpoints written right after a round in which a module averaged in a group of two, by
    (module, the module's fragment rounds then), with the group it recorded and the peer's round."""
    out = {}
    for info in list_checkpoints(ckpt):
        meta = info.manifest["meta"] if info.complete else {}
        last = (meta.get("history") or [None])[-1]
        if not last or last["round"] != meta["outer_round"]:
            continue
        for module, outcome in last["outcomes"].items():
            rounds = meta["fragment_rounds"].get(module)
            if outcome == "averaged/2" and rounds is not None:
                group = frozenset(last["groups"][module])
                out.setdefault((module, tuple(rounds)), (info.path, group, meta["outer_round"]))
    return out


@pytest.mark.timeout(240)
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
        assert [stream["batches"] for stream in meta["data"]["streams"]] == [10]  # where its data stood

        swarm.spawn(
            "p2",
            ["peer", "--host_maddrs", "/ip4/127.0.0.1/tcp/0", *peer_args(run_id, ckpt), *args, "--resume"],
        )
        assert swarm.wait("p2", timeout=90) == 0, swarm.log_path("p2").read_text()[-3000:]
        log = swarm.log_path("p2").read_text()
    assert "resumed from checkpoint at step 10, outer round 1" in log
    assert "data goes on after the 10 batches its stream gave before the restart" in log
    tensors2, meta2 = load_latest_checkpoint(ckpt)
    assert meta2["outer_round"] == 5 and meta2["step"] == 50
    assert [stream["batches"] for stream in meta2["data"]["streams"]] == [50]  # not the top of the shard
    assert not torch.equal(tensors["trunk/global/tok_emb.weight"], tensors2["trunk/global/tok_emb.weight"])


@pytest.mark.timeout(240)
def test_sigterm_finishes_step_checkpoints_and_leaves(tmp_path, manifest_file):
    path, run_id = manifest_file
    ckpt = tmp_path / "ckpt"
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(path)])
        watcher, _ = start_dht(
            initial_peers=swarm.initial_peers, client_mode=True, run_name=RUN, run_id=run_id
        )
        try:
            # H = 10: the round-1 checkpoint is at step 10; the peer then stalls before step 15, where
            # SIGTERM reaches it, so a checkpoint written on the way out is at step 15, not a round's.
            swarm.start_peer(
                "p",
                peer_args(run_id, ckpt, "--max_rounds", "1000", "--keep_checkpoints", "100"),
                env={"PATHSWARM_FAULTS": "train.step@15=stall:6"},
            )
            wait_for(lambda: list_checkpoints(ckpt), 90, "a first checkpoint", swarm)
            peer_id = wait_for(lambda: next(iter(live_claims(watcher, RUN, run_id, 4)), None), 30, "a claim")

            def stalled_claim():
                found = live_claims(watcher, RUN, run_id, 4).get(peer_id)
                return found if found is not None and found.step == 14 else None

            # mid-round, a claim says its steps per path as of its last round's end, and those of that
            # round: the rotation works out every claim's steps as of the round before, exactly
            stalled = wait_for(stalled_claim, 10, "the claim of the stalled step", swarm)
            assert stalled.outer_round == 1 and sum(stalled.path_steps.values()) == 10, stalled
            assert stalled.round_steps == stalled.path_steps, stalled
            swarm.kill("p", signal.SIGTERM)
            started = time.monotonic()
            assert swarm.wait("p", timeout=60) == 0
            assert time.monotonic() - started < 30

            def leaving_claim():
                found = read_shards(watcher, RUN, run_id, range(4)).get(peer_id)
                return found is not None and found[0].leaving

            # others stop counting on it at once instead of waiting for its claim to expire
            assert wait_for(leaving_claim, 10, "the leaving claim", swarm)
            assert peer_id not in live_claims(watcher, RUN, run_id, 4)
        finally:
            watcher.shutdown()
    steps = [i.step for i in list_checkpoints(ckpt) if i.complete]
    assert steps == [10, 15], steps
    tensors, meta = load_latest_checkpoint(ckpt)
    assert meta["step"] == 15 and meta["outer_round"] == 1
    # beside the steps it stopped at, what its claims said (as of round 1's end, and in round 1): a
    # resumed peer's claims count as its last one did, in every view that still holds that one
    assert sum(meta["path_steps"].values()) == 15, meta["path_steps"]
    assert meta["round_path_steps"] == meta["round_steps"] == stalled.round_steps, meta


def fragment_payload_bytes(manifest_path: Path, codec: str) -> list[int]:
    """Bytes one member sends another for each fragment sync of path 0 (all its modules), from the
    fragment plan and the codec table's exact wire size."""
    manifest, _ = load_verified_manifest(manifest_path)
    cfg, n = manifest.model, manifest.sync.fragments
    model = PathModel(cfg, (0, 0), seed=0)
    spec = codec_spec(codec)
    syncs = [ModuleSync(cfg, mid, model.parts[mid], manifest.outer, n) for mid in model.module_ids]
    return [sum(spec.wire_bytes(ms.fragment_size(f)) for ms in syncs) for f in range(n)]


@pytest.mark.timeout(300)
def test_resumed_p4_nf4_peers_keep_each_fragments_round_rejoin_their_groups_and_stay_identical(tmp_path):
    """H = 8, P = 4, NF4 outer gradients: fragment p syncs after steps 2p, 2p + 8, ... Peers stopped
    after step 12 have fragments at rounds [1, 2, 2, 1]; resumed to step 16, fragment 3 (step 14) and
    fragment 0 (step 16) sync again, with each other, and every fragment ends at round 2."""
    path, run_id = write_manifest(tmp_path, inner_steps=8, fragments=4, codec="nf4")
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
    states = {}
    payload = fragment_payload_bytes(path, "nf4")
    for name in names:
        tensors, meta = load_latest_checkpoint(tmp_path / name)
        states[name] = shared_state(tensors)
        assert meta["step"] == 16
        assert meta["fragment_rounds"] == {m: [2, 2, 2, 2] for m in ("trunk", "l0m0", "l1m0")}
        last = meta["history"][-1]
        assert last["step"] == 16 and sorted(last["fragments"]) == ["0", "3"], last
        for fragment, outcomes in last["fragments"].items():
            assert set(outcomes.values()) == {"averaged/2"}, (name, fragment, outcomes)
        # round 1 of phase 1 ran all four fragment syncs (steps 2, 4, 6, 8): together they carry the
        # whole path once, each about a quarter of it (the plan's fragments, NF4's exact size), plus
        # per module and sync a signed report and an echo of the group's reports (under 5.5 KiB)
        first = meta["history"][0]
        overhead = 3 * 5632
        assert sorted(first["fragments"]) == ["0", "1", "2", "3"], first
        assert sum(payload) <= first["bytes_sent"] <= 1.05 * sum(payload) + 4 * overhead, (first, payload)
        assert max(payload) <= first["peak_sync_bytes"] <= 1.05 * max(payload) + overhead, (first, payload)
        assert max(payload) < 0.3 * sum(payload)
    # NF4 rounding happens before the all-gather: both holders apply the same decoded average
    assert states["a"].keys() == states["b"].keys() and states["a"]
    assert all(torch.equal(states["a"][k], states["b"][k]) for k in states["a"])
