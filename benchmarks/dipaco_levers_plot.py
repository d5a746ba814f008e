"""The DiPaCo crossover by two routes, one picture: `python -m benchmarks.dipaco_levers_plot --out PNG
BUDGETS_JSON LEVERS_JSON`.

BUDGETS_JSON is a `benchmarks.dipaco_combine` record (d=64, budgets x1 to x8 on data no arm
repeats); LEVERS_JSON holds the arms of `benchmarks/dipaco_levers_device.sh` at one budget
(`{"arms": {name: {tokens_per_param_same_tokens, ratio_same_tokens, ...}}}`). Both place composite /
dense-same-tokens against tokens per parameter: a larger budget at one width (the budget curve) and fewer
parameters at one budget (the width arms). If tokens per parameter were what closes the gap, the
width arms would fall on the budget curve.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def width_points(arms: dict) -> dict[int, list[tuple[float, float]]]:
    """d_model -> [(tokens per parameter, ratio)] over the `width_D_seed_S` arms."""
    out: dict[int, list[tuple[float, float]]] = {}
    for name, arm in arms.items():
        if name.startswith("width_"):
            width = int(name.split("_")[1])
            out.setdefault(width, []).append((arm["tokens_per_param_same_tokens"], arm["ratio_same_tokens"]))
    return dict(sorted(out.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.dipaco_levers_plot", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("budgets", type=Path)
    p.add_argument("levers", type=Path)
    args = p.parse_args(argv)
    budgets = json.loads(args.budgets.read_text())["budgets"]
    arms = json.loads(args.levers.read_text())["arms"]
    fig, ax = plt.subplots(figsize=(9, 5))
    xs = [b["tokens_per_param_same_tokens"] for b in budgets.values()]
    ys = [b["ratio_same_tokens"]["mean"] for b in budgets.values()]
    lo = [b["ratio_same_tokens"]["mean"] - b["ratio_same_tokens"]["min"] for b in budgets.values()]
    hi = [b["ratio_same_tokens"]["max"] - b["ratio_same_tokens"]["mean"] for b in budgets.values()]
    ax.errorbar(
        xs,
        ys,
        yerr=[lo, hi],
        marker="o",
        capsize=3,
        label=f"d=64, budget {' / '.join('x' + b for b in budgets)} (more steps and tokens)",
    )
    for x, y, label in zip(xs, ys, budgets, strict=True):
        ax.annotate(f"x{label}", (x, y), textcoords="offset points", xytext=(4, 6), fontsize=8)
    points = width_points(arms)
    wx = [statistics.fmean(x for x, _ in pts) for pts in points.values()]
    wy = [statistics.fmean(y for _, y in pts) for pts in points.values()]
    ax.plot(wx, wy, marker="s", color="tab:orange", label="budget x2.5, d=64 / 32 / 16 (fewer parameters)")
    for (width, pts), x in zip(points.items(), wx, strict=True):
        ax.vlines(x, min(y for _, y in pts), max(y for _, y in pts), color="tab:orange")
        ax.annotate(
            f"d={width}",
            (x, statistics.fmean(y for _, y in pts)),
            textcoords="offset points",
            xytext=(4, -12),
            fontsize=8,
        )
    ax.axhline(1.0, color="black", lw=1, label="composite = dense same tokens")
    ax.axhline(0.95, color="gray", lw=1, ls=":", label="the issue's target 0.95")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per parameter (dense same tokens model)")
    ax.set_ylabel("composite / dense same tokens (held-out ppl)")
    ax.set_title(
        "DiPaCo 2x2 on unique real text (H100, seeds 1 and 2):\n"
        "the budget closes the gap, model size does not"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
