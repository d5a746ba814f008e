"""The flood half of `benchmarks.claims_scale`: a live small run's training while thousands of fresh
keys publish claims into its shard.

A real run: `pathswarm bootstrap` serving an invite run's manifest (a 1x1 grid on the built-in
corpus, benchmarks/local_runs.py) and two admitted `pathswarm peer`s training it at the default
heartbeat. The peers' tokens/s in a window come from their own round histories (their checkpoints'
tokens at each round's end); a watcher node reads the run's claims every `POLL_SECONDS` meanwhile.
After a window of training alone, two client-mode publishers (started before it, at the machine's
lowest CPU priority: `_attacker_in_background`) store one claim
for each of `--flood_keys` fresh 1024-bit keys (the cheapest key hivemind accepts for a subkey)
over a window as long, into the run's storage nodes — the bootstrap node and the peers' own — with
every cap of a run, and the run trains alone for a window as long again. `run_tokens_ratio` is the
peers' tokens/s in the flood window over the window before; `run_tokens_ratio_both_ends` over the mean
of the windows before and after it (the run's own rate drifts from minute to minute);
`honest_seen_during_flood` is the share of the watcher's reads in
the flood window that still saw both admitted peers.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from functools import partial
from pathlib import Path

import psutil
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.claims_flood import flooder
from benchmarks.claims_scale_store import realistic_claim, store_batch
from benchmarks.goodput import histories, tokens_at
from benchmarks.local_runs import make_manifest, peer_argv
from benchmarks.wan.netlab import CPU_CGROUP_ROOT, can_limit_threads, remove_cpu_cgroup
from dht.identity import load_identity, peer_id_of_key
from dht.keys import CLAIM_TTL_SECONDS, claim_shard, claims_key
from dht.node import start_dht
from peer.cli.local_swarm import LocalSwarm
from peer.config import AdmissionConfig
from peer.run.admission import AdmissionCheck, run_validator, sign_admission
from peer.run.record import save_record, sign_manifest
from peer.swarm.claims import live_claims

#: the watcher's reads (it only checks that the admitted peers stay visible: tokens/s come from the
#: peers' round histories), at a peer's heartbeat so that it loads the run's nodes like one more peer
POLL_SECONDS = 5.0
PEERS = ("p0", "p1")


def _run_args(args: argparse.Namespace) -> argparse.Namespace:
    """A run long enough to outlast both windows (the peers are stopped after them)."""
    return argparse.Namespace(
        rounds=10_000, inner_steps=args.run_inner_steps, d_model=64, batch_size=8, builtin_docs=1500
    )


def _cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds (user + system) used so far by the processes `pids` and all their descendants
    (a peer's DHT process and p2p daemon are its children)."""
    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.Error:  # a process that already left has nothing more to count
            continue
    return total


def _cpu_snapshot(groups: dict[str, list[int]]) -> dict[str, float]:
    """Now (monotonic seconds, "at") and each group's `_cpu_seconds` so far."""
    return {"at": time.monotonic(), **{g: _cpu_seconds(pids) for g, pids in groups.items()}}


@contextmanager
def _attacker_in_background(pids: Iterable[int]) -> Iterator[str]:
    """Puts the processes `pids` and their descendants (a publisher's p2p daemon), every thread, at
    the machine's lowest CPU priority while inside; yields how. On one machine the attacker's CPU is
    taken from the run's, where a real attacker spends its own; so the publishers run on what the
    run leaves idle (their cores are still measured). A nice value does not do it: the kernel
    schedules sessions (autogroups) fairly whatever their members' nice, and the run's peers each
    have their own; a cgroup v1 `cpu` group with the least weight does (as root)."""
    threads = [
        t.id
        for pid in pids
        for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        for t in proc.threads()
    ]
    if not can_limit_threads():
        for tid in threads:  # Linux keeps a nice value per thread
            with suppress(ProcessLookupError):  # a thread that ended since it was listed
                os.setpriority(os.PRIO_PROCESS, tid, 19)
        yield "nice 19 (no cgroup v1 cpu controller here, or not root: the kernel's autogroups may undo it)"
        return
    group = CPU_CGROUP_ROOT / f"psw-flood-{os.getpid()}"
    group.mkdir(exist_ok=True)
    try:
        (group / "cpu.shares").write_text("2")  # the least weight; a nice-0 session has 1024
        for tid in threads:  # threads started later inherit the group of the thread that starts them
            with suppress(OSError):  # a thread that ended since it was listed
                (group / "tasks").write_text(str(tid))
        yield "cpu cgroup with cpu.shares 2"
    finally:
        remove_cpu_cgroup(group)


def _cores(start: dict, end: dict, groups: Iterable[str]) -> dict[str, float]:
    """Cores each group used on average between two `_cpu_seconds` snapshots."""
    return {g: round((end[g] - start[g]) / (end["at"] - start["at"]), 2) for g in groups}


def _tokens_per_second(samples: list[tuple[float, int]], start: float, end: float) -> float:
    inside = [(t, n) for t, n in samples if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return 0.0
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def _rate(found: list[list[dict]], start: float, end: float) -> float:
    """The peers' tokens/s together between two wall times, from their round histories."""
    return sum(tokens_at(h, end) - tokens_at(h, start) for h in found) / (end - start)


def _start_run(
    swarm: LocalSwarm, folder: Path, creator: RSAPrivateKey, run: str, run_id: str, run_args, heartbeat: float
) -> list[str]:
    """The run's bootstrap node (serving its manifest) and its `PEERS`, each admitted by the creator;
    their peer ids."""
    swarm.start_bootstrap(extra=["--manifest_path", str(folder / "manifest.json")])
    ids = []
    for name in PEERS:
        key, key_file = load_identity(folder / f"{name}.key")
        ids.append(peer_id_of_key(key))
        token = sign_admission(creator, run_id, ids[-1], "invite")
        extra = ["--identity_path", str(key_file), "--admission", token, "--wait_for_peers", "2",
                 "--heartbeat_seconds", str(heartbeat)]  # fmt: skip
        swarm.start_peer(name, peer_argv(run_args, run, folder / name, *extra))
    return ids


def measure_flood(
    args: argparse.Namespace, folder: Path, flood_keys: list[RSAPrivateKey], mode: str = "invite"
) -> dict:
    """The flood into a run whose manifest admits keys by `mode` (its two peers admitted either way:
    in an open run the flood's keys are newcomers on probation, in an invite run strangers)."""
    creator, run_args = RSAPrivateKey(), _run_args(args)
    manifest = make_manifest(run_args, "claimsflood", admission=AdmissionConfig(mode=mode))
    record = sign_manifest(manifest, creator)
    folder.mkdir(parents=True, exist_ok=True)
    save_record(record, folder / "manifest.json")
    run, run_id = f"{manifest.name}@{record.run_id[:16]}", record.run_id
    samples: list[tuple[float, int]] = []
    seen_both: list[tuple[float, bool]] = []
    with LocalSwarm(folder / "logs") as swarm, ExitStack() as background:
        ids = _start_run(swarm, folder, creator, run, run_id, run_args, args.heartbeat_seconds)
        watcher, _ = start_dht(
            initial_peers=swarm.initial_peers, client_mode=True, run_name=manifest.name, run_id=run_id
        )
        publishers = []
        try:
            watcher.add_validators([run_validator(record, manifest.name)])
            check = AdmissionCheck.of(record)

            def poll() -> None:
                if samples and time.monotonic() - samples[-1][0] < POLL_SECONDS:
                    return  # the same load on the run's nodes in every window
                claims = live_claims(watcher, manifest.name, run_id, manifest.model.n_paths, check.admitted)
                now = time.monotonic()
                samples.append((now, sum(claims[p].tokens_total for p in ids if p in claims)))
                seen_both.append((now, all(p in claims for p in ids)))

            def sleep_polling(seconds: float) -> None:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    poll()
                    time.sleep(max(0.0, min(POLL_SECONDS, end - time.monotonic())))

            deadline = time.monotonic() + args.run_start_timeout_seconds
            while not (samples and samples[-1][1] > 0 and seen_both[-1][1]):
                if time.monotonic() > deadline or not all(swarm.alive(n) for n in PEERS):
                    raise RuntimeError(f"the run did not start training; logs in {folder / 'logs'}")
                sleep_polling(POLL_SECONDS)
            # the publishers start (and idle) before the window the flood is compared with
            schema = run_validator(record, manifest.name)
            publishers = [
                flooder(flood_keys, schema, swarm.initial_peers, client_mode=True) for _ in range(2)
            ]
            attacker_priority = background.enter_context(_attacker_in_background([n.pid for n in publishers]))
            claims = _flood_claims(flood_keys, manifest, run_id)
            sleep_polling(args.warmup_seconds)
            # who used the machine's CPU in each window: the run's own processes (its peers with their
            # DHT processes and daemons, the bootstrap) and the flood's publishers; on one machine the
            # flood's CPU is taken from the run's, where a real attacker spends its own
            groups = {"run": [p.pid for p in swarm.procs.values()], "flood": [n.pid for n in publishers]}
            cpu = [_cpu_snapshot(groups)]
            before = (time.monotonic(), time.monotonic() + args.flood_window_seconds)
            walls = [time.time()]
            sleep_polling(args.flood_window_seconds)
            cpu.append(_cpu_snapshot(groups))
            flood = (time.monotonic(), time.monotonic() + args.flood_window_seconds)
            walls += [time.time(), time.time() + args.flood_window_seconds]
            stored = _flood(publishers, claims, args.flood_window_seconds, poll)
            sleep_polling(max(0.0, flood[1] - time.monotonic()))
            cpu.append(_cpu_snapshot(groups))
            # the run alone again, as long: a drift of the run's own rate shows in before against after
            after = (time.monotonic(), time.monotonic() + args.flood_window_seconds)
            walls.append(time.time() + args.flood_window_seconds)
            sleep_polling(args.flood_window_seconds)
            alive = all(swarm.alive(n) for n in PEERS)
        finally:
            for node in publishers:
                node.shutdown()
            watcher.shutdown()
    rates, measured_by = _window_rates(folder, walls, samples, [before, flood, after])
    during = [both for t, both in seen_both if flood[0] <= t <= flood[1]]
    return {
        "keys": len(flood_keys), "stores_acknowledged": stored, "window_seconds": args.flood_window_seconds,
        **_rates_summary(*rates),
        "honest_seen_during_flood": round(sum(during) / len(during), 3) if during else None,
        "peers_alive_after": alive, "run": run, "admission": mode, "tokens_measured_by": measured_by,
        "run_inner_steps": run_args.inner_steps, "attacker_priority": attacker_priority,
        # cores used on average in each window, by the run's processes and by the flood's publishers
        "cores_before": _cores(cpu[0], cpu[1], groups), "cores_during": _cores(cpu[1], cpu[2], groups),
        "machine_cores": psutil.cpu_count(),
    }  # fmt: skip


def _window_rates(
    folder: Path, walls: list[float], samples: list[tuple[float, int]], windows: list[tuple[float, float]]
) -> tuple[list[float], str]:
    """The peers' tokens/s in each window and where they come from: their own round histories (tokens
    at each round's end, written at their exit; `walls`: the windows' wall-clock edges), else the
    watcher's readings of their claims' counters (`windows`: monotonic start and end of each)."""
    try:
        found = [h for h, _ in histories(folder, list(PEERS)).values()]
        return [_rate(found, a, b) for a, b in zip(walls, walls[1:], strict=False)], "round history"
    except (RuntimeError, ValueError, KeyError):  # too few rounds in a window: the claims' counters
        return [_tokens_per_second(samples, *w) for w in windows], "claims"


def _rates_summary(before: float, during: float, after: float) -> dict:
    """The run's tokens/s in the three windows, and the flood window's over the one before (the
    issue's measure) and over the mean of before and after (baselines at both ends)."""
    return {
        "tokens_per_second_before": round(before, 1), "tokens_per_second_during": round(during, 1),
        "tokens_per_second_after": round(after, 1),
        "run_tokens_ratio": round(during / before, 3) if before else None,
        "run_tokens_ratio_both_ends": round(2 * during / (before + after), 3) if before + after else None,
    }  # fmt: skip


def _flood_claims(keys: list[RSAPrivateKey], manifest, run_id: str) -> list[tuple]:
    """One claim per key, as (DHT key, owner subkey, value): built before the windows, since on one
    machine the attacker's own work of making them would be taken from the run's CPU."""
    rng, key = random.Random(1), claims_key(manifest.name, run_id, claim_shard(0))
    return [
        (key, RSASignatureValidator(k).local_public_key, realistic_claim(k, "", manifest.model, 0, rng))
        for k in keys
    ]


def _flood(publishers, claims: list[tuple], window: float, poll) -> int:
    """The claims stored, paced evenly over `window` seconds, the watcher polling in between."""
    started, pending = time.monotonic(), []
    per_second = math.ceil(len(claims) / max(1.0, window))
    for i in range(0, len(claims), per_second):
        expiry = get_dht_time() + CLAIM_TTL_SECONDS
        items = [(key, subkey, value, expiry) for key, subkey, value in claims[i : i + per_second]]
        publisher = publishers[(i // per_second) % len(publishers)]
        pending.append(publisher.run_coroutine(partial(store_batch, items), return_future=True))
        poll()
        time.sleep(max(0.0, started + (i // per_second + 1) - time.monotonic()))
    return sum(f.result() for f in pending)
