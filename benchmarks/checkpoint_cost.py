"""What a peer's per-round checkpoint costs in CPU: `python -m benchmarks.checkpoint_cost --out DIR`.

A peer checkpoints at every round's end (`CheckpointWriter`): the training thread copies the tensors
and encodes the meta (`submit`), a writer thread saves them crash-safe. The meta carries the peer's
round history, up to `HISTORY_KEPT` (200) entries of ~500 bytes each, so its JSON, not the tensors,
is most of the CPU when the model is small and the rounds are fast (the goodput and claims_scale
benchmarks run several rounds a second). This times `--saves` checkpoints through the writer, as the
peer submits them, for round histories of several lengths, each `--reps` times:

* `submit_ms`: wall time of `submit` on the calling thread (what the training thread pays);
* `cpu_ms_per_save`: CPU time of the whole process (both threads) per checkpoint written.

History entries have the fields and sizes of a real peer's entry (two modules, one group each).
Run it in two checkouts to compare code. Writes DIR/checkpoint_cost.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from peer.checkpoint import CheckpointWriter, snapshot_tensors
from peer.training.checkpoints import HISTORY_KEPT

REPO = Path(__file__).resolve().parent.parent
PEER = "QmbnYMgUsFHgKUdXETxudjscN8M14iEpwXNgbUMnnYvj1M"


def history_entry(round_index: int) -> dict:
    """One round's entry as a peer writes it (peer.training.history), with plausible values."""
    outcome = {"trunk": "averaged/2", "l0m0": "averaged/2"}
    return {
        "round": round_index, "step": 50 * round_index, "loss": 2.7295498132705687, "outcomes": outcome,
        "overlap_steps": 0, "fragments": {"0": dict(outcome)}, "bytes_sent": 1_234_567,
        "peak_sync_bytes": 654_321, "sync_seconds": [0.21, 0.19], "groups": {"trunk": [PEER, PEER[::-1]],
        "l0m0": [PEER, PEER[::-1]]}, "tokens_total": 1024 * round_index, "time": 1795864772.4454954,
        "train_seconds": 24.30795771799967, "step_seconds": 0.07304832899899338,
    }  # fmt: skip


def measure(folder: Path, saves: int, history: int, tensor_values: int) -> dict:
    tensors = {"w": torch.randn(tensor_values)}
    writer = CheckpointWriter(folder, keep=2)
    entries = [history_entry(i) for i in range(history)]
    submit_seconds = 0.0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for step in range(saves):
        meta = {"step": step, "run": "bench", "history": entries, "tokens_total": 1024 * step}
        t0 = time.perf_counter()
        writer.submit(snapshot_tensors(tensors), meta)
        submit_seconds += time.perf_counter() - t0
        writer.flush()  # one at a time: every checkpoint is written, none replaced while waiting
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    writer.close()
    errors = writer.errors()
    if errors:
        raise SystemExit(f"checkpoint writes failed: {errors[0]}")
    return {
        "history": history, "saves": saves, "submit_ms": 1000 * submit_seconds / saves,
        "cpu_ms_per_save": 1000 * cpu / saves, "wall_ms_per_save": 1000 * wall / saves,
    }  # fmt: skip


def plot(rows: list[dict], path: Path, commit: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("cpu_ms_per_save", "CPU per checkpoint"), ("submit_ms", "submit (training thread)")):
        xs = [r["history"] for r in rows]
        ax.plot(xs, [r[key] for r in rows], "o", label=label)
    ax.set_xlabel("round history entries in the meta")
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)
    ax.set_title(f"checkpoint cost per round ({commit})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.checkpoint_cost", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--saves", type=int, default=200, help="checkpoints per measurement")
    p.add_argument(
        "--histories", default=f"0,50,{HISTORY_KEPT}", help="round history lengths, comma-separated"
    )
    p.add_argument("--reps", type=int, default=2, help="measurements per history length")
    p.add_argument("--tensor_values", type=int, default=250_000, help="fp32 values saved (1 MB)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    rows = []
    for history in (int(h) for h in args.histories.split(",")):
        for rep in range(args.reps):
            with tempfile.TemporaryDirectory() as folder:
                row = measure(Path(folder), args.saves, history, args.tensor_values)
            rows.append(row)
            print(
                f"history {history} rep {rep + 1}: "
                + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if "ms" in k)
            )
    result = {"commit": commit, "tensor_values": args.tensor_values, "rows": rows}
    (args.out / "checkpoint_cost.json").write_text(json.dumps(result, indent=1))
    header = "| history entries | submit (ms) | CPU per save (ms) | wall per save (ms) |"
    lines = [f"# Checkpoint cost per round ({commit})", "", header, "|---:|---:|---:|---:|"]
    for r in rows:
        ms = " | ".join(f"{r[k]:.2f}" for k in ("submit_ms", "cpu_ms_per_save", "wall_ms_per_save"))
        lines.append(f"| {r['history']} | {ms} |")
    (args.out / "checkpoint_cost.md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out / "checkpoint_cost.png", commit)
    print(f"wrote {args.out / 'checkpoint_cost.json'}")


if __name__ == "__main__":
    main()
