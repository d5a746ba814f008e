"""Goodput: how much of the time volunteers give trains, measured: `python -m benchmarks.goodput --out DIR`.

Real peer processes on loopback, a 2x2 grid (four paths) on the built-in corpus, both arms with
overlapped rounds (`--overlap_steps`, τ = 10 by default: a round's result is applied τ steps after its
due step, Streaming DiLoCo's overlap); `--overlap_steps 0` measures blocking rounds.

`rotation`: 3 peers with rotation on (fewer peers than paths), `--rounds` outer rounds each, and a
`pathswarm monitor` polled beside them. `train_fraction` is the summed seconds spent inside inner steps
over the summed training-loop seconds of every peer (what is not an inner step is waiting: on a round,
a rotation, a checkpoint); `tokens_per_second` is measured from the peers' own round histories (the
tokens each had trained at each round's end, over the window where all of them were training);
`monitor_tokens_per_second` is the mean of what the monitor's status showed over that same window.
`max_round_gap_seconds`: the longest time between two consecutive rounds of one peer. `moves`: the
rotations the peers made (their "rotating from path" lines), beside `train_fraction` because fewer
moves raise it (session 35 took a fraction bought by moves not made for a gain); `double_moves`: moves
onto a path another peer moved onto at the same round (peers whose claim views planned differently);
`extra_moves`: moves beyond the first at one round's end, onto any path (the rotation moves one peer).

`churn`: 4 peers, one per path, training for `--churn_seconds` from launch (then every peer is sent
SIGTERM: it checkpoints and leaves); every `--kill_every_seconds` a random peer (seeded) is SIGKILLed
(every second time, two at once) and restarted `--restart_after_seconds` later with `--resume`, until
10 s before the end. Against the same window without kills, run before and after it: `tokens_ratio`
(tokens in the peers' final checkpoints per second of the window: a kill's restart, the steps since
the last checkpoint and every wait it causes count against it), `eval_loss_ratio` (each peer's
global copy of its final path on held-out documents, averaged: what the same volunteer-seconds
bought; beside it the routed composite's, `composite_loss_ratio`: benchmarks/goodput_eval.py),
`rounds_split` (rounds whose reports' digests showed a member's copy differing from the
group's, repaired or merged: each such round once, however many members logged it) and
`modules_reset` (a module started again from initial weights). A window, not a number of rounds per
peer: with a fixed number of rounds each, the run lasted until the most-killed peer made up its
downtime while the others had finished, and that tail, not the swarm's rate, set the ratio.
Both arms' runs are made as `pathswarm run create` makes them, with the routing index of their
corpus (`--routing_index_documents`, 0: none, each peer routes for itself), which the peers fetch
from the bootstrap that serves the run folder. Writes DIR/goodput.json, DIR/goodput.md and DIR/goodput.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.goodput_eval import eval_composite, eval_paths, held_out, kill_over_clean  # noqa: E402
from benchmarks.goodput_logs import (  # noqa: E402
    MOVE_MARK,
    count_double_moves,
    count_extra_moves,
    count_splits,
    cpu_seconds,
    describe_starts,
    start_seconds,
)
from benchmarks.local_runs import RESET_MARK, count_marks, write_run  # noqa: E402
from peer.artifacts.store import ArtifactStore  # noqa: E402
from peer.checkpoint import load_latest_checkpoint  # noqa: E402
from peer.cli.local_swarm import LOOPBACK, LocalSwarm  # noqa: E402
from peer.config import InnerOptimizerConfig, RunManifest, SyncConfig  # noqa: E402
from peer.data.sources import DatasetSpec  # noqa: E402
from peer.model.grid import ModelConfig  # noqa: E402
from peer.run.create import build_manifest  # noqa: E402
from peer.run.options import RunChoices  # noqa: E402
from peer.run.routing_index import with_run_index  # noqa: E402
from peer.swarm.base_model import ARTIFACTS_SUBDIR  # noqa: E402
from peer.training.history import LOOP_PARTS  # noqa: E402

NAN = float("nan")
TARGETS = dict(train_fraction=0.9, monitor_error=0.15, tokens_ratio=0.85, eval_loss_ratio=1.05)


#: the churn arms, in the order they run: the clean baseline at both ends of the kill arm
ARMS = ("clean_start", "kill", "clean_end")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.goodput", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=24, help="outer rounds of each rotation peer")
    p.add_argument("--churn_seconds", type=float, default=120.0, help="how long each churn arm trains")
    p.add_argument(
        "--churn_rounds",
        type=int,
        default=100,
        help="the churn run's learning-rate schedule, in outer rounds",
    )
    p.add_argument("--inner_steps", type=int, default=50, help="H")
    p.add_argument(
        "--overlap_steps",
        type=int,
        default=10,
        help="τ of both arms' runs (peers may raise their own); 0: blocking rounds, each waited for at its "
        "due step (the manifest's default)",
    )
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--builtin_docs", type=int, default=1500)
    p.add_argument("--max_eval_docs", type=int, default=200)
    p.add_argument("--kill_every_seconds", type=float, default=15.0)
    p.add_argument("--restart_after_seconds", type=float, default=2.0)
    p.add_argument("--monitor_interval_seconds", type=float, default=2.0)
    p.add_argument("--run_timeout_seconds", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefetch_batches",
        type=int,
        default=None,
        help="the peers' --prefetch_batches (0: every batch made in the loop); unset: the peer's default",
    )
    p.add_argument(
        "--routing_index_documents",
        type=int,
        default=RunChoices.model_fields["routing_index_documents"].default,
        help="documents the runs' routing index covers (run create's flag); 0: none, each peer routes",
    )
    p.add_argument("--arms", nargs="+", default=["rotation", "churn"], choices=["rotation", "churn"])
    return p.parse_args(argv)


def make_run(args: argparse.Namespace, name: str, rounds: int, folder: Path) -> tuple[RunManifest, str]:
    """The run's manifest, its routing index in folder/artifacts as `run create` puts it, and the
    `--run NAME@PIN` to join it (`write_run`)."""
    store = ArtifactStore(folder / ARTIFACTS_SUBDIR)
    manifest = with_run_index(make_manifest(args, name, rounds), store, args.routing_index_documents)
    return manifest, write_run(manifest, folder)


def make_manifest(args: argparse.Namespace, name: str, rounds: int) -> RunManifest:
    return build_manifest(
        name,
        ModelConfig(
            d_model=args.d_model,
            n_heads=4,
            d_ff=4 * args.d_model,
            max_seq_len=64,
            n_levels=2,
            modules_per_level=2,
        ),  # fmt: skip
        DatasetSpec(kind="builtin", builtin_docs=args.builtin_docs),
        seq_len=32,
        inner=InnerOptimizerConfig(lr=3e-3, warmup_steps=20, total_steps=rounds * args.inner_steps),
        sync=SyncConfig(
            inner_steps=args.inner_steps, overlap_steps=args.overlap_steps, averaging_timeout_seconds=30.0
        ),
        router_docs=200,
        seed=args.seed,
    )


def peer_argv(args, run: str, folder: Path, rounds: int, *extra: str) -> list[str]:
    """A volunteer's command line: its key and checkpoints in its own folder (a restart is the same
    peer, as with the Docker image's /data volume)."""
    prefetch = [] if args.prefetch_batches is None else ["--prefetch_batches", str(args.prefetch_batches)]
    return ["--run", run, "--checkpoint_dir", str(folder), "--identity_path", f"{folder}.key",
            "--torch_threads", "1", "--batch_size", str(args.batch_size), "--heartbeat_seconds", "1",
            "--max_rounds", str(rounds), *prefetch, *extra]  # fmt: skip


def histories(folder: Path, names: list[str]) -> dict[str, tuple[list[dict], dict]]:
    out = {}
    for name in names:
        loaded = load_latest_checkpoint(folder / name)
        if loaded is None:
            raise RuntimeError(f"no checkpoint in {folder / name}")
        out[name] = (loaded[1]["history"], loaded[1])
    return out


def tokens_at(history: list[dict], t: float) -> float:
    """A peer's tokens trained by time t, linear between its round ends."""
    for a, b in zip(history, history[1:], strict=False):
        if a["time"] <= t <= b["time"]:
            return a["tokens_total"] + (b["tokens_total"] - a["tokens_total"]) * (t - a["time"]) / max(
                1e-9, b["time"] - a["time"]
            )
    raise ValueError(f"{t} is outside the history")


def start_monitor(swarm: LocalSwarm, args, run: str) -> str:
    """Starts `pathswarm monitor`; returns its /api/status URL."""
    swarm.spawn("monitor", ["monitor", "--initial_peers", *swarm.initial_peers, "--host_maddrs", LOOPBACK,
                            "--run", run, "--metrics_port", "0", "--http_port", "0", "--host", "127.0.0.1",
                            "--interval_seconds", str(args.monitor_interval_seconds)])  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"status page on (http://\S+)/", swarm.log_path("monitor").read_text())
        if found:
            return found.group(1) + "/api/status"
        if not swarm.alive("monitor"):
            raise RuntimeError(f"the monitor exited: {swarm.log_path('monitor').read_text()[-2000:]}")
        time.sleep(0.2)
    raise TimeoutError("the monitor did not print its status page's address")


def rotation(args: argparse.Namespace, folder: Path) -> dict:
    names = [f"p{i}" for i in range(3)]
    manifest, run = make_run(args, "goodput-rotation", args.rounds, folder)
    samples: list[tuple[float, float]] = []
    started = time.monotonic()
    with LocalSwarm(folder / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(folder / "manifest.json")])
        for name in names:
            swarm.start_peer(name, peer_argv(args, run, folder / name, args.rounds, "--wait_for_peers", "3"))
        url = start_monitor(swarm, args, run)
        deadline = time.monotonic() + args.run_timeout_seconds
        while any(swarm.alive(n) for n in names):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the run did not finish in {args.run_timeout_seconds} s: {folder}/logs")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    samples.append((time.time(), float(json.load(r)["tokens_per_second"])))
            except (OSError, KeyError, ValueError):
                pass  # the monitor has no view yet
            time.sleep(args.monitor_interval_seconds / 2)
        codes = {n: swarm.procs[n].returncode for n in names}
    if any(codes.values()):
        raise RuntimeError(f"peers exited with {codes}: {folder}/logs")
    hist = histories(folder, names)
    step_seconds = sum(e.get("step_seconds", 0.0) for h, _ in hist.values() for e in h)
    loop_seconds = sum(h[-1]["train_seconds"] for h, _ in hist.values())
    t1 = max(h[0]["time"] for h, _ in hist.values())
    t2 = min(h[-1]["time"] for h, _ in hist.values())
    measured = sum(tokens_at(h, t2) - tokens_at(h, t1) for h, _ in hist.values()) / (t2 - t1)
    # the monitor's rate at a poll covers the interval before it: samples from one interval in
    shown = [v for t, v in samples if t1 + args.monitor_interval_seconds <= t <= t2]
    gaps = [b["time"] - a["time"] for h, _ in hist.values() for a, b in zip(h, h[1:], strict=False)]
    path_steps: dict[str, int] = {}
    for _, meta in hist.values():
        for p, n in meta["path_steps"].items():
            path_steps[p] = path_steps.get(p, 0) + int(n)
    monitor = statistics.fmean(shown) if shown else NAN
    # where the loop's time went, as fractions of it (what no lap holds: before the first lap, the drain)
    parts = {k: 0.0 for k in LOOP_PARTS}
    for h, _ in hist.values():
        for e in h:
            for k, v in e.get("loop_parts_seconds", {}).items():
                parts[k] = parts.get(k, 0.0) + v
    return dict(
        peers=len(names),
        rounds=args.rounds,
        train_fraction=step_seconds / loop_seconds,
        loop_parts={k: v / loop_seconds for k, v in parts.items()},
        tokens_per_second=measured,
        monitor_tokens_per_second=monitor,
        monitor_error=abs(monitor - measured) / measured,
        monitor_samples=len(shown),
        window_seconds=t2 - t1,
        max_round_gap_seconds=max(gaps),
        median_round_gap_seconds=statistics.median(gaps),
        path_steps=dict(sorted(path_steps.items())),
        rounds_split=count_splits(folder / "logs"),
        moves=count_marks(folder / "logs", (MOVE_MARK,)),
        double_moves=count_double_moves(folder / "logs"),
        extra_moves=count_extra_moves(folder / "logs"),
        seconds=round(time.monotonic() - started, 1),
    )


def churn(args: argparse.Namespace, folder: Path, kill: bool) -> dict:
    names = [f"p{i}" for i in range(4)]
    manifest, run = make_run(args, "goodput-churn", args.churn_rounds, folder)
    rng = random.Random(args.seed)
    kills: list[dict] = []
    started = time.monotonic()
    end = started + args.churn_seconds
    cpu_at_start = cpu_seconds()
    with LocalSwarm(folder / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(folder / "manifest.json")])
        # the window ends the run, not a number of rounds
        argv = {n: peer_argv(args, run, folder / n, 100 * args.churn_rounds, "--path", str(i))
                for i, n in enumerate(names)}  # fmt: skip
        for name, a in argv.items():  # a restarted peer does not wait: the others are training
            swarm.start_peer(name, [*a, "--wait_for_peers", str(len(names))])
        restarts = dict.fromkeys(names, 0)
        next_kill = time.monotonic() + args.kill_every_seconds
        while time.monotonic() < end:
            time.sleep(0.2)
            if exited := [n for n in names if not swarm.alive(n)]:
                raise RuntimeError(f"{exited} exited before the window's end: {folder}/logs")
            if not kill or time.monotonic() < next_kill or time.monotonic() > end - 10.0:
                continue
            victims = rng.sample(names, 2 if len(kills) % 2 == 1 else 1)
            for v in victims:
                swarm.kill(v, signal.SIGKILL)
            kills.append(dict(peers=victims, at_seconds=round(time.monotonic() - started, 1)))
            print(f"  [{time.monotonic() - started:5.0f}s] killed {', '.join(victims)}", flush=True)
            time.sleep(args.restart_after_seconds)
            for v in victims:
                restarts[v] += 1
                # a restarted process writes a new log; the old one is kept for the counts
                swarm.log_path(v).rename(swarm.log_path(f"{v}.{restarts[v]}"))
                swarm.start_peer(v, [*argv[v], "--resume"])
            next_kill = time.monotonic() + args.kill_every_seconds
        idle, all_seconds = (b - a for a, b in zip(cpu_at_start, cpu_seconds(), strict=True))
        for n in names:  # the window is over: each checkpoints what it trained and leaves
            swarm.kill(n, signal.SIGTERM)
        codes = {n: swarm.wait(n, 120) for n in names}
    if any(codes.values()):
        raise RuntimeError(f"peers exited with {codes}: {folder}/logs")
    metas = {n: load_latest_checkpoint(folder / n)[1] for n in names}
    docs = held_out(args, manifest)
    tokens = sum(int(m["tokens_total"]) for m in metas.values())
    return dict(
        tokens=tokens,
        window_seconds=args.churn_seconds,
        tokens_per_second=tokens / args.churn_seconds,
        own_rounds={n: int(m.get("own_rounds", 0)) for n, m in metas.items()},
        eval_loss=eval_paths(manifest, folder, names, docs),
        eval_composite=eval_composite(manifest, folder, names, docs),
        rounds_split=count_splits(folder / "logs"),
        modules_reset=count_marks(folder / "logs", (RESET_MARK,)),
        kills=kills,
        double_kills=sum(len(k["peers"]) == 2 for k in kills),
        # what a kill costs the killed peer: its process's start to its first step (the machine's speed)
        start_seconds=start_seconds(folder / "logs"),
        cpu_idle_fraction=idle / all_seconds if all_seconds else None,
    )


def table(report: dict) -> str:
    rows = ["| arm | measure | value | target |", "|---|---|---|---|"]
    if "rotation" in report:
        r = report["rotation"]
        rows += [
            f"| rotation | train_fraction | {r['train_fraction']:.3f} | ≥ {TARGETS['train_fraction']} |",
            "| rotation | the loop's time by part | "
            + ", ".join(f"{k} {v:.1%}" for k, v in r["loop_parts"].items())
            + " | |",
            "| rotation | moves (rotations made); onto a path another peer took at the same round; "
            f"beyond one at a round | {r['moves']}; {r.get('double_moves', '–')}; "
            f"{r.get('extra_moves', '–')} | |",
            f"| rotation | tokens/s measured, monitor | {r['tokens_per_second']:.0f}, "
            f"{r['monitor_tokens_per_second']:.0f} (error {r['monitor_error']:.1%}) | error ≤ 15% |",
            f"| rotation | round gap max, median (s) | {r['max_round_gap_seconds']:.1f}, "
            f"{r['median_round_gap_seconds']:.1f} | |",
            f"| rotation | rounds_split | {r['rounds_split']} | 0 |",
        ]
    if "churn" in report:
        c = report["churn"]
        rows += [
            f"| churn | tokens_ratio | {c['tokens_ratio']:.3f} | ≥ {TARGETS['tokens_ratio']} |",
            f"| churn | eval_loss_ratio | {c['eval_loss_ratio']:.3f} | ≤ {TARGETS['eval_loss_ratio']} |",
            # .get: runs written before the composite was measured (session 52) have none
            f"| churn | routed composite's loss ratio | {c.get('composite_loss_ratio', NAN):.3f} | |",
            f"| churn | rounds_split | {c['kill']['rounds_split']} | 0 |",
            f"| churn | modules_reset | {c['kill']['modules_reset']} | 0 |",
            f"| churn | kills (two at once) | {len(c['kill']['kills'])} ({c['kill']['double_kills']}) | ≥2 |",
            "| churn | a peer's start to its first step (s): launch, restart, mean (max) | "
            f"{describe_starts(c['kill'].get('start_seconds'))} | |",
            "| churn | tokens/s, machine CPU idle: clean start, kill, clean end | "
            + ", ".join(
                f"{c[a]['tokens_per_second']:.0f} ({_share(c[a].get('cpu_idle_fraction'))})" for a in ARMS
            )
            + " | |",
        ]
    return "\n".join(rows)


def _share(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%} idle"


def write_outputs(out: Path, report: dict) -> str:
    text = table(report)
    (out / "goodput.json").write_text(json.dumps(report, indent=2))
    (out / "goodput.md").write_text(f"# Goodput\n\n{text}\n\nCommand: `{report['command']}`\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ("rotation", "loop", "churn") if a in report or (a == "loop" and "rotation" in report)]
    fig, axes = plt.subplots(1, len(arms), figsize=(4 * len(arms), 3.2), squeeze=False)
    axis = dict(zip(arms, axes[0], strict=True))
    if "rotation" in report:
        r = report["rotation"]
        rates = [r["tokens_per_second"], r["monitor_tokens_per_second"]]
        axis["rotation"].bar(["measured", "monitor"], rates)
        axis["rotation"].set(title="rotation: tokens/s")
        # the loop's time by part, the inner steps first: their bar ends at train_fraction
        parts = sorted(r.get("loop_parts", {}).items(), key=lambda kv: kv[0] != "step")
        left = 0.0
        for i, (part, share) in enumerate(parts):
            axis["loop"].barh([0], [share], 0.5, left=left, color=f"C{i}", label=f"{part} {100 * share:.1f}%")
            left += share
        axis["loop"].axvline(0.9, color="k", linestyle="--", label="target 0.9")
        axis["loop"].set(title=f"rotation: the loop's time\n(train_fraction {r['train_fraction']:.3f})",
                         xlim=(0, 1), ylim=(-1.6, 0.4), yticks=[])  # fmt: skip
        axis["loop"].legend(fontsize=7, loc="lower center", ncol=3)
    if "churn" in report:
        c = report["churn"]
        labels = ["clean (start)", "churn", "clean (end)"]
        values = [c["clean_start"]["tokens_per_second"], c["kill"]["tokens_per_second"],
                  c["clean_end"]["tokens_per_second"]]  # fmt: skip
        axis["churn"].bar(labels, values, color=["C0", "C3", "C0"])
        axis["churn"].set(title=f"churn: tokens/s ({len(c['kill']['kills'])} kills)")
    fig.tight_layout()
    fig.savefig(out / "goodput.png", dpi=120)
    return text


def main(argv: list[str] | None = None) -> int:
    # SIGTERM (a timeout, ^C's cousin) unwinds the arms' swarms: killed outright, their peers trained on
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = dict(
        command="python -m benchmarks.goodput " + " ".join(argv if argv is not None else sys.argv[1:])
    )
    if "rotation" in args.arms:
        print("rotation: 3 peers, 2x2 grid ...", flush=True)
        report["rotation"] = rotation(args, args.out / "runs" / "rotation")
        print(f"  {report['rotation']}", flush=True)
    if "churn" in args.arms:
        arms = {}
        for name in ARMS:
            kill = name == "kill"
            print(f"churn, {name} ...", flush=True)
            arms[name] = churn(args, args.out / "runs" / f"churn_{name}", kill)
            print(f"  { ({k: v for k, v in arms[name].items() if k != 'kills'}) }", flush=True)
        report["churn"] = dict(
            **arms,
            tokens_ratio=kill_over_clean(arms, lambda a: a["tokens_per_second"]),
            eval_loss_ratio=kill_over_clean(arms, lambda a: a["eval_loss"]),
            # beside it, not instead: the routed composite (benchmarks/goodput_eval.py)
            composite_loss_ratio=kill_over_clean(arms, lambda a: a["eval_composite"]["loss"]),
            rounds_split=arms["kill"]["rounds_split"],
            modules_reset=arms["kill"]["modules_reset"],
        )
    print(write_outputs(args.out, report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
