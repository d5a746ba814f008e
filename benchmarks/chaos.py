"""Peers killed and restarted while they train: `python -m benchmarks.chaos --out DIR`.

Four real peer processes (and a bootstrap node) on loopback train one path of a 1x1 grid, so every
peer holds every module. First a clean run; then the same run where, every `--kill_every_seconds`,
a peer picked at random (seeded) is killed with SIGKILL (a power cut: no checkpoint, no goodbye) and
restarted `--restart_after_seconds` later with `--resume` from its last checkpoint, until every peer
reached `--rounds` outer rounds.

Measured: eval loss of p0's global copy on held-out documents, clean against chaos; module syncs
(over every peer's round history) averaged by all four against those averaged by fewer, alone,
excluded or failed; modules a restarted peer had to reset to initial weights (must be 0: a resumed
peer restores its checkpoint and catches up from the others); bytes sent; kills. Writes
DIR/chaos.json, DIR/chaos.png and DIR/chaos.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.local_runs import (  # noqa: E402
    RESET_MARK,
    add_run_args,
    count_marks,
    final_eval_loss,
    make_manifest,
    peer_argv,
    write_run,
)
from peer.checkpoint import load_latest_checkpoint  # noqa: E402
from peer.cli.local_swarm import LocalSwarm  # noqa: E402

RUN = "chaos"
PEERS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    add_run_args(p)
    p.add_argument("--kill_every_seconds", type=float, default=12.0)
    p.add_argument("--restart_after_seconds", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(rounds=80)  # long enough for several kills
    return p.parse_args(argv)


def _syncs(folder: Path) -> tuple[int, int, int]:
    """(averaged by all, by fewer or not averaged, bytes sent) over every peer's round history."""
    full = partial = sent = 0
    for i in range(PEERS):
        loaded = load_latest_checkpoint(folder / f"p{i}")
        if loaded is None:
            continue
        for entry in loaded[1].get("history", []):
            sent += int(entry.get("bytes_sent", 0))
            for outcome in entry["outcomes"].values():
                if outcome == f"averaged/{PEERS}":
                    full += 1
                else:
                    partial += 1
    return full, partial, sent


def run(args: argparse.Namespace, folder: Path, chaos: bool) -> dict:
    manifest = make_manifest(args, RUN)
    run_name = write_run(manifest, folder)
    rng = random.Random(args.seed)
    kills: list[dict] = []
    started = time.monotonic()
    with LocalSwarm(folder / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(folder / "manifest.json")])
        argv = {f"p{i}": peer_argv(args, run_name, folder / f"p{i}") for i in range(PEERS)}
        for name, a in argv.items():
            swarm.start_peer(name, [*a, "--wait_for_peers", str(PEERS)])
        restarts = {name: 0 for name in argv}
        next_kill = time.monotonic() + args.kill_every_seconds
        deadline = time.monotonic() + args.run_timeout_seconds
        while any(swarm.alive(n) for n in argv):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the run did not finish in {args.run_timeout_seconds}s: {folder}/logs")
            time.sleep(0.2)
            if not chaos or time.monotonic() < next_kill:
                continue
            living = [n for n in argv if swarm.alive(n)]
            if len(living) < PEERS:  # peers that finished: the end is near, stop killing
                continue
            victim = rng.choice(living)
            swarm.kill(victim, signal.SIGKILL)
            kills.append(dict(peer=victim, at_seconds=round(time.monotonic() - started, 1)))
            print(f"  [{time.monotonic() - started:5.0f}s] killed {victim}", flush=True)
            time.sleep(args.restart_after_seconds)
            restarts[victim] += 1
            # a restarted process writes a new log; the old one is kept for the resets count
            swarm.log_path(victim).rename(swarm.log_path(f"{victim}.{restarts[victim]}"))
            swarm.start_peer(victim, [*argv[victim], "--resume"])
            next_kill = time.monotonic() + args.kill_every_seconds
        codes = {n: swarm.procs[n].returncode for n in argv}
    bad = {n: c for n, c in codes.items() if c != 0}
    if bad:
        raise RuntimeError(f"peers exited with {bad}: {folder}/logs")
    loss, _ = final_eval_loss(args, manifest, folder / "p0")
    full, partial, sent = _syncs(folder)
    resets = count_marks(folder / "logs", (RESET_MARK,))
    return dict(
        eval_loss=loss,
        syncs_averaged_by_all=full,
        syncs_partial=partial,
        bytes_sent=sent,
        modules_reset=resets,
        kills=kills,
        seconds=round(time.monotonic() - started, 1),
    )


def write_outputs(out: Path, report: dict) -> str:
    c = report
    rows = [
        "| run | eval loss | syncs averaged by all 4 | syncs partial | modules reset | kills | seconds |",
        "|---|---|---|---|---|---|---|",
        f"| clean | {c['clean_eval_loss']:.4f} | {c['clean']['syncs_averaged_by_all']} | "
        f"{c['clean']['syncs_partial']} | {c['clean']['modules_reset']} | 0 | {c['clean']['seconds']} |",
        f"| chaos | {c['chaos_eval_loss']:.4f} | {c['rounds_averaged']} | {c['rounds_partial']} | "
        f"{c['modules_reset']} | {len(c['kills'])} | {c['chaos']['seconds']} |",
    ]
    table = "\n".join(rows)
    (out / "chaos.md").write_text(f"# Peers killed and restarted\n\n{table}\n\nCommand: `{c['command']}`\n")
    (out / "chaos.json").write_text(json.dumps(report, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    axes[0].bar(["clean", "chaos"], [c["clean_eval_loss"], c["chaos_eval_loss"]], color=["C0", "C3"])
    axes[0].set(title="eval loss of p0's global copy", ylabel="nats/token")
    axes[1].bar(
        ["clean", "chaos"],
        [c["clean"]["syncs_averaged_by_all"], c["rounds_averaged"]],
        label="averaged by all 4",
    )
    axes[1].bar(
        ["clean", "chaos"],
        [c["clean"]["syncs_partial"], c["rounds_partial"]],
        bottom=[c["clean"]["syncs_averaged_by_all"], c["rounds_averaged"]],
        label="partial",
    )
    axes[1].set(title=f"module syncs ({len(c['kills'])} kills)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "chaos.png", dpi=120)
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print("clean run ...", flush=True)
    clean = run(args, args.out / "runs" / "clean", chaos=False)
    print(f"  eval loss {clean['eval_loss']:.4f} ({clean['seconds']} s)", flush=True)
    print(f"chaos run: a random peer killed every {args.kill_every_seconds:g}s ...", flush=True)
    chaos = run(args, args.out / "runs" / "chaos", chaos=True)
    print(f"  eval loss {chaos['eval_loss']:.4f} ({chaos['seconds']} s)", flush=True)
    report = dict(
        command="python -m benchmarks.chaos " + " ".join(argv if argv is not None else os.sys.argv[1:]),
        peers=PEERS,
        rounds=args.rounds,
        clean_eval_loss=clean["eval_loss"],
        chaos_eval_loss=chaos["eval_loss"],
        rounds_averaged=chaos["syncs_averaged_by_all"],
        rounds_partial=chaos["syncs_partial"],
        modules_reset=chaos["modules_reset"],
        kills=chaos["kills"],
        clean=clean,
        chaos=chaos,
    )
    print(write_outputs(args.out, report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
