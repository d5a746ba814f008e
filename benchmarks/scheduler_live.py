"""Does the scheduler pay in a running swarm? `python -m benchmarks.scheduler_live --out DIR` (root).

A two-region WAN in network namespaces (benchmarks/scheduler_live_lab.py): `--peers` peers, half
per region, `--fast_mbit` links inside a region and `--slow_mbit` between them; each peer's training
thread gets its own CPU quota (`--cores`, netlab's cgroups), so peers differ in speed; a 1x2 grid
(two paths), so there are more peers than paths and each path's holders average together. Three
arms, one after the other on the same lab, identities, manifest seed and data:

* `claims_only`: scheduler mode `least_covered` (a peer claims the least-covered path);
* `plan_at_join`: mode `planned`, the plan places the peers once when they start;
* `plan_online`: mode `planned` with `replan_online`: the peers also re-plan at round ends after a
  join, a leave or a new probe, and move when the predicted gain beats the move's cost.

At `--change_at` of each arm, one peer of each region trades regions (their routes change in the lab
and the probe file says so): a plan made at join now has a slow link inside each group. Reported per
arm, on a clock that starts once every peer trains: `seconds_to_target_loss` (the peers' mean
training loss of their last rounds, on their own routed batches, reaching the target:
`--target_loss`, else the highest of the arms' lowest losses), `tokens_per_second` (per peer),
`moves` (path changes after training started), `cross_region_group_fraction`, and the round time
the cost model predicts against the measured one: over every round of the arm, each priced on the
assignment and links of its time (`predicted_over_measured_round_seconds`, plan_online's, the
headline), before the change, and after the last move (final assignment). Writes
DIR/scheduler_live.json, .md and .png. `--smoke`: 4 peers, 30 s arms (checks the machinery only).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks import scheduler_live_report as rep
from benchmarks.scheduler_live_lab import Regions
from benchmarks.wan.driver import REPO, _raise_interrupt, child_env, start_bootstrap
from benchmarks.wan.netlab import NetLab, can_limit_threads, can_make_namespaces
from dht.schema import ClaimRecord, ProbeRecord
from peer.checkpoint import load_latest_checkpoint
from peer.config import InnerOptimizerConfig, RunManifest, SyncConfig
from peer.config.manifest import SchedulerConfig
from peer.data.sources import DatasetSpec
from peer.model.grid import ModelConfig, all_paths, path_from_index, path_index, path_module_ids
from peer.model.transformer import PathModel
from peer.run.create import build_manifest
from peer.run.record import save_record, sign_manifest
from peer.scheduler import Assignment, round_cost
from peer.swarm.planning import build_snapshot, path_parameters
from peer.swarm.probes import measure_tokens_per_second

#: seconds every peer of an arm gets to reach its first inner step
START_TIMEOUT_SECONDS = 240

ARMS = {
    "claims_only": dict(mode="least_covered", replan_online=False),
    "plan_at_join": dict(mode="planned", replan_online=False),
    "plan_online": dict(mode="planned", replan_online=True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scheduler_live", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--peers", type=int, default=6, help="even: half per region")
    # quotas summing to about one core: on a shared two-core machine the quota, not the contention,
    # should set each peer's speed (the probe file's speeds are the quotas)
    p.add_argument("--cores", default="0.25,0.15,0.1", help="training-thread CPU quotas, repeated over peers")
    # 3 arms x (170 s + about 90 s of start-up and 30 s of shutdown): under 15 minutes
    p.add_argument("--arm_seconds", type=float, default=170.0, help="training seconds per arm")
    p.add_argument("--change_at", type=float, default=0.3, help="fraction of an arm when regions change")
    p.add_argument("--fast_mbit", type=float, default=200.0)
    p.add_argument("--slow_mbit", type=float, default=1.5)
    p.add_argument("--latency_ms", type=float, default=2.0, help="told to the planner inside a region")
    p.add_argument("--far_latency_ms", type=float, default=80.0, help="told to the planner across regions")
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--blocks_per_module", type=int, default=2)
    p.add_argument("--inner_steps", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target_loss", type=float, default=None)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--smoke", action="store_true", help="4 peers, 30 s arms: checks the machinery only")
    args = p.parse_args(argv)
    if args.smoke:
        args.peers, args.cores = 4, "0.3,0.15"
        args.arm_seconds = 30.0 if args.arm_seconds == p.get_default("arm_seconds") else args.arm_seconds
    if args.peers < 2 or args.peers % 2:
        p.error("--peers: an even number of at least 2 (half per region)")
    cores = [float(c) for c in args.cores.split(",")]
    if not cores or any(not 0.01 <= c <= 8 for c in cores):
        p.error("--cores: comma-separated quotas between 0.01 and 8")
    args.cores = [cores[i % len(cores)] for i in range(args.peers)]
    args.arms = [a for a in args.arms.split(",") if a]
    if unknown := [a for a in args.arms if a not in ARMS]:
        p.error(f"--arms: unknown {', '.join(unknown)} (known: {', '.join(ARMS)})")
    if not 0 < args.change_at < 1:
        p.error("--change_at: a fraction in (0, 1)")
    return args


def make_manifest(args) -> RunManifest:
    d = args.d_model
    model = ModelConfig(d_model=d, n_heads=4, d_ff=4 * d, max_seq_len=args.seq_len + 1, n_levels=1,
                        modules_per_level=2, blocks_per_module=args.blocks_per_module)  # fmt: skip
    data = DatasetSpec(kind="builtin", builtin_docs=600)
    return build_manifest(
        "sched_live", model, data, seed=args.seed, seq_len=args.seq_len,
        inner=InnerOptimizerConfig(lr=2e-3, warmup_steps=4, total_steps=2000),
        sync=SyncConfig(inner_steps=args.inner_steps, averaging_timeout_seconds=60.0),
        router_docs=200,
    )  # fmt: skip


def arm_manifest(base: RunManifest, arm: str) -> RunManifest:
    # probes every 3 s: a region change reaches the peers within a round or two
    scheduler = SchedulerConfig(probe_every_seconds=3.0, **ARMS[arm])
    return RunManifest.model_validate({**base.model_dump(), "scheduler": scheduler.model_dump()})


def run_arm(args, lab: NetLab, regions: Regions, arm: str, base: RunManifest, folder: Path) -> dict:
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    manifest = arm_manifest(base, arm)
    record = sign_manifest(manifest, RSAPrivateKey())
    save_record(record, folder / "manifest.json")
    regions.region = [0] * (args.peers // 2) + [1] * (args.peers // 2)
    regions.changes = []
    regions.shape()
    regions.write_probe_file()
    hub, hosts = lab.hosts[0], lab.hosts[1:]
    bootstrap, initial = start_bootstrap(lab, hub, folder / "manifest.json", folder / "logs/bootstrap.log")
    t0, procs = time.time(), []
    for i, host in enumerate(hosts):
        argv = [sys.executable, "-m", "peer", "peer", "--run", f"{manifest.name}@{record.run_id[:16]}",
                "--manifest_path", str(folder / "manifest.json"), "--initial_peers", *initial,
                "--host_maddrs", host.maddr(), "--identity_path", str(args.out / f"id{i}"),
                "--probe_file", str(regions.probe_file), "--batch_size", str(args.batch_size),
                "--checkpoint_dir", str(folder / f"peer{i}"), "--checkpoint_every_rounds", "1000000",
                "--torch_threads", "1", "--heartbeat_seconds", "1",
                "--wait_for_peers", str(args.peers)]  # fmt: skip
        procs.append(lab.spawn(host, argv, folder / f"logs/peer{i}.log", child_env(), cwd=REPO))
    limited: set[int] = set()
    started = changed_at = None  # when the last peer took its first step; when the regions changed
    try:
        # the arm's clock starts once every peer trains: start-up (imports, manifest, claims, the plan)
        # varies by a minute on a shared machine and is not what the arms differ in
        while started is None or time.time() < started + args.arm_seconds:
            if started is None and time.time() > t0 + START_TIMEOUT_SECONDS:
                raise RuntimeError(f"{arm}: not every peer trained after {START_TIMEOUT_SECONDS} s")
            for i, proc in enumerate(procs):
                if proc.poll() is not None:
                    raise RuntimeError(f"{arm}: peer{i} exited early:\n{_tail(folder / f'logs/peer{i}.log')}")
                # the quota plays the peer's accelerator: from its first training step on
                if i not in limited and "first inner step" in (folder / f"logs/peer{i}.log").read_text():
                    if can_limit_threads():
                        lab.limit_thread_cpu(hosts[i], proc.pid, args.cores[i])
                    limited.add(i)
            if started is None and len(limited) == len(procs):
                started = time.time()
            if changed_at is None and started and time.time() >= started + args.change_at * args.arm_seconds:
                a, b = args.peers // 2 - 1, args.peers - 1  # the last peer of each region
                regions.swap(a, b)
                changed_at = time.time()
            time.sleep(0.5)
    finally:
        # the final checkpoint is written on SIGTERM; a peer held to a quarter core took over 30 s to
        # leave in the first full run (its last step, then the round in flight)
        lab.stop(procs, grace_seconds=120)
        lab.stop([bootstrap], grace_seconds=5)
    (folder / "arm.json").write_text(
        json.dumps(
            dict(
                started=started,
                changed_at=changed_at,
                region_changes=regions.changes,
                peer_ids=regions.peer_ids,
            )
        )  # fmt: skip
    )
    return measure(args, regions, manifest, folder, started, changed_at)


def _tail(path: Path, n: int = 15) -> str:
    return "\n".join(path.read_text().splitlines()[-n:])


def measure(args, regions: Regions, manifest: RunManifest, folder: Path, t0: float, changed_at) -> dict:
    histories, paths, logs = [], {}, []
    for i in range(args.peers):
        loaded = load_latest_checkpoint(folder / f"peer{i}")
        if loaded is None:
            raise RuntimeError(f"peer{i} left no checkpoint:\n{_tail(folder / f'logs/peer{i}.log')}")
        meta = loaded[1]
        histories.append(meta.get("history", []))
        logs.append((folder / f"logs/peer{i}.log").read_text())
        # the log's last path: a move under way when the arm ended is not in the final checkpoint
        trained = rep.TRAINING.findall(logs[-1])
        paths[regions.peer_ids[i]] = int(trained[-1]) if trained else int(meta["path"][0])
    predict = Predictor(args, regions, manifest)
    # the cost model on the final assignment and the final regions: what the planner predicts now
    predicted = predict(paths, tuple(regions.region))
    # ... and on every round the peers ran, the assignment and the links of its time
    by_modules = {frozenset(path_module_ids(manifest.model, p)): path_index(manifest.model, p)
                  for p in all_paths(manifest.model)}  # fmt: skip
    per_round = rep.round_predictions(
        histories, regions.peer_ids, lambda e: by_modules[frozenset(e["groups"])], regions, predict,
        t0, changed_at,
    )  # fmt: skip
    moves = sum(len(rep.MOVE.findall(text)) for text in logs)
    settled = max([changed_at or t0] + [_last_move_time(h) for h in histories])
    return dict(
        curve=rep.loss_curve(histories, t0),
        moves=moves,
        rounds=sum(len(h) for h in histories) / len(histories),
        tokens_per_second=rep.tokens_per_second(histories),
        cross_region_group_fraction=rep.cross_region_fraction(histories, regions),
        measured_round_seconds=rep.round_seconds(histories, settled),
        predicted_round_seconds=predicted,
        round_predictions=per_round,
        predicted_over_measured=per_round["whole"]["predicted_over_measured"],
        predicted_over_measured_before_change=per_round["before_change"]["predicted_over_measured"],
        logged_predicted_round_seconds=rep.logged_predictions(logs),
        final_paths=paths,
        change_at_seconds=None if changed_at is None else changed_at - t0,
    )


class Predictor:
    """The planner's round time (`peer.scheduler.round_cost` on a snapshot built as the peers build
    theirs) for an assignment under the regions of a moment, cached per (assignment, regions)."""

    def __init__(self, args, regions: Regions, manifest: RunManifest):
        self.args, self.regions, self.manifest = args, regions, manifest
        self.n_parameters = path_parameters(manifest)
        self.cache: dict[tuple, float] = {}

    def __call__(self, paths: dict[str, int], region: tuple[int, ...]) -> float:
        key = (tuple(sorted(paths.items())), region)
        if key not in self.cache:
            ids, cfg, lab = self.regions.peer_ids, self.manifest.model, self.regions
            probes = {p: ProbeRecord(peer_id=p, tokens_per_second=lab.tokens_per_second[i],
                                     memory_bytes=1 << 34,
                                     links={q: lab.link(i, j, region) for j, q in enumerate(ids) if j != i})
                      for i, p in enumerate(ids)}  # fmt: skip
            claims = {p: ClaimRecord(peer_id=p, path=k, modules=path_module_ids(cfg, path_from_index(cfg, k)))
                      for p, k in paths.items()}  # fmt: skip
            snapshot = build_snapshot(self.manifest, probes, claims, self.n_parameters, self.args.batch_size)
            self.cache[key] = round_cost(Assignment(paths, cfg.n_paths), snapshot).round_seconds
        return self.cache[key]


def _last_move_time(history: list[dict]) -> float:
    """When a peer's path last changed (its groups' modules changed), else 0."""
    last, seen = 0.0, None
    for e in history:
        modules = sorted(e.get("groups", {}))
        if seen is not None and modules != seen:
            last = e["time"]
        seen = modules
    return last


def summarise(args, results: dict[str, dict]) -> tuple[dict, dict]:
    curves = {a: r.pop("curve") for a, r in results.items()}
    lows = [min(v for _, v in c) for c in curves.values() if c]
    target = args.target_loss if args.target_loss is not None else (max(lows) if lows else float("nan"))
    for arm, r in results.items():
        r["seconds_to_target_loss"] = rep.seconds_to(curves[arm], target)
        r["final_loss"] = curves[arm][-1][1] if curves[arm] else None
    online = results.get("plan_online", {})
    windows = online.get("round_predictions", {})
    after_move = None
    if online.get("measured_round_seconds"):
        after_move = online["predicted_round_seconds"] / online["measured_round_seconds"]
    speedup = None
    base, best = results.get("claims_only", {}), online
    if base.get("seconds_to_target_loss") and best.get("seconds_to_target_loss"):
        speedup = base["seconds_to_target_loss"] / best["seconds_to_target_loss"]
    report = dict(
        command="python -m benchmarks.scheduler_live " + " ".join(sys.argv[1:]),
        settings={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        target_loss=target,
        change_at_seconds=next((r["change_at_seconds"] for r in results.values()), None),
        arms=results,
        # the cost model against every round of plan_online's arm; the steady window beside it
        predicted_over_measured_round_seconds=windows.get("whole", {}).get("predicted_over_measured"),
        predicted_over_measured_before_change=windows.get("before_change", {}).get("predicted_over_measured"),
        predicted_over_measured_after_last_move=after_move,
        plan_online_speedup_over_claims_only=speedup,
    )
    return report, curves


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # the lab's namespaces and processes go on any exit
    ok, why = can_make_namespaces(install=True)
    if not ok:
        print(f"benchmarks.scheduler_live: cannot build the lab: {why}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    base = make_manifest(args)
    ids = []
    for i in range(args.peers):
        P2P.generate_identity(str(args.out / f"id{i}"))
        ids.append(PeerID.from_identity((args.out / f"id{i}").read_bytes()).to_base58())
    import torch

    torch.set_num_threads(1)
    model = PathModel(base.model, (0,), base.seed)
    one_core = measure_tokens_per_second(model, args.batch_size, args.seq_len, torch.device("cpu"), steps=5)
    args.one_core_tokens_per_second = one_core  # the probe file's speeds: this times each peer's quota
    results = {}
    with NetLab(args.peers + 1) as lab:
        regions = Regions(lab, lab.hosts[1:], [0] * args.peers, args, args.out / "probes.json")
        regions.peer_ids = ids
        regions.tokens_per_second = [one_core * c for c in args.cores]
        for arm in args.arms:
            print(f"{arm} ...", flush=True)
            results[arm] = run_arm(args, lab, regions, arm, base, args.out / arm)
    report, curves = summarise(args, results)
    print(rep.write_outputs(args.out, report, curves))
    return 0


if __name__ == "__main__":
    sys.exit(main())
