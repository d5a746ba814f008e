"""Held-out losses of a goodput churn arm's final checkpoints (`benchmarks.goodput`).

Two measures of what the arm's volunteer-seconds bought:

* `eval_paths` (the issue's `eval_loss`): each peer's global copy of its final path scored on every
  held-out document, averaged over the peers. A path is an expert for the documents routed to it,
  so most of this is its loss on other paths' documents (2.0–3.3 nats here against 0.6 on its own).
* `eval_composite`: the grid assembled from the peers' global copies (`assemble_grid`: each module
  from its most advanced holder) with every held-out document routed to its path, as `pathswarm
  eval` and DiPaCo score it. It shows what the per-path mean hides: a path whose only holder was
  killed again and again, its modules trained by the neighbouring paths' peers meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

from benchmarks.wan.report import load_weights
from peer.checkpoint import load_latest_checkpoint
from peer.config import RunManifest
from peer.data.sources import eval_documents
from peer.model.tokenizer import load_tokenizer
from peer.model.transformer import PathModel
from peer.offline.evaluation import evaluate
from peer.offline.grid_checkpoints import assemble_grid
from peer.run.rebuild import check_tokenizer, make_route
from peer.run.record import load_verified_manifest


def held_out(args: argparse.Namespace, manifest: RunManifest) -> list[str]:
    """The run's held-out documents both measures score (read once per arm)."""
    return eval_documents(manifest.dataset, limit=args.max_eval_docs)


def kill_over_clean(arms: dict, value: Callable[[dict], float]) -> float:
    """The kill arm's `value` over the mean of the clean arms' at both ends."""
    return value(arms["kill"]) / statistics.fmean([value(arms["clean_start"]), value(arms["clean_end"])])


def eval_paths(manifest: RunManifest, folder: Path, names: list[str], docs: list[str]) -> float:
    """Mean held-out loss of each peer's global copy of its final path, on every document."""
    tokenizer = load_tokenizer(manifest.tokenizer)
    losses = []
    for name in names:
        tensors, meta = load_latest_checkpoint(folder / name)
        model = PathModel(manifest.model, tuple(meta["path"]), seed=manifest.seed)
        load_weights(model, tensors, "global")
        result = evaluate(model, docs, tokenizer, context=manifest.seq_len)
        losses.append(result.nll / result.tokens)
    return statistics.fmean(losses)


def eval_composite(manifest: RunManifest, folder: Path, names: list[str], docs: list[str]) -> dict:
    """Held-out loss of the grid from the peers' global copies, each document scored by its routed
    path: the whole and per path ({path index: loss})."""
    grid = assemble_grid(manifest, [folder / n for n in names])
    result = evaluate(grid, docs, check_tokenizer(manifest), make_route(manifest), context=manifest.seq_len)
    per_path = {str(p): s.nll / s.tokens for p, s in sorted(result.per_path.items())}
    return dict(loss=result.nll / result.tokens, per_path=per_path)


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.goodput_eval DIR...`: adds the routed composite to goodput runs written
    before the benchmark measured it (their checkpoints are under DIR/runs), and rewrites their tables."""
    import json
    import sys

    from benchmarks.goodput import ARMS, write_outputs

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.goodput_eval", description=main.__doc__.splitlines()[0]
    )
    p.add_argument("runs", nargs="+", type=Path, help="a goodput --out folder")
    p.add_argument(
        "--max_eval_docs", type=int, default=200, help="as the run's (benchmarks.goodput's default)"
    )
    args = p.parse_args(argv)
    for out in args.runs:
        report = json.loads((out / "goodput.json").read_text())
        churn = report.get("churn")
        if churn is None:
            print(f"{out}: no churn arm", file=sys.stderr)
            continue
        for arm in ARMS:
            folder = out / "runs" / f"churn_{arm}"
            manifest, _ = load_verified_manifest(folder / "manifest.json")
            names = [f"p{i}" for i in range(4)]
            churn[arm]["eval_composite"] = eval_composite(manifest, folder, names, held_out(args, manifest))
        churn["composite_loss_ratio"] = kill_over_clean(churn, lambda a: a["eval_composite"]["loss"])
        write_outputs(out, report)
        print(f"{out}: composite_loss_ratio {churn['composite_loss_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
