"""Both runs of every `benchmarks.byzantine` suite in one table: `python -m benchmarks.byzantine_report
--runs DIR1 DIR2 --out DIR`.

Each DIRn holds one folder per suite (`delta`, `inbound`, `protocol`), each the `--out` of one
`python -m benchmarks.byzantine --suite S` invocation (every suite fits the 15 minutes a benchmark
may take; all of them at once would not). Writes DIR/byzantine.json (every attack and arm with its
ratio to the honest runs of the same invocation, per run), DIR/byzantine.md and DIR/byzantine.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.byzantine import SUITES, TOLERANCE


def load(run: Path) -> dict:
    """attack -> aggregator -> result (with its ratio), and the honest baselines, of one run."""
    out: dict = {"attacks": {}, "honest": {}, "seconds": 0.0}
    for suite in SUITES:
        path = run / suite / "byzantine.json"
        if not path.is_file():
            continue
        report = json.loads(path.read_text())
        out["honest"][suite] = [report["honest_start"]["eval_loss"], report["honest_end"]["eval_loss"]]
        out["seconds"] += report.get("seconds", 0.0)
        for attack, arms in report["attacks"].items():
            out["attacks"][attack] = {k: v for k, v in arms.items() if isinstance(v, dict)}
    return out


def combine(runs: list[Path]) -> dict:
    loaded = [load(r) for r in runs]
    attacks: dict = {}
    for run in loaded:
        for attack, arms in run["attacks"].items():
            for aggregator, r in arms.items():
                entry = attacks.setdefault(attack, {}).setdefault(
                    aggregator, {"ratio": [], "eval_loss": [], "kept_eval_loss": []}
                )
                entry["ratio"].append(r["ratio"])
                entry["eval_loss"].append(r["eval_loss"])
                entry["kept_eval_loss"].append(r["kept_eval_loss"])
    for arms in attacks.values():
        robust = [max(v["ratio"]) for a, v in arms.items() if a != "mean"]
        arms["robust_ratio_max"] = max(robust)
        arms["within_5_percent"] = max(robust) <= TOLERANCE
    return {
        "runs": [str(r) for r in runs],
        "honest_eval_loss": [run["honest"] for run in loaded],
        "seconds": [round(run["seconds"], 1) for run in loaded],
        "attacks": attacks,
    }


def table(report: dict) -> str:
    runs = len(report["runs"])
    head = " | ".join(f"run {i + 1}" for i in range(runs))
    rows = [f"| attack | aggregator | eval loss / honest: {head} | keeper's copy / honest | within 5% |",
            "|---|---|" + "---:|" * runs + "---:|---|"]  # fmt: skip
    for attack, arms in report["attacks"].items():
        for aggregator, v in arms.items():
            if not isinstance(v, dict):
                continue
            ratios = " | ".join(f"{r:.3f}" for r in v["ratio"])
            kept = max(
                k / (e / r) for k, e, r in zip(v["kept_eval_loss"], v["eval_loss"], v["ratio"], strict=True)
            )
            verdict = (
                "(plain mean)"
                if aggregator == "mean"
                else ("yes" if max(v["ratio"]) <= TOLERANCE else "**no**")
            )
            rows.append(f"| {attack} | {aggregator} | {ratios} | {kept:.3f} | {verdict} |")
    return "\n".join(rows)


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, series = [], [[] for _ in report["runs"]]
    colors = []
    for attack, arms in report["attacks"].items():
        for aggregator, v in arms.items():
            if isinstance(v, dict):
                labels.append(f"{attack} / {aggregator}")
                colors.append("tab:gray" if aggregator == "mean" else "tab:blue")
                for i, r in enumerate(v["ratio"]):
                    series[i].append(min(r, 100.0))
    fig, ax = plt.subplots(figsize=(9, max(4, 0.28 * len(labels))))
    ys = range(len(labels))
    for i, values in enumerate(series):
        ax.scatter(values, [y + 0.15 * i for y in ys], c=colors, marker="o" if i == 0 else "s", s=18,
                   label=f"run {i + 1}")  # fmt: skip
    ax.axvline(1.0, color="k", lw=1)
    ax.axvline(TOLERANCE, color="k", lw=1, ls="--")
    ax.set_xscale("log")
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("worst honest peer's eval loss / honest run's (log; capped at 100); dashed: +5%")
    ax.set_title("Hostile peers in real runs: robust arms blue, plain mean gray")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "byzantine.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.byzantine_report", description=__doc__.splitlines()[0]
    )
    p.add_argument("--runs", type=Path, nargs="+", required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = combine(args.runs)
    text = table(report)
    (args.out / "byzantine.json").write_text(json.dumps(report, indent=2))
    (args.out / "byzantine.md").write_text(f"# Hostile peers in real runs\n\n{text}\n")
    plot(report, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
