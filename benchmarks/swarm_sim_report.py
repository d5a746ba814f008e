"""The tables and the plot of `benchmarks.swarm_sim` (its results in, files out)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def markdown(result: dict) -> str:
    sizes = [k for k in result if k != "config"]
    lines = [
        "| peers | sim h | plan s max (mean) | re-plans/h (fresh plan won) | coverage mean (min) "
        "| paths orphaned | modules orphaned (module-h) | throughput / oracle | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in sizes:
        r = result[k]
        lines.append(
            f"| {k} | {r['simulated_hours']:g} | {r['plan_seconds_max']:.2f} ({r['plan_seconds_mean']:.2f}) "
            f"| {r['replans_per_hour']:.1f} ({r['fresh_plans_won']}) "
            f"| {r['coverage_mean']:.4f} ({r['coverage_min']:.3f}) | {r['paths_orphaned']} "
            f"| {r['modules_orphaned']} ({r['module_orphaned_hours']:.2f}) "
            f"| {r['throughput_over_oracle']:.4f} | {r['wall_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [k for k in result if k != "config"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for style, k in zip(("-", "--", ":", "-."), sizes, strict=False):
        s = result[k]["series"]
        orphaned = result[k]["paths_orphaned"]
        axes[0].plot(s["t_hours"], s["coverage"], style, label=f"{k} peers ({orphaned} path orphan events)")
        axes[1].plot(s["t_hours"], np.array(s["online"]) / int(k), label=f"{k} peers")
        log = result[k]["replan_log"]
        axes[2].plot([r["t_hours"] for r in log], [r["plan_seconds"] for r in log], "o-", label=f"{k} peers")
    axes[0].set_title("path coverage (paths with >= 1 holder), each minute")
    axes[0].set_ylim(min(0.9, *(min(result[k]["series"]["coverage"]) - 0.01 for k in sizes)), 1.01)
    axes[0].set_ylabel("fraction of paths")
    axes[1].set_title("peers online / target N")
    axes[2].set_title(f"planner wall time per re-plan ({result['config']['cpus']} CPUs)")
    axes[2].set_ylabel("seconds")
    axes[2].axhline(60, color="k", ls="--", lw=1, label="60 s budget")
    axes[2].set_ylim(0, 65)
    for ax in axes:
        ax.set_xlabel("simulated hours")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plain(value):
    """numpy scalars as Python numbers, for json."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
