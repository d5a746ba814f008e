"""Scheduler against random and greedy assignment: `python -m benchmarks.scheduler --out DIR`.

For each of Yuan et al.'s five scenarios (arXiv 2206.01288; peer/scheduler/scenarios.py) at N=64
peers and P=8 paths (the paper's 8 data-parallel groups of 8) with the paper's workload (fp16
gradients of a GPT-3 XL tasklet averaged every step, H=1), in one run:

* `random_over_ours`: mean round time of 10 random balanced assignments over the planned one;
* `greedy_over_ours`: greedy clustering (peer/scheduler/partition.py) over the planned one;
* `exhaustive_gap_n8`: at N=8, the genetic search (forced, seeds 0-4, P in {2, 3, 4}) over the
  enumerated optimum, minus 1, worst case;
* `random_over_ours_diloco`: the same ratio in a DiLoCo round (H=100, 4-bit outer gradients):
  communication is then a small share of the round, so any plan gains little;

plus two rows of ours: `world_wide_mixed`, with volunteer-like mixed GPU speeds, and
`world_wide_uneven`, with peers spread unevenly over the regions and jittered links. `plan_seconds[N]` times
`plan` on the world-wide scenario for N = 64, 256, 1000 (P=8), `plan_seconds_by_paths` at N=1000
for more paths, and `ablation` compares the paper's fastest-link gain alone with our full local
search. Writes DIR/scheduler.json, DIR/scheduler.md and DIR/scheduler.png; prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from peer.scheduler import (
    SCENARIOS,
    SearchConfig,
    greedy_assignment,
    make_scenario,
    paper_grid,
    plan,
    random_cost,
    round_cost,
)
from peer.scheduler.scenarios import TASKLET_PARAMS

TARGETS = {
    "random_over_ours_world_wide": 2.7,
    "exhaustive_gap_n8": 0.02,
    "plan_seconds_64": 2.0,
    "plan_seconds_1000": 30.0,
}
DILOCO = dict(inner_steps=100, fragment_bytes=TASKLET_PARAMS / 2)  # 4 bits per parameter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scheduler", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--peers", type=int, default=64)
    p.add_argument("--paths", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sizes", default="64,256,1000", help="N values timed for plan_seconds")
    return p.parse_args(argv)


def compare(snapshot, seed: int) -> dict:
    ours = plan(snapshot, seed, method="genetic")
    greedy = round_cost(greedy_assignment(snapshot), snapshot).round_seconds
    rnd = random_cost(snapshot, range(10))
    base = ours.cost.round_seconds
    return {
        "ours_seconds": base,
        "ours_communication_seconds": ours.cost.communication_seconds,
        "compute_seconds": ours.cost.compute_seconds,
        "random_seconds": rnd,
        "greedy_seconds": greedy,
        "random_over_ours": rnd / base,
        "greedy_over_ours": greedy / base,
    }


def exhaustive_gap(name: str, compute: str) -> float:
    gaps = []
    for n_paths in (2, 3, 4):
        snap = make_scenario(name, 8, paper_grid(n_paths), compute=compute, seed=1)
        best = plan(snap, 0, method="exhaustive").cost.round_seconds
        for seed in range(5):
            gaps.append(plan(snap, seed, method="genetic").cost.round_seconds / best - 1.0)
    return max(gaps)


def run(args: argparse.Namespace) -> dict:
    rows = [(name, name, "uniform") for name in SCENARIOS] + [
        ("world_wide_mixed", "world_wide", "mixed"),
        ("world_wide_uneven", "world_wide_uneven", "uniform"),
    ]
    scenarios = {}
    for label, name, compute in rows:
        snap = make_scenario(name, args.peers, paper_grid(args.paths), compute=compute, seed=1)
        row = compare(snap, args.seed)
        row["exhaustive_gap_n8"] = exhaustive_gap(name, compute)
        diloco = make_scenario(name, args.peers, paper_grid(args.paths, **DILOCO), compute=compute, seed=1)
        row["random_over_ours_diloco"] = compare(diloco, args.seed)["random_over_ours"]
        scenarios[label] = row
        print(f"{label}: {row}", flush=True)

    def timed(n: int, n_paths: int) -> tuple[float, dict]:
        snap = make_scenario("world_wide", n, paper_grid(n_paths))
        start = time.perf_counter()
        ours = plan(snap, args.seed, method="genetic")
        seconds = time.perf_counter() - start
        greedy = round_cost(greedy_assignment(snap), snap).round_seconds
        rnd = random_cost(snap, range(3))
        base = ours.cost.round_seconds
        return seconds, {"random_over_ours": rnd / base, "greedy_over_ours": greedy / base}

    plan_seconds, large = {}, {}
    for n in (int(x) for x in args.sizes.split(",")):
        plan_seconds[str(n)], large[f"{n}x{args.paths}"] = timed(n, args.paths)
        print(f"N={n}: plan {plan_seconds[str(n)]:.2f} s {large[f'{n}x{args.paths}']}", flush=True)
    by_paths = {}
    for n_paths in (64, 256):
        by_paths[str(n_paths)], large[f"1000x{n_paths}"] = timed(1000, n_paths)
        print(
            f"N=1000 P={n_paths}: plan {by_paths[str(n_paths)]:.2f} s {large[f'1000x{n_paths}']}", flush=True
        )

    paper_only = SearchConfig(kl_passes=0, descent_steps=0)
    ablation = {}
    for n, n_paths in ((64, 8), (1000, 64)):
        snap = make_scenario("world_wide", n, paper_grid(n_paths))
        full = plan(snap, args.seed, method="genetic").cost.round_seconds
        only = plan(snap, args.seed, paper_only, method="genetic").cost.round_seconds
        ablation[f"{n}x{n_paths}"] = {
            "full_seconds": full,
            "paper_gain_only_seconds": only,
            "ratio": only / full,
        }
    met = {
        "random_over_ours_world_wide": scenarios["world_wide"]["random_over_ours"]
        >= TARGETS["random_over_ours_world_wide"],
        "exhaustive_gap_n8": max(r["exhaustive_gap_n8"] for r in scenarios.values())
        <= TARGETS["exhaustive_gap_n8"],
        "plan_seconds_64": plan_seconds.get("64", 0.0) <= TARGETS["plan_seconds_64"],
        "plan_seconds_1000": plan_seconds.get("1000", 0.0) <= TARGETS["plan_seconds_1000"],
    }
    return {
        "config": {
            "peers": args.peers,
            "paths": args.paths,
            "seed": args.seed,
            "workload": "paper: fp16 GPT-3 XL tasklet gradients (302 MB), H=1, 62.5k tokens/step",
            "diloco_workload": "H=100, 4-bit outer gradients (75.5 MB)",
            "cpus": os.cpu_count(),
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "scenarios": scenarios,
        "plan_seconds": plan_seconds,
        "plan_seconds_by_paths_n1000": by_paths,
        "large_n": large,
        "ablation": ablation,
        "targets": TARGETS,
        "targets_met": met,
    }


def markdown(result: dict) -> str:
    lines = [
        "| scenario | random / ours | greedy / ours | exhaustive gap (N=8) | random / ours, DiLoCo H=100 "
        "| ours round s (comm s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["scenarios"].items():
        cells = (
            f"{r['random_over_ours']:.2f}",
            f"{r['greedy_over_ours']:.2f}",
            f"{r['exhaustive_gap_n8']:.4f}",
            f"{r['random_over_ours_diloco']:.3f}",
            f"{r['ours_seconds']:.3f} ({r['ours_communication_seconds']:.3f})",
        )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| N x paths | plan s | random / ours | greedy / ours |", "|---|---|---|---|"]
    paths = result["config"]["paths"]
    for n, s in result["plan_seconds"].items():
        r = result["large_n"][f"{n}x{paths}"]
        lines.append(
            f"| {n} x {paths} | {s:.2f} | {r['random_over_ours']:.2f} | {r['greedy_over_ours']:.2f} |"
        )
    for p, s in result["plan_seconds_by_paths_n1000"].items():
        r = result["large_n"][f"1000x{p}"]
        lines.append(f"| 1000 x {p} | {s:.2f} | {r['random_over_ours']:.2f} | {r['greedy_over_ours']:.2f} |")
    lines += ["", "| ablation (world-wide) | full local search s | paper's gain only s |", "|---|---|---|"]
    for k, a in result["ablation"].items():
        lines.append(f"| {k} | {a['full_seconds']:.3f} | {a['paper_gain_only_seconds']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(result["scenarios"])
    x = np.arange(len(names))
    for k, (key, label) in enumerate(
        (("random_over_ours", "random / ours"), ("greedy_over_ours", "greedy / ours"))
    ):
        left.bar(x + (k - 0.5) * 0.38, [result["scenarios"][n][key] for n in names], 0.38, label=label)
    left.axhline(
        TARGETS["random_over_ours_world_wide"], color="k", ls="--", lw=1, label="target 2.7 (world-wide)"
    )
    left.axhline(1.0, color="grey", lw=0.8)
    left.set_xticks(x, [n.replace("_", "\n") for n in names], fontsize=8)
    left.set_ylabel("round time ratio (higher is better for us)")
    left.set_title("N=64, 8 paths, paper workload")
    left.legend(fontsize=8)
    sizes = [int(n) for n in result["plan_seconds"]]
    right.plot(sizes, list(result["plan_seconds"].values()), "o-", label=f"{result['config']['paths']} paths")
    for p, s in result["plan_seconds_by_paths_n1000"].items():
        right.plot([1000], [s], "s", label=f"1000 peers, {p} paths")
    right.axhline(TARGETS["plan_seconds_1000"], color="k", ls="--", lw=1, label="30 s budget")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("peers")
    right.set_ylabel("planning seconds")
    right.set_title(f"planning time, world-wide, {result['config']['cpus']} CPUs")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (args.out / "scheduler.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (args.out / "scheduler.md").write_text(table)
    plot(result, args.out / "scheduler.png")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
