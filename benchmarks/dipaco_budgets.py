"""The budget sweep of `benchmarks.dipaco`: every arm's steps times each `--budgets` factor, per seed.

A budget B multiplies the warm start, the steps per path and every baseline's steps alike (the batch
shape stays), so the tokens every arm sees grow B-fold on one fixed corpus; what changes is how many
tokens each parameter sees. This module turns the per-(budget, seed) results of `benchmarks.dipaco`
into the `budgets` section of dipaco.json (mean and spread over seeds, tokens per parameter, epochs
of each arm over its own training data), finds where composite / baseline crosses 1 and plots it.

Crossover: where two measured budgets straddle a ratio of 1, the point between them, linear in log
tokens per parameter; otherwise the straight line of ratio against log10 tokens per parameter through
the two largest budgets' means (the trend where the sweep ends: the ratio's fall flattens with the
budget, so a fit through all budgets would meet 1 too early), solved for 1: an extrapolation, and
labelled one. The least-squares slope through all budgets is recorded beside it.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence

import torch

from peer.run.create import parse_grid
from peer.training.inner import device_of

#: (JSON key of the ratio, the baseline's name in plots and tables)
CROSSOVER_RATIOS = {"ratio_same_tokens": "dense same tokens", "ratio_all_params": "dense all params"}
#: per-run keys that get a mean and spread over seeds
SPREAD_KEYS = (
    "composite_ppl",
    "dense_ppl",
    "dense_same_tokens_ppl",
    "dense_all_params_ppl",
    "ratio",
    "ratio_same_tokens",
    "ratio_all_params",
    "composite_rerouted_ppl",
    "ratio_same_tokens_rerouted",
    "ratio_all_params_rerouted",
)


def parse_budgets(text: str) -> list[tuple[str, float]]:
    """ "0.5,1,4" -> [("0.5", 0.5), ("1", 1.0), ("4", 4.0)]; one-line error naming the flag."""
    out: list[tuple[str, float]] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            factor = float(part)
        except ValueError:
            raise SystemExit(f"--budgets {text!r}: {part!r} is not a number") from None
        if not (math.isfinite(factor) and factor > 0):
            raise SystemExit(f"--budgets {text!r}: every budget must be a positive number, got {part!r}")
        label = f"{factor:g}"
        if label in dict(out):
            raise SystemExit(f"--budgets {text!r}: {part!r} is listed twice")
        out.append((label, factor))
    return out


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(p) for p in text.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds {text!r}: expected comma-separated integers") from None
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise SystemExit(f"--seeds {text!r}: seeds must be distinct and >= 0")
    return seeds


def scaled_steps(steps: int, factor: float) -> int:
    """`steps` times a budget factor; a positive count never rounds down to no steps at all."""
    return max(1, round(steps * factor)) if steps else 0


def resolve_device(name: str) -> str:
    """--device as SimConfig takes it; a CUDA device on a machine without one is refused here."""
    if name not in ("auto", "cpu") and not name.startswith("cuda"):
        raise SystemExit(f"--device {name!r}: expected auto, cpu, cuda or cuda:N")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch sees no CUDA device on this machine")
    return str(device_of(name))


def scaled_args(args: argparse.Namespace, factor: float, seed: int) -> argparse.Namespace:
    """The arguments of one run: every arm's steps times the budget factor, and this seed."""
    return argparse.Namespace(
        **{
            **vars(args),
            "warm_start_steps": scaled_steps(args.warm_start_steps, factor),
            "steps_per_path": scaled_steps(args.steps_per_path, factor),
            "seed": seed,
        }
    )


def training_plan(args: argparse.Namespace, budgets: list[tuple[str, float]]) -> dict[str, dict[str, int]]:
    """Batch-steps per arm of each budget (the headline grid's), for the epochs line before training."""
    levels, k = parse_grid(args.grids.split(",")[0])
    n_paths = k**levels
    plan = {}
    for label, factor in budgets:
        warm, per = scaled_steps(args.warm_start_steps, factor), scaled_steps(args.steps_per_path, factor)
        plan[label] = {
            "grid": warm + n_paths * per,
            "dense": warm + per,
            "dense same tokens": warm + n_paths * per,
        }
        if not args.no_dense_all_params:
            plan[label]["dense all params"] = warm + n_paths * per
    return plan


def device_record(device: str) -> dict:
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        return dict(device=f"{device} ({name})", dtype="bf16 autocast training, fp32 weights and scoring")
    return dict(device="cpu", dtype="fp32")


def spread(values: Sequence[float | None]) -> dict | None:
    """Mean, sample standard deviation, min and max over seeds (None if any seed has no value)."""
    if not values or any(v is None for v in values):
        return None
    vals = [float(v) for v in values]  # type: ignore[arg-type]
    std = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return dict(mean=statistics.fmean(vals), std=std, min=min(vals), max=max(vals), per_seed=vals)


def epochs_line(
    corpus_tokens: int, n_docs: int, plan: dict[str, dict[str, int]], tokens_per_step: int
) -> str:
    """What each budget implies BEFORE training: tokens per arm over the corpus's training tokens,
    one line per budget under one line for the corpus."""
    lines = [f"corpus: {n_docs:,} training documents, {corpus_tokens:,} tokens; epochs each budget implies:"]
    for label, arms in plan.items():
        eps = {arm: steps * tokens_per_step / corpus_tokens for arm, steps in arms.items()}
        note = "  <- corpus too small for this budget: data repeats" if max(eps.values()) > 1 else ""
        lines.append(f"  budget {label}: " + ", ".join(f"{a} {e:.2f}" for a, e in eps.items()) + note)
    return "\n".join(lines)


def summarize_budget(factor: float, seeds: list[int], runs: list[dict]) -> dict:
    """One budget's entry in dipaco.json's `budgets`, from the results of each seed's run."""
    first = runs[0]
    grid = f"dipaco {first['grid']}"
    models = first["models"]
    out: dict = dict(
        factor=factor,
        seeds=seeds,
        warm_start_steps=first["warm_start_steps"],
        steps_per_path=first["steps_per_path"],
        steps={name: m["steps"] for name, m in models.items()},
        tokens={name: m["tokens"] for name, m in models.items()},
        tokens_per_param_path=models[grid]["path_tokens"] / models[grid]["params_per_path"],
        tokens_per_param_same_tokens=models["dense same tokens"]["tokens"]
        / models["dense same tokens"]["params"],
        tokens_per_param_grid=models[grid]["tokens"] / models[grid]["params"],
    )
    out.update({key: spread([r.get(key) for r in runs]) for key in SPREAD_KEYS})
    # Epochs: each arm's tokens over the tokens of its own training data (the whole corpus; for a
    # grid's path, its shard, plus the base's pass over the corpus). Shards differ by seed (the
    # router's k-means), so the most-repeated path is the max over seeds.
    out["epochs"] = {name: max(r["models"][name]["epochs"] for r in runs) for name in models}
    out["epochs_most_repeated_path"] = max(r["models"][grid]["max_path_epochs"] for r in runs)
    out["data_repeats"] = max([*out["epochs"].values(), out["epochs_most_repeated_path"]]) > 1
    out["train_seconds"] = sum(m["train_seconds"] for r in runs for m in r["models"].values())
    return out


def crossover(xs: Sequence[float], ratios: Sequence[float]) -> dict:
    """Where the ratio crosses 1 against tokens per parameter (see the module docstring)."""
    pts = sorted(zip(xs, ratios, strict=True))
    for (x0, r0), (x1, r1) in zip(pts, pts[1:], strict=False):
        if (r0 - 1) * (r1 - 1) <= 0 and r0 != r1:
            t = (1 - r0) / (r1 - r0)
            x = math.exp(math.log(x0) + t * (math.log(x1) - math.log(x0)))
            return dict(reached=True, tokens_per_param=x, method="measured: interpolated between budgets")
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return dict(reached=False, tokens_per_param=None, method="one budget: no line to extrapolate")
    lx = [math.log10(x) for x, _ in pts]
    ys = [r for _, r in pts]
    mx, my = statistics.fmean(lx), statistics.fmean(ys)
    fit_all = sum((a - mx) * (b - my) for a, b in zip(lx, ys, strict=True)) / sum((a - mx) ** 2 for a in lx)
    slope = (ys[-1] - ys[-2]) / (lx[-1] - lx[-2])
    intercept = ys[-1] - slope * lx[-1]
    line = dict(slope_per_decade=slope, intercept=intercept, slope_per_decade_all_budgets=fit_all)
    if slope == 0 or abs((1 - intercept) / slope) > 30:
        return dict(
            reached=False, tokens_per_param=None, method="extrapolation: the line never meets 1", **line
        )
    x = 10 ** ((1 - intercept) / slope)
    where = "beyond the largest budget" if x > pts[-1][0] else "below the smallest budget"
    if pts[0][0] <= x <= pts[-1][0]:
        where = "inside the measured range, though no two budgets straddle 1"
    return dict(
        reached=False,
        tokens_per_param=x,
        method=f"extrapolation ({where}): straight line in log10 tokens per parameter, not measured",
        **line,
    )


def crossovers(budgets: dict[str, dict]) -> dict[str, dict]:
    xs = [b["tokens_per_param_same_tokens"] for b in budgets.values()]
    out = {}
    for key in CROSSOVER_RATIOS:
        means = [b[key]["mean"] if b[key] else None for b in budgets.values()]
        if any(m is None for m in means):
            continue
        out[key] = crossover(xs, means)  # type: ignore[arg-type]
    return out


def plot_budgets(out, budgets: dict[str, dict], found: dict[str, dict]) -> None:
    """composite / baseline against tokens per parameter of the dense-same-tokens model (log x),
    error bars the min..max over seeds; the crossover marked, or the extrapolation dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    xs = [b["tokens_per_param_same_tokens"] for b in budgets.values()]
    for (key, name), color in zip(CROSSOVER_RATIOS.items(), ("#1f77b4", "#d62728"), strict=True):
        if key not in found:
            continue
        s = [b[key] for b in budgets.values()]
        means = [v["mean"] for v in s]
        err = [
            [m - v["min"] for m, v in zip(means, s, strict=True)],
            [v["max"] - m for m, v in zip(means, s, strict=True)],
        ]
        ax.errorbar(xs, means, yerr=err, marker="o", capsize=3, color=color, label=f"composite / {name}")
        c = found[key]
        if c["reached"]:
            ax.axvline(c["tokens_per_param"], color=color, ls=":", lw=1)
            ax.annotate(
                f"crossover ≈ {c['tokens_per_param']:.3g} tokens/param",
                (c["tokens_per_param"], 1.0),
                textcoords="offset points",
                xytext=(5, 8),
                color=color,
                fontsize=8,
            )
        elif "slope_per_decade" in c:
            # from the second-largest budget (the line's first point) to where it meets 1, cut off
            # if that is absurdly far
            meet = c["tokens_per_param"] or max(xs) * 10
            line_x = [min(sorted(xs)[-2], meet), min(max(meet, max(xs)), max(xs) * 1e4)]
            line_y = [c["intercept"] + c["slope_per_decade"] * math.log10(x) for x in line_x]
            where = (
                f" meets 1 at ≈ {c['tokens_per_param']:.3g}" if c["tokens_per_param"] else " never meets 1"
            )
            ax.plot(
                line_x,
                line_y,
                ls="--",
                color=color,
                lw=1,
                label=f"extrapolated from the two largest budgets (not measured):{where}",
            )
            if c["tokens_per_param"] and c["tokens_per_param"] <= line_x[1]:
                ax.plot([c["tokens_per_param"]], [1.0], marker="x", color=color, ms=9)
    tops = [max(b[k]["mean"] for k in found if b[k]) if found else 1.0 for b in budgets.values()]
    for label, x, y in zip(budgets, xs, tops, strict=True):
        ax.annotate(
            f"budget ×{label}", (x, y), textcoords="offset points", xytext=(0, 8), ha="center", fontsize=7
        )
    ax.axhline(1.0, color="black", lw=1, label="composite = baseline")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per parameter (dense same tokens model: the grid's tokens, one path's parameters)")
    ax.set_ylabel("held-out perplexity ratio (below 1: DiPaCo wins)")
    seeds = sorted({s for b in budgets.values() for s in b["seeds"]})
    ax.set_title(f"DiPaCo composite against dense baselines by budget (seeds {seeds}: mean, min..max)")
    ax.legend(fontsize=7, loc="upper right", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _pm(s: dict | None) -> str:
    return "—" if s is None else f"{s['mean']:.3f} ± {s['std']:.3f}"


def budgets_table(budgets: dict[str, dict], found: dict[str, dict]) -> str:
    lines = [
        "| budget | base + per path steps | tokens/param (path; same tokens) | epochs (grid; most-repeated "
        "path; dense; same tokens; all params) | composite | dense | dense same tokens | dense all params "
        "| composite / same tokens | composite / all params | composite, every window re-routed "
        "| re-routed / same tokens | re-routed / all params |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, b in budgets.items():
        e = b["epochs"]
        grid = next(n for n in e if n.startswith("dipaco"))
        epochs = "; ".join(
            f"{v:.2f}"
            for v in (
                e[grid],
                b["epochs_most_repeated_path"],
                e["dense"],
                e["dense same tokens"],
                e.get("dense all params", math.nan),
            )
        )
        steps = f"{b['warm_start_steps']:,} + {b['steps_per_path']:,}"
        per_param = f"{b['tokens_per_param_path']:.1f}; {b['tokens_per_param_same_tokens']:.1f}"
        ppls = " | ".join(_pm(b.get(k)) for k in SPREAD_KEYS if k != "ratio")
        repeats = " (repeats)" if b["data_repeats"] else ""
        lines.append(f"| ×{label} | {steps} | {per_param} | {epochs}{repeats} | {ppls} |")
    lines.append("")
    for key, c in found.items():
        x = f"{c['tokens_per_param']:.3g} tokens/param" if c["tokens_per_param"] else "none"
        lines.append(f"crossover of composite / {CROSSOVER_RATIOS[key]}: {x} ({c['method']})")
    return "\n".join(lines)
