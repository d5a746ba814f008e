"""What sync work beside a training thread costs it: `python -m benchmarks.sync_contention --out DIR`.

In the WAN lab a streaming peer's training thread spends more CPU seconds on the same 192 steps than
a no_sync peer's (up to +1.9 s of ~21), though what it does per sync is little: its fragment rounds
are aggregated on other threads, which run on the other core. This measures the cause on its own:
the lab's model trains on one thread (batch 4x64, AdamW) while another process on the other core does
nothing, a pure-Python loop (CPU, almost no memory traffic), or the real aggregation of a fragment
round (`peer.sync.aggregate`, centered clip of 4 members' 810,000-number fragments: a quarter of the
lab's model), in a loop. Training CPU ms per step is the thread's own CPU time (`time.thread_time`).
Rounds of each alternate, `--repeats` times, so drift of the shared machine falls on all three.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

NEIGHBOURS = ("idle", "python loop", "aggregation")


def neighbour(kind: str, stop) -> None:
    import numpy as np

    if kind == "python loop":
        x = 0
        while not stop.is_set():
            for i in range(100_000):
                x += i
    elif kind == "aggregation":
        from peer.sync.aggregate import AggregatorConfig, Contribution, aggregate

        rng = np.random.default_rng(0)
        parts = [rng.standard_normal(810_000).astype(np.float32) for _ in range(4)]
        while not stop.is_set():
            aggregate([Contribution(f"p{i}", p, 1.0) for i, p in enumerate(parts)], AggregatorConfig())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.sync_contention", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=60, help="timed training steps per measurement")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from benchmarks.wan.driver import LabTraining

    torch.set_num_threads(1)
    loop = LabTraining.load(max_docs=600).replica(batch_seed=0, total_steps=100_000)
    for _ in range(20):  # warm-up: allocator, first batches
        loop.step()
    ctx = mp.get_context("spawn")  # the neighbour shares nothing with the trainer but the machine
    samples: dict[str, list[dict]] = {k: [] for k in NEIGHBOURS}
    for repeat in range(args.repeats):
        for kind in NEIGHBOURS:
            stop, proc = ctx.Event(), None
            if kind != "idle":
                proc = ctx.Process(target=neighbour, args=(kind, stop), daemon=True)
                proc.start()
                time.sleep(3.0)  # imported and running
            cpu0, wall0 = time.thread_time(), time.monotonic()
            for _ in range(args.steps):
                loop.step()
            cpu, wall = time.thread_time() - cpu0, time.monotonic() - wall0
            stop.set()
            if proc is not None:
                proc.join(10)
            row = dict(cpu_ms_per_step=1e3 * cpu / args.steps, wall_ms_per_step=1e3 * wall / args.steps)
            samples[kind].append(row)
            print(f"repeat {repeat} {kind:12s} {row['cpu_ms_per_step']:.1f} ms CPU/step", file=sys.stderr)
    idle = statistics.median(s["cpu_ms_per_step"] for s in samples["idle"])
    summary = {
        k: dict(
            cpu_ms_per_step_median=statistics.median(s["cpu_ms_per_step"] for s in rows),
            ratio_to_idle=statistics.median(s["cpu_ms_per_step"] for s in rows) / idle,
            samples=rows,
        )
        for k, rows in samples.items()
    }
    given = argv if argv is not None else sys.argv[1:]
    report = dict(steps=args.steps, repeats=args.repeats, neighbours=summary,
                  command=" ".join(["python -m benchmarks.sync_contention", *given]))  # fmt: skip
    (args.out / "sync_contention.json").write_text(json.dumps(report, indent=1))
    lines = [
        "| beside the training thread | training CPU ms / step (median) | × idle | samples |",
        "|---|---:|---:|---|",
    ]
    for k, v in summary.items():
        each = ", ".join(f"{s['cpu_ms_per_step']:.1f}" for s in v["samples"])
        lines.append(f"| {k} | {v['cpu_ms_per_step_median']:.1f} | {v['ratio_to_idle']:.3f} | {each} |")
    text = "\n".join(lines) + "\n"
    (args.out / "sync_contention.md").write_text(text)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, v in enumerate(summary.values()):
        ax.bar(i, v["cpu_ms_per_step_median"], color=("grey", "tab:blue", "tab:red")[i])
        ax.scatter([i] * len(v["samples"]), [s["cpu_ms_per_step"] for s in v["samples"]], color="black", s=10)
    ax.set_xticks(range(len(summary)), list(summary))
    ax.set(ylabel="training thread CPU ms per step", title="sync work on the other core")
    fig.tight_layout()
    fig.savefig(args.out / "sync_contention.png", dpi=120)
    plt.close(fig)
    print(text)


if __name__ == "__main__":
    main()
