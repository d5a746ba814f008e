"""The budget sweeps of several `benchmarks.dipaco` runs as one: `python -m benchmarks.dipaco_combine
--out DIR RUN_DIR [RUN_DIR ...]`.

A sweep too long for one sitting (a GPU lent for minutes at a time) runs in parts, each with its own
`--budgets` and the same other flags; every part's DIR/dipaco_runs.json holds its finished (budget,
seed) runs. This reads them, refuses parts whose settings other than budgets and seeds differ, and
writes DIR/dipaco_budgets.json (the `budgets` and `crossover` entries of dipaco.json over all parts),
DIR/dipaco_budgets.png and DIR/dipaco_budgets.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.dipaco_budgets import budgets_table, crossovers, plot_budgets, summarize_budget

#: settings every part must share (the budget multiplies steps; seeds give the spread)
SAME = ("batch_size", "seq_len", "grid", "data", "device", "dtype")


def combine(parts: list[Path]) -> tuple[dict, dict, dict]:
    """(budgets, crossover, settings) over the parts' runs, budgets in increasing order."""
    runs: dict[float, list[dict]] = {}
    settings: dict | None = None
    for part in parts:
        file = part / "dipaco_runs.json"
        try:
            found = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"dipaco_combine: cannot read {file}: {e}") from None
        for label, seed_runs in found.items():
            for run in seed_runs:
                mine = {k: run.get(k) for k in SAME}
                if settings is None:
                    settings = mine
                elif mine != settings:
                    diff = {k: (settings[k], mine[k]) for k in SAME if settings[k] != mine[k]}
                    raise SystemExit(f"dipaco_combine: {file} was run with other settings: {diff}")
                runs.setdefault(float(label), []).append(run)
    if not runs:
        raise SystemExit("dipaco_combine: no finished runs in " + ", ".join(map(str, parts)))
    budgets = {}
    for factor in sorted(runs):
        seeds = [int(r["args"]["seed"]) for r in runs[factor]]
        budgets[f"{factor:g}"] = summarize_budget(factor, seeds, runs[factor])
    return budgets, crossovers(budgets), settings or {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.dipaco_combine", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("parts", type=Path, nargs="+", help="output folders of benchmarks.dipaco runs")
    args = p.parse_args(argv)
    budgets, found, settings = combine(args.parts)
    args.out.mkdir(parents=True, exist_ok=True)
    record = dict(budgets=budgets, crossover=found, settings=settings, parts=[str(x) for x in args.parts])
    (args.out / "dipaco_budgets.json").write_text(json.dumps(record, indent=1) + "\n")
    plot_budgets(args.out / "dipaco_budgets.png", budgets, found)
    text = budgets_table(budgets, found)
    (args.out / "dipaco_budgets.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
