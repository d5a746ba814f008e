"""Faults in a live swarm of real peer processes, injected deterministically: a member killed in the
middle of a round or of a message, a stalled member, a full disk, the last holder of a module leaving,
a flood of forged claims, clocks apart. The survivors must keep averaging with
each other — identical copies, bounded rounds, no NaN — and nobody's module may silently reset."""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch

from dht.identity import peer_id_of_key
from dht.node import start_dht
from dht.schema import ClaimRecord
from peer.checkpoint import SPACE_MARGIN_BYTES, list_checkpoints
from peer.cli.local_swarm import LocalSwarm
from peer.swarm.claims import live_claims, publish_claim
from peer.swarm.keeper import kept_modules
from tests.swarm_harness import (
    RUN,
    checkpoints_by_count,
    downloaded_state,
    final_state,
    logs_of,
    module_state,
    outcomes,
    peer_args,
    shared_state,
    states_by_round,
    wait_for,
    write_manifest,
)

pytestmark = pytest.mark.swarm

TIMEOUT = 6.0  # the runs' averaging timeout in these tests
REPORT = 2.0


def round_gaps(meta: dict) -> list[float]:
    times = [e["time"] for e in meta["history"]]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def assert_same_bits(*states: dict[str, torch.Tensor]) -> None:
    reference = shared_state(states[0])
    assert reference
    for other in states[1:]:
        other = shared_state(other)
        assert other.keys() == reference.keys()
        different = [k for k in reference if not torch.equal(reference[k], other[k])]
        assert not different, different[:4]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "fault",
    [
        "sync.receive_delta@9=kill",  # dies while another member's outer gradient arrives (round 2)
        "sync.between_frames@5=kill",  # dies having sent a header, before its payload (round 2)
    ],
)
def test_survivors_of_a_member_killed_mid_round_average_without_it(tmp_path, fault):
    path, run_id = write_manifest(
        tmp_path, grid=(1, 1), averaging_timeout_seconds=TIMEOUT, report_timeout_seconds=REPORT
    )
    names = ["p0", "p1", "p2", "victim"]
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(path)])
        for name in names:
            env = {"PATHSWARM_FAULTS": fault} if name == "victim" else None
            args = peer_args(run_id, tmp_path / name, "--max_rounds", "5", "--wait_for_peers", "4")
            swarm.start_peer(name, args, env=env)
        assert swarm.wait("victim", timeout=120) == -signal.SIGKILL, logs_of(swarm, "victim")
        for name in names[:3]:
            assert swarm.wait(name, timeout=120) == 0, logs_of(swarm, name)
    survivors = [final_state(tmp_path / n) for n in names[:3]]
    assert_same_bits(*(t for t, _ in survivors))
    for _, meta in survivors:
        assert meta["outer_round"] == 5
        assert all(math.isfinite(e["loss"]) for e in meta["history"])
        # every round ended averaged with the others (the victim in the round it died in or not)
        assert all(set(o.values()) <= {"averaged/3", "averaged/4"} for o in outcomes(meta)), outcomes(meta)
        assert any("averaged/3" in o.values() for o in outcomes(meta))
        # ... and no round waited much longer than one averaging timeout for the dead member
        assert max(round_gaps(meta)) < TIMEOUT + REPORT + 4.0, round_gaps(meta)


@pytest.mark.timeout(240)
def test_a_stalled_member_is_left_out_then_catches_up_when_it_resumes(tmp_path):
    path, run_id = write_manifest(
        tmp_path, grid=(1, 1), averaging_timeout_seconds=TIMEOUT, report_timeout_seconds=REPORT
    )
    names = ["p0", "p1", "stalled"]
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(path)])
        for name in names:
            args = peer_args(run_id, tmp_path / name, "--max_rounds", "8", "--wait_for_peers", "3",
                             "--keep_checkpoints", "100")  # fmt: skip
            swarm.start_peer(name, args)
        wait_for(lambda: len(states_by_round(tmp_path / "stalled")) >= 2, 90, "two rounds", swarm)
        swarm.kill("stalled", signal.SIGSTOP)  # the main process only: its p2p daemon still accepts
        time.sleep(2 * TIMEOUT)
        swarm.kill("stalled", signal.SIGCONT)
        for name in names:
            assert swarm.wait(name, timeout=150) == 0, logs_of(swarm, name)
        log = swarm.log_path("stalled").read_text()
    (t0, m0), (t1, m1), (t2, m2) = (final_state(tmp_path / n) for n in names)
    # while it was stopped the others averaged as two, each round within a timeout
    assert any("averaged/2" in o.values() for o in outcomes(m0))
    assert max(round_gaps(m0)) < TIMEOUT + REPORT + 4.0, round_gaps(m0)
    # once resumed it found itself behind, fetched the others' state, and rejoined them
    assert "fetched their state" in log or "excluded" in log, log[-3000:]
    # (--max_rounds counts its own rounds: having skipped the stalled ones, it may end with a few
    # rounds alone after the others stopped, so look at every round after the two before the stall)
    assert any("averaged/3" in o.values() for o in outcomes(m2)[2:]), outcomes(m2)
    # and everyone holds the same bits: each pair compared per module at the last sync count both
    # reached. Not the final checkpoints: --max_rounds counts a peer's own rounds, and a peer whose
    # copy was set back by a repair (or that skipped rounds by fetching state) stops at another swarm
    # round than the others; and after a repair a module's count may run one ahead of the trunk's.
    for a, b in (("p0", "p1"), ("stalled", "p0")):
        for module in ("trunk", "l0m0"):
            mine = checkpoints_by_count(tmp_path / a, module)
            theirs = checkpoints_by_count(tmp_path / b, module)
            last = max(set(mine) & set(theirs))
            assert last >= min(m0["outer_round"], m1["outer_round"]) - 1, (a, b, sorted(mine), sorted(theirs))
            assert_same_bits(module_state(mine[last], module), module_state(theirs[last], module))


@pytest.mark.timeout(240)
def test_the_last_holder_leaving_loses_nothing_with_a_keeper(tmp_path):
    """Every peer of the run leaves (SIGTERM, a clean exit); a new peer goes on from the kept state,
    not from initial weights."""
    path, run_id = write_manifest(tmp_path, grid=(1, 1))
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(path), "--keep_state", str(tmp_path / "kept"),
                                     "--keep_every_seconds", "1"])  # fmt: skip
        swarm.start_peer("first", peer_args(run_id, tmp_path / "first", "--max_rounds", "1000"))
        wait_for(lambda: final_state_round(tmp_path / "first") >= 4, 90, "four rounds", swarm)
        swarm.kill("first", signal.SIGTERM)
        assert swarm.wait("first", timeout=60) == 0, logs_of(swarm, "first")
        final_tensors, first = final_state(tmp_path / "first")
        watcher, _ = start_dht(
            initial_peers=swarm.initial_peers, client_mode=True, run_name=RUN, run_id=run_id
        )
        try:  # the keeper holds the first peer's last state before the second comes
            kept = lambda: kept_modules(watcher, RUN, run_id).get("trunk", [("", -1)])[0][1]  # noqa: E731
            wait_for(lambda: kept() >= first["outer_round"], 60, "the keeper to keep the last round", swarm)
        finally:
            watcher.shutdown()
        second_args = peer_args(run_id, tmp_path / "second", "--max_steps", "20", "--keep_checkpoints", "100")
        swarm.start_peer("second", second_args)
        assert swarm.wait("second", timeout=120) == 0, logs_of(swarm, "second", "bootstrap")
        log = swarm.log_path("second").read_text()
    assert "from its keepers" in log, log[-3000:]
    assert "starts again from its initial weights" not in log
    # what it downloaded (checkpointed before its first step) is the leaver's final state, bit for bit
    joined, meta_download = downloaded_state(tmp_path / "second")
    assert meta_download["fragment_rounds"] == first["fragment_rounds"]
    assert_same_bits(final_tensors, joined)
    _, second = final_state(tmp_path / "second")
    # it went on from the first peer's last round, not from round 0 ...
    assert second["outer_round"] >= first["outer_round"] + 1
    # ... and its first round's loss is near the leaver's last, far from the run's start (~5)
    start, last = first["history"][0]["loss"], first["history"][-1]["loss"]
    loss = second["history"][0]["loss"]
    assert abs(loss - last) < abs(loss - start), (start, last, loss)


def final_state_round(ckpt) -> int:
    return final_state(ckpt)[1]["outer_round"] if list_checkpoints(ckpt) else 0


@pytest.mark.timeout(240)
def test_a_joiner_without_holder_or_keeper_says_so_loudly(tmp_path):
    path, run_id = write_manifest(tmp_path, grid=(1, 2))
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(path)])
        swarm.start_peer("left", peer_args(run_id, tmp_path / "left", "--path", "0", "--max_rounds", "1000"))
        wait_for(lambda: len(states_by_round(tmp_path / "left")) >= 1, 90, "a round", swarm)
        # path 1 shares the trunk with path 0, but its own module has never been trained: fine
        swarm.start_peer("other", peer_args(run_id, tmp_path / "other", "--path", "1", "--max_steps", "10"))
        assert swarm.wait("other", timeout=120) == 0
        assert "starts again from its initial weights" not in swarm.log_path("other").read_text()
        swarm.kill("left", signal.SIGKILL)
        time.sleep(1)
        # path 0's module l0m0 was trained by "left" only, which is gone: a new holder must say so
        swarm.start_peer("new", peer_args(run_id, tmp_path / "new", "--path", "0", "--max_steps", "10"))
        assert swarm.wait("new", timeout=120) == 0
        log = swarm.log_path("new").read_text()
    assert "l0m0: its holders or keepers are at round" in log and "starts again from its initial" in log, log[
        -3000:
    ]


@pytest.mark.timeout(180)
def test_a_full_disk_does_not_stop_training_and_keeps_the_last_checkpoint(tmp_path):
    disk = tmp_path / "tiny"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        path, run_id = write_manifest(tmp_path, grid=(1, 1))
        with LocalSwarm(tmp_path / "logs") as swarm:
            args = ["peer", "--host_maddrs", "/ip4/127.0.0.1/tcp/0", *peer_args(run_id, disk / "ckpt"),
                    "--new_swarm", "--manifest_path", str(path), "--max_rounds", "6"]  # fmt: skip
            # leave room for one checkpoint (~0.2 MB) and its safety margin, not for a second one
            with open(disk / "filler", "wb") as f:
                try:
                    while shutil.disk_usage(disk).free > SPACE_MARGIN_BYTES + 320 * 1024:
                        f.write(b"\0" * 4096)
                        f.flush()
                except OSError:
                    pass
            swarm.spawn("p", args)
            assert swarm.wait("p", timeout=120) == 0, logs_of(swarm, "p")
            log = swarm.log_path("p").read_text()
        assert "checkpoint failed, training goes on" in log and "not enough disk space" in log
        assert "round 6 step" in log
        tensors, meta = final_state(disk / "ckpt")  # the last good checkpoint is intact
        assert meta["outer_round"] >= 1 and shared_state(tensors)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.timeout(240)
def test_a_flood_of_forged_claims_neither_stops_averaging_nor_poisons_a_joiner(tmp_path):
    path, run_id = write_manifest(tmp_path, grid=(1, 1), averaging_timeout_seconds=TIMEOUT)
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(path)])
        for name in ("a", "b"):
            swarm.start_peer(
                name, peer_args(run_id, tmp_path / name, "--max_rounds", "1000", "--wait_for_peers", "2")
            )
        wait_for(lambda: len(states_by_round(tmp_path / "a")) >= 2, 90, "two rounds", swarm)
        # Sybils: real keys of their own, each claiming to hold the module far ahead of everyone
        sybils, sybil_ids = [], set()
        try:
            for _ in range(6):
                dht, key = start_dht(initial_peers=swarm.initial_peers, run_name=RUN, run_id=run_id)
                sybils.append(dht)
                sybil_ids.add(peer_id_of_key(key))
                claim = ClaimRecord(
                    peer_id=peer_id_of_key(key), path=0, modules=["trunk", "l0m0"], outer_round=10**9,
                    module_rounds={"trunk": [10**9], "l0m0": [10**9]}, digests={"trunk": "0" * 64},
                )  # fmt: skip
                # an attacker retries: a node just started may find no node to store on at once
                assert any(
                    publish_claim(dht, key, RUN, run_id, claim, ttl=60) or time.sleep(1.0) for _ in range(5)
                )
            watcher = sybils[0]
            wait_for(lambda: len(live_claims(watcher, RUN, run_id, 1)) >= 8, 30, "the forged claims")
            swarm.start_peer("joiner", peer_args(run_id, tmp_path / "joiner", "--max_steps", "30"))
            assert swarm.wait("joiner", timeout=150) == 0, logs_of(swarm, "joiner")
        finally:
            for dht in sybils:
                dht.shutdown()
        swarm.kill("a", signal.SIGTERM)
        swarm.kill("b", signal.SIGTERM)
        log = swarm.log_path("joiner").read_text()
    assert "caught up to module round" in log and "from its holders" in log, log[-3000:]
    _, meta = final_state(tmp_path / "joiner")
    assert meta["outer_round"] < 10**6  # it took a real holder's state, not a Sybil's round
    # it averaged with real holders, and no Sybil ever counted in one of its groups
    averaged = [o for entry in outcomes(meta) for o in entry.values() if o.startswith("averaged/")]
    assert averaged and all(int(o.split("/")[1]) >= 2 for o in averaged), outcomes(meta)
    members = {m for entry in meta["history"] for group in entry["groups"].values() for m in group}
    assert members and not members & sybil_ids, members


FAKETIME = [
    p
    for p in (
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    )
    if os.path.exists(p)
]


def _skewed(offset: str) -> dict[str, str]:
    # monotonic clocks shift by the same offset (libfaketime's default): with it turned off,
    # CPython's absolute-deadline sleeps fail with EINVAL
    return {"LD_PRELOAD": FAKETIME[0], "FAKETIME": offset}


@pytest.mark.timeout(240)
@pytest.mark.skipif(not FAKETIME, reason="libfaketime is not installed (Debian package faketime)")
def test_clocks_apart_within_the_dht_limit_still_average_and_beyond_it_are_refused_clearly(tmp_path):
    """hivemind's DHT refuses a node more than MAX_DHT_TIME_DISCREPANCY_SECONDS (3 s) off its
    bootstrap peer, so a skewed peer cannot hide behind expired claims: it is told to fix its clock.
    Within that limit, skewed peers must average as if their clocks agreed."""
    path, run_id = write_manifest(tmp_path, grid=(1, 1))
    skews = {"now": None, "ahead": "+2.5s", "behind": "-2.5s"}
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(path)])
        for name, skew in skews.items():
            args = peer_args(run_id, tmp_path / name, "--max_rounds", "4", "--wait_for_peers", "3")
            # unpaced: libfaketime shifts the clock a timed wait's deadline is read from, not the
            # kernel's, so a paced step of a peer 2.5 s ahead would wait 2.5 s
            args += ["--max_inner_steps_per_second", "1e9"]
            swarm.start_peer(name, args, env=_skewed(skew) if skew else None)
        far = peer_args(run_id, tmp_path / "far", "--max_rounds", "4")
        swarm.start_peer("far", far, env=_skewed("+15s"))
        assert swarm.wait("far", timeout=60) != 0
        for name in skews:
            assert swarm.wait(name, timeout=150) == 0, logs_of(swarm, name)
        refusal = swarm.log_path("far").read_text()
    # the measured offset includes the delay of the measurement itself (more on a loaded machine)
    offset = re.search(r"clock is \+([\d.]+) s off", refusal)
    assert offset and 13.0 <= float(offset.group(1)) <= 17.0, refusal[-2000:]
    assert "synchronise the clock" in refusal, refusal[-2000:]
    states = [final_state(tmp_path / n) for n in skews]
    for _, meta in states:
        assert "averaged/3" in outcomes(meta)[-1].values(), outcomes(meta)
    assert_same_bits(*(t for t, _ in states))
