"""DiPaCo against dense models at equal steps per path: `python -m benchmarks.dipaco --out DIR`.

Trains, in one process and side by side: DiPaCo grids (--grids, default 2x2; the first one listed is
the headline `composite_ppl`; `--grids 2x2,2x4` adds the 16-path grid at about twice the run time)
warm-started from a briefly trained dense base model, the dense model of one path's size, and a dense
model about 4x that size (twice the width). Every model takes the same number of inner steps of the
same batch shape: each path `warm_start + steps_per_path` (the warm start is the base run's first
steps), each dense model `warm_start + steps_per_path`. Held-out documents are routed by their first
32 tokens and scored after them (peer/offline/evaluation.py). Writes DIR/dipaco.json, DIR/dipaco.png and
DIR/dipaco.md, and prints the table.

Data: the built-in offline multi-domain corpus, or --data_files (one document per line .txt, or
.jsonl with a "text" field).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

# Set before torch loads OpenMP: spinning worker threads make a step many times slower when the
# cores are shared with other processes, as they are on the machines this runs on.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from peer.config import InnerOptimizerConfig, OuterOptimizerConfig
from peer.data.sources import DatasetSpec, load_documents, split_of
from peer.model.grid import ModelConfig, all_paths, path_module_ids
from peer.model.tokenizer import ByteTokenizer
from peer.model.transformer import PathModel, count_parameters
from peer.offline.evaluation import EvalResult, evaluate
from peer.offline.experiment import DipacoOptions, run_dipaco
from peer.offline.simulate import DenseTrainer, SimConfig, dense_config
from peer.run.create import parse_grid

TARGET_RATIO = 0.92  # the paper's 2x4 grid: 14.86 / 16.23 composite over dense path-size perplexity


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dipaco", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data_files", default=None, help="glob of local .txt (one doc per line) or .jsonl files")
    p.add_argument("--builtin_docs", type=int, default=6000)
    p.add_argument("--grids", default="2x2", help="comma-separated LxK grids; the first is the headline")
    p.add_argument("--steps_per_path", type=int, default=600)
    p.add_argument("--warm_start_steps", type=int, default=200)
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--blocks_per_module", type=int, default=1)
    p.add_argument("--private_blocks", type=int, default=0)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--inner_steps", type=int, default=50, help="H")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--outer_lr", type=float, default=0.7)
    p.add_argument("--outer_momentum", type=float, default=0.9)
    p.add_argument("--router_features", choices=["base", "init"], default="base")
    p.add_argument("--unbalanced", action="store_true", help="plain k-means routing (no balancing bias)")
    p.add_argument(
        "--relabel_at", type=float, default=0.0, help="discriminative re-routing after this fraction"
    )
    p.add_argument("--max_eval_docs", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no_dense_4x", action="store_true")
    return p.parse_args(argv)


def dataset_spec(args: argparse.Namespace) -> DatasetSpec:
    if not args.data_files:
        return DatasetSpec(kind="builtin", builtin_docs=args.builtin_docs, seed=args.seed)
    suffix = args.data_files.rsplit(".", 1)[-1].lower()
    kinds = {"txt": "text", "jsonl": "json", "json": "json"}
    if suffix not in kinds:
        raise SystemExit(f"--data_files {args.data_files!r}: expected .txt or .jsonl files")
    return DatasetSpec(kind=kinds[suffix], data_files=[args.data_files], seed=args.seed)


def shared_fraction(cfg: ModelConfig) -> float:
    """Fraction of one path's parameters that live in modules at least one other path also runs."""
    paths = all_paths(cfg)
    holders: dict[str, int] = {}
    for p in paths:
        for mid in path_module_ids(cfg, p):
            holders[mid] = holders.get(mid, 0) + 1
    model = PathModel(cfg, paths[0])
    sizes = {mid: count_parameters(model.parts[mid]) for mid in model.module_ids}
    return sum(n for mid, n in sizes.items() if holders[mid] > 1) / sum(sizes.values())


def smooth(values: list[float], n: int = 25) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(i + 1, n))
    return out


def plot(out: Path, results: dict, curves: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results["models"])
    ppls = [results["models"][n]["ppl"] for n in names]
    bars = left.bar(names, ppls, color=["#888888" if n.startswith("dense") else "#1f77b4" for n in names])
    left.bar_label(bars, fmt="%.3f")
    left.axhline(TARGET_RATIO * results["dense_ppl"], ls="--", color="red", lw=1, label="0.92 x dense")
    left.set_ylabel("held-out perplexity (tokens after the first 32)")
    left.set_title(f"equal steps: {results['warm_start_steps']} + {results['steps_per_path']} per path")
    left.legend()
    for name, losses in curves.items():
        right.plot(smooth(losses), label=name, lw=1)
    right.set_xlabel("inner step (each path / dense model)")
    right.set_ylabel("training loss (smoothed)")
    right.set_yscale("log")
    right.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def table(results: dict) -> str:
    lines = [
        "| model | paths | params per path | held-out ppl | / dense path-size |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in results["models"].items():
        ratio = m["ppl"] / results["dense_ppl"]
        lines.append(f"| {name} | {m['paths']} | {m['params_per_path']:,} | {m['ppl']:.3f} | {ratio:.3f} |")
    verdict = "met" if results["ratio"] <= TARGET_RATIO else "missed"
    lines += [
        "",
        f"steps per path: {results['warm_start_steps']} warm start + {results['steps_per_path']} "
        f"(dense models: the same total); batch {results['batch_size']} x {results['seq_len']} tokens; "
        f"held-out docs {results['eval_docs']}, scored tokens {results['eval_tokens']:,}",
        f"composite / dense ({results['grid']}): {results['ratio']:.3f} (target <= {TARGET_RATIO}: "
        f"{verdict}); shared fraction {results['shared_fraction']:.2f}; "
        f"wall {results['wall_seconds']:.0f} s",
    ]
    return "\n".join(lines)


@dataclass
class Measured:
    """Per model: its description, held-out evaluation, loss curve, shard sizes and training time."""

    models: dict[str, dict] = field(default_factory=dict)
    evals: dict[str, EvalResult] = field(default_factory=dict)
    curves: dict[str, list[float]] = field(default_factory=dict)
    shards: dict[str, dict[str, int]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


def sim_config(args: argparse.Namespace, levels: int, k: int, inner: InnerOptimizerConfig) -> SimConfig:
    mcfg = ModelConfig(
        d_model=args.d_model,
        n_heads=max(1, args.d_model // 16),
        d_ff=4 * args.d_model,
        max_seq_len=max(128, args.seq_len + 1),
        n_levels=levels,
        modules_per_level=k,
        blocks_per_module=args.blocks_per_module,
        private_blocks_per_path=args.private_blocks,
    )
    return SimConfig(
        model=mcfg,
        seed=args.seed,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        inner_steps=args.inner_steps,
        inner=inner,
        outer=OuterOptimizerConfig(lr=args.outer_lr, momentum=args.outer_momentum),
    )


def train_grids(args, grids, inner, options, train, held_out, tok, m: Measured):
    """Every DiPaCo grid; returns the first grid's route, dense run, name and config (the headline)."""
    first = None
    for levels, k in grids:
        name = f"dipaco {levels}x{k}"
        cfg = sim_config(args, levels, k, inner)
        t0 = time.monotonic()
        print(f"{name}: {cfg.model.n_paths} paths, {args.steps_per_path} steps each", flush=True)
        run = run_dipaco(cfg, train, tok, args.steps_per_path, options)
        m.timings[name] = time.monotonic() - t0
        m.evals[name] = evaluate(run.grid(), held_out, tok, run.route, context=args.seq_len)
        m.shards[name] = {str(p): len(d) for p, d in run.shards.items()}
        losses = [s.loop.losses for s in run.sim.paths.values()]
        m.curves[name] = [sum(x) / len(x) for x in zip(*losses, strict=True)]
        m.models[name] = dict(
            paths=cfg.model.n_paths, params_per_path=count_parameters(run.sim.path_model(0)), cfg=cfg.model
        )
        if first is None:
            # The dense baseline is the base run itself, carried on to the same total steps.
            first = (run.route, run.dense, f"{levels}x{k}", cfg)
    return first


def train_dense_models(args, route, dense_trainer, sim: SimConfig, train, held_out, tok, m: Measured):
    total = args.warm_start_steps + args.steps_per_path
    t0 = time.monotonic()
    dense = dense_trainer.train(args.steps_per_path)
    m.timings["dense"] = time.monotonic() - t0
    m.evals["dense"] = evaluate(dense, held_out, tok, route, context=args.seq_len)
    m.curves["dense"] = dense_trainer.loop.losses[args.warm_start_steps :]
    m.models["dense"] = dict(paths=1, params_per_path=count_parameters(dense), cfg=dense_config(sim.model))
    if not args.no_dense_4x:
        t0 = time.monotonic()
        big = DenseTrainer(sim, train, tok, total, width_multiplier=2, desc="dense 4x")
        big_model = big.train(total)
        m.timings["dense 4x"] = time.monotonic() - t0
        m.evals["dense 4x"] = evaluate(big_model, held_out, tok, route, context=args.seq_len)
        m.curves["dense 4x"] = big.loop.losses[args.warm_start_steps :]
        m.models["dense 4x"] = dict(paths=1, params_per_path=count_parameters(big_model), cfg=big_model.cfg)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    tok = ByteTokenizer()
    spec = dataset_spec(args)
    docs = list(load_documents(spec))
    train = [t for t in docs if split_of(t, spec) == "train"]
    held_out = [t for t in docs if split_of(t, spec) == "eval"][: args.max_eval_docs]
    if len(held_out) < 10:
        raise SystemExit(f"only {len(held_out)} held-out documents; give more data")
    grids = [parse_grid(g) for g in args.grids.split(",") if g.strip()]
    options = DipacoOptions(
        warm_start_steps=args.warm_start_steps,
        router_features=args.router_features,
        balanced=not args.unbalanced,
        relabel_at=args.relabel_at,
    )
    total = args.warm_start_steps + args.steps_per_path
    inner = InnerOptimizerConfig(lr=args.lr, warmup_steps=50, total_steps=total)
    m = Measured()
    route, dense_trainer, main_grid, main_sim = train_grids(
        args, grids, inner, options, train, held_out, tok, m
    )
    train_dense_models(args, route, dense_trainer, main_sim, train, held_out, tok, m)
    for name, model in m.models.items():
        model.update(ppl=m.evals[name].ppl, eval=m.evals[name].to_dict(), train_seconds=m.timings[name])
        model["cfg"] = model["cfg"].model_dump()
    results = summarize(args, m, main_grid, main_sim, spec, len(train), options)
    results["wall_seconds"] = time.monotonic() - started
    results["cpu_seconds"] = time.process_time()
    (args.out / "dipaco.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    plot(args.out / "dipaco.png", results, m.curves)
    text = table(results)
    (args.out / "dipaco.md").write_text("# DiPaCo vs dense at equal steps per path\n\n" + text + "\n")
    print(text)
    return 0 if math.isfinite(results["ratio"]) else 1


def summarize(args, m: Measured, main_grid: str, main_sim: SimConfig, spec, n_train: int, options) -> dict:
    evals, models = m.evals, m.models
    main_name = f"dipaco {main_grid}"
    return dict(
        composite_ppl=evals[main_name].ppl,
        dense_ppl=evals["dense"].ppl,
        dense_4x_ppl=evals["dense 4x"].ppl if "dense 4x" in evals else None,
        ratio=evals[main_name].ppl / evals["dense"].ppl,
        grid=main_grid,
        grids={name: x["ppl"] for name, x in models.items() if name.startswith("dipaco")},
        ratios={name: x["ppl"] / evals["dense"].ppl for name, x in models.items()},
        target_ratio=TARGET_RATIO,
        steps_per_path=args.steps_per_path,
        warm_start_steps=args.warm_start_steps,
        dense_steps=args.warm_start_steps + args.steps_per_path,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        shared_fraction=shared_fraction(main_sim.model),
        shared_fractions={
            f"{c.n_levels}x{c.modules_per_level}": shared_fraction(c)
            for c in (ModelConfig(**models[n]["cfg"]) for n in models if n.startswith("dipaco"))
        },
        shard_sizes=m.shards[main_name],
        all_shard_sizes=m.shards,
        dense_4x_param_ratio=(models["dense 4x"]["params_per_path"] / models["dense"]["params_per_path"])
        if "dense 4x" in models
        else None,
        eval_docs=evals["dense"].docs,
        eval_tokens=evals["dense"].tokens,
        data=spec.model_dump(),
        train_docs=n_train,
        options=options.model_dump(),
        args={k: str(v) for k, v in vars(args).items()},
        torch_threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(),
        models=models,
    )


if __name__ == "__main__":
    raise SystemExit(main())
