"""DiPaCo against three dense baselines: `python -m benchmarks.dipaco --out DIR`.

Trains, in one process and side by side: DiPaCo grids (--grids, default 2x2; the first one listed is
the headline `composite_ppl`; `--grids 2x2,2x4` adds the 16-path grid at about twice the run time),
every path warm-started from one briefly trained dense base model (`--warm_start_steps` batch-steps of
a path-size model), then `--steps_per_path` steps on each path with a fresh AdamW and a fresh warm-up
and cosine; and against the headline grid, three dense baselines:

* `dense_ppl` ("dense"): path-size, from the base for as many steps as ONE path; the DiPaCo paper's
  comparison at equal per-path compute, which the `composite <= 0.92 x dense` target uses.
* `dense_same_tokens_ppl` ("dense same tokens"): path-size, from the base for as many batch-steps as
  all paths together, so base + steps equal the grid's warm start + n_paths x steps_per_path (the
  base counted once): the same tokens as the whole grid. DiPaCo earns its keep only if it beats this.
* `dense_all_params_ppl` ("dense all params"): the dense shape (depth, and width from the path's to
  twice it) whose parameter count is closest to all the grid's modules together; it cannot load the
  base, so it trains from scratch for the grid's whole batch-step budget, base steps included (the
  same tokens as the grid). `--no_dense_all_params` skips it.

Both path-size baselines get the paths' own treatment after the base: the base's weights, a fresh
AdamW (the base's optimizer state is dropped, as for every path) and a fresh warm-up and cosine over
their own steps, through the same `DenseTrainer` and `InnerLoop` as the base and the paths. Every
batch has the same shape. Held-out documents are routed by their first 32 tokens and scored after
them (peer/offline/evaluation.py); `composite_rerouted_ppl` scores the same grid with every scoring
window routed by the 32 tokens just before it (`evaluate_rerouted`). The held-out documents are a
seeded sample of the evaluation split (the same for every seed), and each seed reads the training
documents in its own shuffled order. Writes DIR/dipaco.json, DIR/dipaco.png and DIR/dipaco.md, and
prints the table; DIR/dipaco_runs.json holds each finished (budget, seed) run as soon as it ends.

Budgets and seeds (`benchmarks/dipaco_budgets.py`): `--budgets 1,4,16` multiplies every arm's steps
alike (warm start, steps per path, every baseline) on the same corpus, and `--seeds 1,2` repeats each
budget with another initialisation and data order (the corpus and its held-out split stay). Before
training it prints the corpus's tokens and the epochs each budget implies per arm; dipaco.json's
`budgets` holds per budget the four perplexities and the ratios (mean and spread over seeds), tokens
per parameter and each arm's epochs over its own data (above 1: the corpus was too small and data
repeated), `crossover` where composite / baseline meets 1, and DIR/dipaco_budgets.png plots it. The
other top-level keys, the table and DIR/dipaco.png describe one run: budget 1 (or the first listed)
with the first seed. The default (budgets 0.5 and 1, seeds 1 and 2) takes about 15 minutes on two
CPU cores; larger budgets are for `--device cuda` (`benchmarks/dipaco_device.sh`).

Data: the built-in offline multi-domain corpus, or --data_files (one document per line .txt, or
.jsonl with a "text" field), e.g. real text from `python -m benchmarks.stdlib_corpus --out F.jsonl`.
`--device` (auto: CUDA when there is one): where everything trains and is scored (CUDA: bf16 autocast).
`--validation_docs N` holds N training documents out of every arm to tune on (benchmarks.dipaco_tune).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

# Set before torch loads OpenMP: spinning worker threads make a step many times slower when the
# cores are shared with other processes, as they are on the machines this runs on.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from benchmarks.dipaco_budgets import (
    budgets_table,
    crossovers,
    device_record,
    epochs_line,
    parse_budgets,
    parse_seeds,
    plot_budgets,
    resolve_device,
    scaled_args,
    summarize_budget,
    training_plan,
)
from benchmarks.dipaco_report import Measured, plot, summarize, table
from peer.config import InnerOptimizerConfig, OuterOptimizerConfig
from peer.data.batches import encode_document
from peer.data.sources import DatasetSpec, load_documents, split_of
from peer.model.grid import ModelConfig
from peer.model.tokenizer import ByteTokenizer
from peer.model.transformer import PathModel, count_parameters, parameter_map
from peer.offline.evaluation import evaluate, evaluate_rerouted
from peer.offline.experiment import DipacoOptions, DipacoRun, run_dipaco
from peer.offline.simulate import DenseTrainer, SimConfig, dense_shape
from peer.run.create import parse_grid

#: the default sweep: about 15 minutes for both seeds on two CPU cores (budget 1 is the former run)
DEFAULT_BUDGETS = "0.5,1"


def build_parser(
    prog: str = "python -m benchmarks.dipaco", description: str | None = None
) -> argparse.ArgumentParser:
    """The arguments of one DiPaCo comparison (benchmarks.dipaco_tune adds its own to them)."""
    p = argparse.ArgumentParser(prog=prog, description=description or __doc__.splitlines()[0])
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
    p.add_argument(
        "--validation_docs",
        type=int,
        default=0,
        help="training documents held out of every arm's training to tune on (scored as val_ppl); 0: none",
    )
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help="step multipliers of every arm, e.g. 1,4,16")
    p.add_argument("--seeds", default="1,2", help="initialisation and data-order seeds, e.g. 1,2")
    p.add_argument(
        "--data_seed", type=int, default=0, help="seed of the built-in corpus (same for all seeds)"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument(
        "--no_dense_all_params",
        action="store_true",
        help="skip the dense model with as many parameters as the whole grid (the slowest baseline)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def dataset_spec(args: argparse.Namespace, seed: int | None = None) -> DatasetSpec:
    """The corpus of --data_files or the built-in one (generated from `seed`, default `args.seed`)."""
    seed = args.seed if seed is None else seed
    if not args.data_files:
        return DatasetSpec(kind="builtin", builtin_docs=args.builtin_docs, seed=seed)
    suffix = args.data_files.rsplit(".", 1)[-1].lower()
    kinds = {"txt": "text", "jsonl": "json", "json": "json"}
    if suffix not in kinds:
        raise SystemExit(f"--data_files {args.data_files!r}: expected .txt or .jsonl files")
    return DatasetSpec(kind=kinds[suffix], data_files=[args.data_files], seed=seed)


def n_parameters(cfg: ModelConfig) -> int:
    """Every parameter of every module of `cfg`, each counted once (a 1x1 grid is a dense model)."""
    return sum(math.prod(slot.shape) for slot in parameter_map(cfg))


def all_params_shape(cfg: ModelConfig) -> ModelConfig:
    """The dense shape whose parameter count is closest to all the grid's modules together: widths
    from the path's to twice it in steps of one head, depths up to the grid's block count. Ties keep
    the path's width (a deeper stack of the same blocks), then the shallower."""
    target, head = n_parameters(cfg), cfg.d_model // cfg.n_heads
    widths = [w for w in range(cfg.d_model, 2 * cfg.d_model + 1, head) if cfg.d_ff * w % cfg.d_model == 0]
    level_blocks = cfg.n_levels * cfg.modules_per_level * cfg.blocks_per_module
    depths = range(1, level_blocks + cfg.n_paths * cfg.private_blocks_per_path + 1)
    shapes = [dense_shape(cfg, w, b) for w in widths for b in depths]
    return min(
        shapes, key=lambda c: (abs(n_parameters(c) - target), c.d_model != cfg.d_model, c.blocks_per_path)
    )


@dataclass
class Bench:
    """What every phase reads: the arguments (one budget's and seed's), the data, where the
    measurements go, and the log's tag and clock."""

    args: argparse.Namespace
    train: list[str]
    held_out: list[str]
    tok: ByteTokenizer
    #: tokens of the training documents as they are trained on (BOS + bytes + EOS each)
    corpus_tokens: int
    tag: str = ""
    started: float = field(default_factory=time.monotonic)
    m: Measured = field(default_factory=Measured)
    #: training documents no arm trains on, to tune on (never the reported held-out documents)
    validation: list[str] = field(default_factory=list)

    def log(self, message: str) -> None:
        elapsed = int(time.monotonic() - self.started)
        print(f"[{self.tag} | {elapsed // 60}m{elapsed % 60:02d}s] {message}", flush=True)


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
        device=args.device,
    )


def corpus_tokens(docs: list[str], tok: ByteTokenizer) -> int:
    return sum(len(encode_document(tok, t)) for t in docs)


def train_grid(b: Bench, cfg: SimConfig, options: DipacoOptions) -> DipacoRun:
    """One DiPaCo grid, base included, scored on the held-out documents."""
    n, warm, per_path = cfg.model.n_paths, b.args.warm_start_steps, b.args.steps_per_path
    name = f"dipaco {cfg.model.n_levels}x{cfg.model.modules_per_level}"
    b.log(f"{name}: base {warm} steps, then {n} paths x {per_path} steps")
    t0 = time.monotonic()
    run = run_dipaco(cfg, b.train, b.tok, per_path, options)
    b.m.timings[name] = time.monotonic() - t0
    b.m.evals[name] = evaluate(run.grid(), b.held_out, b.tok, run.route, context=b.args.seq_len)
    # The same grid with every scoring window re-routed by the tokens just before it (DiPaCo's
    # finer routing at test time): an evaluation-only lever, no extra training.
    b.m.evals[f"{name} rerouted"] = evaluate_rerouted(
        run.grid(), b.held_out, b.tok, run.route, context=b.args.seq_len
    )
    b.m.shards[name] = {str(p): len(d) for p, d in run.shards.items()}
    val = (
        evaluate(run.grid(), b.validation, b.tok, run.route, context=b.args.seq_len) if b.validation else None
    )
    loops = [s.loop for s in run.sim.paths.values()]
    mean = [sum(x) / n for x in zip(*(lp.losses for lp in loops), strict=True)]
    b.m.curves[name] = ([warm + n * (i + 1) for i in range(len(mean))], mean)
    base_tokens = run.base_trainer.loop.tokens_seen
    # A path reads the corpus during the base, then only its own shard (the last one, if re-routed).
    path_epochs = {
        str(p): base_tokens / b.corpus_tokens + run.sim.paths[p].loop.tokens_seen / corpus_tokens(d, b.tok)
        for p, d in run.shards.items()
    }
    tokens = base_tokens + sum(lp.tokens_seen for lp in loops)
    b.m.models[name] = dict(
        paths=n,
        params=n_parameters(cfg.model),
        params_per_path=count_parameters(run.sim.path_model(0)),
        base_steps=warm,
        steps_after_base=sum(lp.step_count for lp in loops),
        steps=warm + sum(lp.step_count for lp in loops),
        tokens=tokens,
        path_tokens=base_tokens + sum(lp.tokens_seen for lp in loops) / n,
        epochs=tokens / b.corpus_tokens,
        path_epochs=path_epochs,
        max_path_epochs=max(path_epochs.values()),
        val_ppl=val.ppl if val else None,
        cfg=cfg.model,
    )
    b.log(
        f"{name}: trained in {b.m.timings[name]:.0f} s, held-out ppl {b.m.evals[name].ppl:.3f} "
        f"(every window re-routed: {b.m.evals[f'{name} rerouted'].ppl:.3f})"
    )
    return run


def train_baseline(
    b: Bench, name: str, trainer: DenseTrainer, steps: int, base: tuple[int, int], run: DipacoRun
) -> None:
    """Trains one dense baseline for `steps` after `base` (its base's batch-steps and tokens)."""
    t0 = time.monotonic()
    model = trainer.train(steps)
    b.m.timings[name] = time.monotonic() - t0
    b.m.evals[name] = evaluate(model, b.held_out, b.tok, run.route, context=b.args.seq_len)
    b.m.curves[name] = ([base[0] + i + 1 for i in range(steps)], trainer.loop.losses)
    n = count_parameters(model)
    val = evaluate(model, b.validation, b.tok, run.route, context=b.args.seq_len) if b.validation else None
    tokens = base[1] + trainer.loop.tokens_seen
    b.m.models[name] = dict(
        paths=1,
        params=n,
        params_per_path=n,
        base_steps=base[0],
        steps_after_base=trainer.loop.step_count,
        steps=base[0] + trainer.loop.step_count,
        tokens=tokens,
        epochs=tokens / b.corpus_tokens,
        val_ppl=val.ppl if val else None,
        cfg=model.cfg,
    )
    b.log(f"{name}: trained in {b.m.timings[name]:.0f} s, held-out ppl {b.m.evals[name].ppl:.3f}")


def train_baselines(b: Bench, run: DipacoRun) -> None:
    """The three dense baselines of the headline grid (see the module docstring)."""
    sim, args = run.sim.cfg, b.args
    n_paths, warm = sim.model.n_paths, args.warm_start_steps
    base = (warm, run.base_trainer.loop.tokens_seen)
    for name, steps in (("dense", args.steps_per_path), ("dense same tokens", n_paths * args.steps_per_path)):
        b.log(f"{name}: path-size, the base + {steps} steps (fresh AdamW and warm-up, as each path)")
        train_baseline(b, name, run.dense_baseline(steps, desc=name), steps, base, run)
    if args.no_dense_all_params:
        return
    cfg, total = all_params_shape(sim.model), warm + n_paths * args.steps_per_path
    b.log(
        f"dense all params: {cfg.blocks_per_path} blocks of d={cfg.d_model}, {n_parameters(cfg):,} params "
        f"(grid {n_parameters(sim.model):,}); {total} steps from scratch"
    )
    trainer = DenseTrainer(
        sim, b.train, b.tok, total, model=PathModel(cfg, (0,), seed=sim.seed), desc="dense all params"
    )
    train_baseline(b, "dense all params", trainer, total, (0, 0), run)


def load_data(args: argparse.Namespace) -> tuple[DatasetSpec, list[str], list[str], list[str]]:
    """(corpus, training documents, reported held-out documents, validation documents)."""
    spec = dataset_spec(args, seed=args.data_seed)
    docs = list(load_documents(spec))
    train = [t for t in docs if split_of(t, spec) == "train"]
    # Tuning reads documents of the training split that no arm trains on, a seeded sample (the same
    # for every seed and every arm), so a pick never sees the documents whose loss is reported.
    validation = random.Random(f"validation {args.data_seed}").sample(
        train, min(len(train) // 10, args.validation_docs)
    )
    if validation:
        held = set(validation)
        train = [t for t in train if t not in held]
    # Files list their documents in an order (a source tree's, alphabetically): the held-out documents
    # are a seeded sample of the whole evaluation split, the same for every seed, not its first ones.
    held_out = [t for t in docs if split_of(t, spec) == "eval"]
    held_out = random.Random(f"held-out {args.data_seed}").sample(
        held_out, min(len(held_out), args.max_eval_docs)
    )
    if len(held_out) < 10:
        raise SystemExit(f"only {len(held_out)} held-out documents; give more data")
    if args.validation_docs and len(validation) < 10:
        raise SystemExit(
            f"--validation_docs {args.validation_docs}: only {len(validation)} to spare; give more data"
        )
    return spec, train, held_out, validation


def dipaco_options(args: argparse.Namespace) -> DipacoOptions:
    return DipacoOptions(
        warm_start_steps=args.warm_start_steps,
        router_features=args.router_features,
        balanced=not args.unbalanced,
        relabel_at=args.relabel_at,
    )


def inner_config(args: argparse.Namespace) -> InnerOptimizerConfig:
    # The base's cosine spans the warm start plus one path's steps; the paths and the path-size
    # baselines each restart theirs (`DenseTrainer`, `DipacoSim`: schedule length = their own steps).
    return InnerOptimizerConfig(
        lr=args.lr, warmup_steps=50, total_steps=args.warm_start_steps + args.steps_per_path
    )


def run_once(b: Bench, spec: DatasetSpec) -> tuple[dict, dict]:
    """Every grid and baseline of one budget and seed: (results, loss curves)."""
    args = b.args
    options, inner = dipaco_options(args), inner_config(args)
    runs = [
        train_grid(b, sim_config(args, *parse_grid(g), inner), options)
        for g in args.grids.split(",")
        if g.strip()
    ]
    headline = runs[0]
    base_losses = headline.base_trainer.loop.losses
    b.m.curves = {"base": (list(range(1, len(base_losses) + 1)), base_losses), **b.m.curves}
    train_baselines(b, headline)
    for name, model in b.m.models.items():
        model.update(ppl=b.m.evals[name].ppl, eval=b.m.evals[name].to_dict(), train_seconds=b.m.timings[name])
        model["cfg"] = model["cfg"].model_dump()
    return summarize(args, b.m, headline.sim.cfg, spec, len(b.train), options), b.m.curves


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budgets, seeds = parse_budgets(args.budgets), parse_seeds(args.seeds)
    args.device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    spec, train, held_out, validation = load_data(args)
    tok = ByteTokenizer()
    n_tokens = corpus_tokens(train, tok)
    plan = training_plan(args, budgets)
    print(epochs_line(n_tokens, len(train), plan, args.batch_size * args.seq_len), flush=True)
    print(f"device {args.device}; budgets {[lb for lb, _ in budgets]} x seeds {seeds}", flush=True)
    per_budget: dict[str, list[dict]] = {}
    headline_label = "1" if "1" in dict(budgets) else budgets[0][0]
    headline: tuple[dict, dict] | None = None
    for label, factor in budgets:
        for seed in seeds:
            # Each seed reads the training documents in its own order (a run that stops before one
            # epoch sees a sample of the whole corpus, not its first files); the router's documents
            # are the first of that order.
            order = list(train)
            random.Random(f"train order {seed}").shuffle(order)
            b = Bench(
                scaled_args(args, factor, seed),
                order,
                held_out,
                tok,
                n_tokens,
                f"x{label} seed {seed}",
                started,
                validation=validation,
            )
            results, curves = run_once(b, spec)
            per_budget.setdefault(label, []).append(results)
            # every finished run on disk at once: a sweep stopped at a time limit keeps what it measured
            partial = json.dumps(per_budget, indent=1, default=str)
            (args.out / "dipaco_runs.json").write_text(partial + "\n")
            if label == headline_label and seed == seeds[0]:
                headline = (results, curves)
    assert headline is not None
    results, curves = headline
    sweep = {label: summarize_budget(f, seeds, per_budget[label]) for label, f in budgets}
    found = crossovers(sweep)
    results.update(
        budgets=sweep,
        crossover=found,
        headline_budget=headline_label,
        headline_seed=seeds[0],
        corpus_tokens=n_tokens,
        **device_record(args.device),
        wall_seconds=time.monotonic() - started,
        cpu_seconds=time.process_time(),
    )
    (args.out / "dipaco.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    plot(args.out / "dipaco.png", results, curves)
    plot_budgets(args.out / "dipaco_budgets.png", sweep, found)
    text = table(results) + "\n\n" + budgets_table(sweep, found)
    (args.out / "dipaco.md").write_text("# DiPaCo against three dense baselines\n\n" + text + "\n")
    print(text)
    return 0 if math.isfinite(results["ratio"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
