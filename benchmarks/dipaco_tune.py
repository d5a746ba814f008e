"""DiPaCo's outer optimizer and H tuned on a validation split: `python -m benchmarks.dipaco_tune`.

Issue 31 item 4: the outer lr, outer momentum and inner steps H of the grid are picked on training
documents that no arm trains on (`benchmarks.dipaco --validation_docs N`), never on the held-out
documents whose perplexity is reported. Two modes:

* train (`--candidates 0.5:0.9:50,1.0:0.9:50`, each `outer_lr:outer_momentum:H`): trains the headline
  grid alone (no dense baselines) once per candidate and seed, at one budget, with every other flag
  of `benchmarks.dipaco`; writes each finished run to DIR/dipaco_tune_runs.json at once. Give the
  same --validation_docs, --data_files, --budgets and seeds as the `benchmarks.dipaco` run whose
  baselines it is compared with: both then hold out the same documents and read the same order.
* pick (`--pick DIR [DIR ...]`): reads every dipaco_tune_runs.json and dipaco_runs.json under the
  folders, groups the grids by (outer lr, momentum, H), picks the one with the lowest validation
  perplexity averaged over the seeds every candidate has, and reports it against the dense baselines
  of the same seeds: DIR/dipaco_tune.json (`candidates`, `pick`, `pick_ratio_same_tokens`,
  `default_ratio_same_tokens`) and DIR/dipaco_tune.md. The reported perplexities of the candidates
  not picked are listed too, but only the validation split decides.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from benchmarks import dipaco
from benchmarks.dipaco_budgets import parse_budgets, parse_seeds, resolve_device, scaled_args
from peer.model.tokenizer import ByteTokenizer
from peer.run.create import parse_grid

Key = tuple[float, float, int]


def parse_candidates(text: str) -> list[Key]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            lr, momentum, h = part.split(":")
            key = (float(lr), float(momentum), int(h))
        except ValueError:
            raise SystemExit(
                f"--candidates {part!r}: expected outer_lr:outer_momentum:H, e.g. 0.7:0.9:50"
            ) from None
        if key[0] <= 0 or not 0 <= key[1] < 1 or key[2] < 1:
            raise SystemExit(f"--candidates {part!r}: outer lr > 0, 0 <= momentum < 1 and H >= 1")
        out.append(key)
    return out


def parse_args(argv: list[str] | None = None):
    p = dipaco.build_parser("python -m benchmarks.dipaco_tune", __doc__.splitlines()[0])
    p.add_argument("--candidates", default="", help="outer_lr:outer_momentum:H, comma-separated (train mode)")
    p.add_argument("--pick", nargs="+", type=Path, default=None, help="folders of finished runs (pick mode)")
    return p.parse_args(argv)


def train(args) -> int:
    candidates, budgets, seeds = (
        parse_candidates(args.candidates),
        parse_budgets(args.budgets),
        parse_seeds(args.seeds),
    )
    if not candidates or len(budgets) != 1 or not args.validation_docs:
        raise SystemExit("train mode needs --candidates, one --budgets value and --validation_docs > 0")
    (label, factor), grid = budgets[0], parse_grid(args.grids.split(",")[0])
    args.device = resolve_device(args.device)
    if args.threads:
        dipaco.torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    spec, train_docs, held_out, validation = dipaco.load_data(args)
    tok, started, runs = ByteTokenizer(), time.monotonic(), []
    n_tokens = dipaco.corpus_tokens(train_docs, tok)
    for seed in seeds:
        order = list(train_docs)
        dipaco.random.Random(f"train order {seed}").shuffle(order)  # as benchmarks.dipaco orders a seed
        for lr, momentum, h in candidates:
            one = scaled_args(args, factor, seed)
            one.outer_lr, one.outer_momentum, one.inner_steps = lr, momentum, h
            tag = f"x{label} seed {seed} lr {lr} momentum {momentum} H {h}"
            b = dipaco.Bench(one, order, held_out, tok, n_tokens, tag, started, validation=validation)
            dipaco.train_grid(
                b, dipaco.sim_config(one, *grid, dipaco.inner_config(one)), dipaco.dipaco_options(one)
            )
            (model,) = b.m.models.values()
            runs.append(
                dict(
                    budget=label,
                    seed=seed,
                    outer_lr=lr,
                    outer_momentum=momentum,
                    inner_steps=h,
                    val_ppl=model["val_ppl"],
                    composite_ppl=next(iter(b.m.evals.values())).ppl,
                    train_seconds=next(iter(b.m.timings.values())),
                    validation_docs=len(validation),
                    eval_docs=len(held_out),
                    batch_size=one.batch_size,
                    d_model=one.d_model,
                    data=spec.model_dump(),
                )
            )
            (args.out / "dipaco_tune_runs.json").write_text(json.dumps(runs, indent=1) + "\n")
    return 0


def records(folders: list[Path]) -> tuple[list[dict], dict[int, list[dict]]]:
    """(every grid run as a record, the dense baselines of each seed: one per run of the seed) from
    the folders' run files."""
    grids, baselines = [], {}
    for folder in folders:
        for f in sorted(folder.rglob("dipaco_tune_runs.json")):
            grids += json.loads(f.read_text())
        for f in sorted(folder.rglob("dipaco_runs.json")):
            for label, runs in json.loads(f.read_text()).items():
                for r in runs:
                    a = r["args"]
                    grids.append(
                        dict(
                            budget=label,
                            seed=int(a["seed"]),
                            outer_lr=float(a["outer_lr"]),
                            outer_momentum=float(a["outer_momentum"]),
                            inner_steps=int(a["inner_steps"]),
                            val_ppl=r["composite_val_ppl"],
                            composite_ppl=r["composite_ppl"],
                            batch_size=r["batch_size"],
                        )
                    )
                    baselines.setdefault(int(a["seed"]), []).append(
                        dict(
                            budget=label,
                            dense_same_tokens_ppl=r["dense_same_tokens_ppl"],
                            dense_all_params_ppl=r["dense_all_params_ppl"],
                            dense_ppl=r["dense_ppl"],
                        )
                    )
    return grids, baselines


def pick(args) -> int:
    grids, baselines = records(args.pick)
    if not grids or not baselines:
        raise SystemExit(f"--pick {' '.join(map(str, args.pick))}: no grid runs or no dense baselines found")
    for what in ("budget", "batch_size"):
        base = {b[what] for runs in baselines.values() for b in runs} if what == "budget" else set()
        if len({g[what] for g in grids} | base) > 1:
            raise SystemExit(f"--pick: the runs differ in {what}; pick among runs of one setting")
    if any(g["val_ppl"] is None for g in grids):
        raise SystemExit("--pick: a run has no validation perplexity (run it with --validation_docs)")
    seeds = sorted(baselines)
    # A setting or baseline run more than once (several calls) counts as the mean of its runs
    dense = {s: statistics.fmean(b["dense_same_tokens_ppl"] for b in baselines[s]) for s in seeds}
    by_key: dict[Key, dict[int, list[dict]]] = {}
    for g in grids:
        key = (g["outer_lr"], g["outer_momentum"], g["inner_steps"])
        by_key.setdefault(key, {}).setdefault(g["seed"], []).append(g)
    rows = []
    for key, per_seed in sorted(by_key.items()):
        if set(seeds) - set(per_seed):
            continue  # a candidate is compared only on every seed the baselines have
        val = [statistics.fmean(g["val_ppl"] for g in per_seed[s]) for s in seeds]
        reported = [statistics.fmean(g["composite_ppl"] for g in per_seed[s]) for s in seeds]
        ratios = [r / dense[s] for r, s in zip(reported, seeds, strict=True)]
        rows.append(
            dict(
                outer_lr=key[0],
                outer_momentum=key[1],
                inner_steps=key[2],
                runs_per_seed=[len(per_seed[s]) for s in seeds],
                val_ppl=val,
                val_ppl_mean=statistics.fmean(val),
                composite_ppl=reported,
                ratio_same_tokens=ratios,
                ratio_same_tokens_mean=statistics.fmean(ratios),
            )
        )
    best = min(rows, key=lambda r: r["val_ppl_mean"])
    # benchmarks.dipaco's own outer optimizer and H (the parser's defaults, or as given)
    ours = (args.outer_lr, args.outer_momentum, args.inner_steps)
    default = next((r for r in rows if (r["outer_lr"], r["outer_momentum"], r["inner_steps"]) == ours), None)
    out = dict(
        seeds=seeds,
        budget=grids[0]["budget"],
        baselines=baselines,
        candidates=rows,
        pick=best,
        pick_ratio_same_tokens=best["ratio_same_tokens_mean"],
        default_ratio_same_tokens=default["ratio_same_tokens_mean"] if default else None,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dipaco_tune.json").write_text(json.dumps(out, indent=1) + "\n")
    text = tune_table(out, dense)
    (args.out / "dipaco_tune.md").write_text(text)
    print(text)
    return 0


def tune_table(out: dict, dense: dict[int, float]) -> str:
    """dipaco_tune.md: every candidate's validation and reported perplexities, the pick marked, over
    `dense` (each seed's dense same tokens perplexity, the mean of its runs)."""
    lines = [
        f"# DiPaCo's outer optimizer tuned on a validation split (budget ×{out['budget']}, "
        f"seeds {out['seeds']})",
        "",
        "Dense same tokens (the mean of its runs): "
        + ", ".join(f"seed {s} {v:.3f}" for s, v in dense.items()),
        "",
        "| outer lr | momentum | H | runs per seed | validation ppl (per seed) | mean "
        "| reported ppl (per seed) | composite / dense same tokens |",
        "|---:|---:|---:|---:|---|---:|---|---:|",
    ]
    for r in out["candidates"]:
        mark = " **(pick)**" if r is out["pick"] else ""
        lines.append(
            f"| {r['outer_lr']} | {r['outer_momentum']} | {r['inner_steps']}{mark} | "
            + ", ".join(map(str, r["runs_per_seed"]))
            + " | "
            + ", ".join(f"{v:.3f}" for v in r["val_ppl"])
            + f" | {r['val_ppl_mean']:.3f} | "
            + ", ".join(f"{v:.3f}" for v in r["composite_ppl"])
            + f" | {r['ratio_same_tokens_mean']:.3f} ("
            + ", ".join(f"{v:.3f}" for v in r["ratio_same_tokens"])
            + ") |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return pick(args) if args.pick else train(args)


if __name__ == "__main__":
    raise SystemExit(main())
