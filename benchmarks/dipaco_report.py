"""The report of one `benchmarks.dipaco` run: its results, table, verdicts and plot (bars and loss
curves)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from peer.model.grid import ModelConfig, all_paths, path_module_ids
from peer.model.transformer import PathModel, count_parameters
from peer.offline.evaluation import EvalResult
from peer.offline.simulate import SimConfig

TARGET_RATIO = 0.92  # the paper's 2x4 grid: 14.86 / 16.23 composite over dense path-size perplexity
#: the three baselines: model name in the JSON and table -> prefix of its top-level keys
BASELINES = {
    "dense": "dense",
    "dense same tokens": "dense_same_tokens",
    "dense all params": "dense_all_params",
}


def smooth(values: list[float], n: int = 25) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= n:
            acc -= values[i - n]
        out.append(acc / min(i + 1, n))
    return out


def plot(out: Path, results: dict, curves: dict[str, tuple[list[int], list[float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = list(results["models"])
    ppls = [results["models"][n]["ppl"] for n in names]
    colors = ["#888888" if n.startswith("dense") else "#1f77b4" for n in names]
    bars = left.bar([n.replace(" ", "\n", 1) for n in names], ppls, color=colors)
    labels = [
        f"{p:.3f}" + (f"\ncomposite/this\n{results['composite_ppl'] / p:.3f}" if n in BASELINES else "")
        for n, p in zip(names, ppls, strict=True)
    ]
    left.bar_label(bars, labels=labels, fontsize=8)
    left.axhline(TARGET_RATIO * results["dense_ppl"], ls="--", color="red", lw=1, label="0.92 x dense")
    left.set_ylim(0, max(ppls) * 1.35)
    left.set_ylabel("held-out perplexity (tokens after the first 32)")
    left.set_title(f"{results['warm_start_steps']} base steps, then {results['steps_per_path']} per path")
    left.legend(loc="upper left", fontsize=8)
    for name, (steps, losses) in curves.items():
        style = dict(color="black", lw=2) if name == "base" else dict(lw=1)
        right.plot(steps, smooth(losses), label=name, **style)
    right.set_xlabel("batch-steps so far (all paths together; the base counted once)")
    right.set_ylabel("training loss (smoothed)")
    right.set_yscale("log")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def budget(m: dict) -> str:
    after = f"{m['steps_after_base']:,}"
    if m["paths"] > 1:
        after = f"{m['paths']} × {m['steps_after_base'] // m['paths']:,}"
    return f"{m['base_steps']} + {after} = {m['steps']:,}"


def table(results: dict) -> str:
    lines = [
        "| model | paths | params (all) | params per path | batch-steps (base + after) | tokens "
        "| held-out ppl | composite / this |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in results["models"].items():
        ratio = f"{results['composite_ppl'] / m['ppl']:.3f}" if name in BASELINES else "—"
        lines.append(
            f"| {name} | {m['paths']} | {m['params']:,} | {m['params_per_path']:,} | {budget(m)} "
            f"| {m['tokens']:,} | {m['ppl']:.3f} | {ratio} |"
        )
    return "\n".join(lines + [""] + verdicts(results))


def verdicts(r: dict) -> list[str]:
    lines = [
        f"composite / dense ({r['grid']}, equal steps per path; target <= {TARGET_RATIO}): "
        f"{r['ratio']:.3f}, {'met' if r['target_met'] else 'missed'}",
        f"composite / dense same tokens (DiPaCo earns its keep below 1): {r['ratio_same_tokens']:.3f}, "
        + ("DiPaCo beats it" if r["beats_same_tokens"] else "DiPaCo does not beat it"),
    ]
    if r["ratio_all_params"] is not None:
        lines.append(
            f"composite / dense all params ({r['dense_all_params_params']:,} params against the grid's "
            f"{r['grid_params']:,}; same tokens, from scratch): {r['ratio_all_params']:.3f}"
        )
    return lines + [
        f"batch {r['batch_size']} x {r['seq_len']} tokens; held-out docs {r['eval_docs']}, scored tokens "
        f"{r['eval_tokens']:,}; shared fraction {r['shared_fraction']:.2f}; wall {r['wall_seconds']:.0f} s",
    ]


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


@dataclass
class Measured:
    """Per model: its description, held-out evaluation, loss curve, shard sizes and training time."""

    models: dict[str, dict] = field(default_factory=dict)
    evals: dict[str, EvalResult] = field(default_factory=dict)
    #: name -> (batch-steps of the whole run after each step, training loss of that step)
    curves: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    shards: dict[str, dict[str, int]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


def summarize(args, m: Measured, main_sim: SimConfig, spec, n_train: int, options) -> dict:
    evals, models = m.evals, m.models
    main_grid = f"{main_sim.model.n_levels}x{main_sim.model.modules_per_level}"
    composite = evals[f"dipaco {main_grid}"].ppl
    ppl = {key: evals[name].ppl if name in evals else None for name, key in BASELINES.items()}
    ratio = {key: composite / v if v else None for key, v in ppl.items()}
    rerouted = evals[f"dipaco {main_grid} rerouted"].ppl
    return dict(
        composite_ppl=composite,
        composite_rerouted_ppl=rerouted,
        composite_val_ppl=models[f"dipaco {main_grid}"]["val_ppl"],
        ratio_same_tokens_rerouted=rerouted / ppl["dense_same_tokens"],
        ratio_all_params_rerouted=rerouted / ppl["dense_all_params"] if ppl["dense_all_params"] else None,
        **{f"{key}_ppl": v for key, v in ppl.items()},
        ratio=ratio["dense"],
        ratio_same_tokens=ratio["dense_same_tokens"],
        ratio_all_params=ratio["dense_all_params"],
        target_ratio=TARGET_RATIO,
        target_met=ratio["dense"] <= TARGET_RATIO,
        beats_same_tokens=ratio["dense_same_tokens"] < 1,
        grid=main_grid,
        grid_params=models[f"dipaco {main_grid}"]["params"],
        path_params=models["dense"]["params"],
        dense_all_params_params=models["dense all params"]["params"]
        if "dense all params" in models
        else None,
        grids={name: x["ppl"] for name, x in models.items() if name.startswith("dipaco")},
        model_budgets={name: dict(steps=x["steps"], tokens=x["tokens"]) for name, x in models.items()},
        steps_per_path=args.steps_per_path,
        warm_start_steps=args.warm_start_steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        shared_fraction=shared_fraction(main_sim.model),
        shared_fractions={
            f"{c.n_levels}x{c.modules_per_level}": shared_fraction(c)
            for c in (ModelConfig(**models[n]["cfg"]) for n in models if n.startswith("dipaco"))
        },
        shard_sizes=m.shards[f"dipaco {main_grid}"],
        all_shard_sizes=m.shards,
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
