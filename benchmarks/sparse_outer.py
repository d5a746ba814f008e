"""Compressed outer gradients over many rounds: `python -m benchmarks.sparse_outer --out DIR`.

The WAN lab's model and data (`benchmarks.wan`; by default a smaller model, d_model 64, and H = 8
so that 100 outer rounds fit a CPU) trained by 4 replicas in one process with the project's own
inner loop, codecs, error feedback, aggregator and outer step (`benchmarks.sparse_outer_train`), so
that only the outer gradient's code and the outer step differ between runs:

* `diloco_fp32` — DiLoCo (fp32, P = 1, τ = 0, outer lr 0.7, Nesterov 0.9): the reference;
* `streaming_nf4` — Streaming DiLoCo with the nf4 codec, α = 0.5, DiLoCo's outer step;
* `sparse` — today's sparse codec (2%, 4-bit values, 1-byte indices), SparseLoCo's outer step: no
  momentum (error feedback accumulates in its place), α = 0, a larger lr;
* `sparse2bit` — SparseLoCo's recipe at Covenant-72B's byte budget (the top 92 of each chunk of
  4096, 2-bit values, Elias-Fano indices: 151x fewer bytes than fp32), same outer step;
  `sparse2bit_nesterov` the same codec under DiLoCo's momentum, to see what momentum does with
  error feedback; `sparse2bit_carry` the same with the steps a fragment trained since its Δ was sent
  carried onto its new copy (`ModuleSync.apply`'s `sent_local`), where α = 0 drops them;
* `dense_2bit` — MuLoCo's 2-bit dense code of every value with error feedback, α = 0 (its error
  feedback decay tuned too: `--tune_decays`);
* `diloco_dense_2bit` — the same code on DiLoCo's schedule (P = 1, τ = 0), as MuLoCo ran it; with
  parts of the model in another code: `diloco_dense_2bit_trunk4` (the trunk in nf4),
  `diloco_dense_2bit_vectors32` (every 1-D parameter unquantized), `diloco_dense_2bit_warm10` (the
  first 10 rounds in nf4);
  `streaming_fp32` — fp32 on the codec runs' streaming schedule (P = 4, τ = 1, α = 0): together they
  tell what the schedule costs from what the code costs; `streaming_nf4_carry` nf4 at α = 0 with the
  steps since the send carried, as `sparse2bit_carry`;
* `diloco_fp32_muon`, `dense_2bit_muon`, `diloco_dense_2bit_muon` — with Muon as the inner optimizer
  (MuLoCo's setting, the manifest's `inner.muon`); each is also compared with `diloco_fp32_muon`
  (`eval_loss_ratio_same_inner`: what the codec alone costs), which runs whenever one of them does.

Per run and seed (`--seeds`: each changes the initial weights and every replica's batch order) the
eval loss of replica 0's global copy on the run's eval documents, a curve of it every `--eval_every`
rounds, and the payload bytes each peer sent (the codecs' real payloads). `sparse_outer.json`:
`runs.<run>.{bytes_ratio, eval_loss_ratio, rounds, seeds}` — DiLoCo's bytes / the run's, and the
run's eval loss / DiLoCo's (mean over seeds of the per-seed ratio); `sparse_outer.png`: loss against
rounds and against bytes sent.

`--tune` first picks each tunable run's outer lr (and sparse2bit's density, dense_2bit's momentum,
and with `--tune_inner_lrs` every run's inner lr)
on a validation split (held-out training documents, never the eval documents nor trained on) at
`--tune_seed` (`--tune_runs` names the runs to tune, the others run as given), records every
candidate's loss and the pick, and then runs the picks at `--seeds`.
Density is picked among those within the record's byte budget (Covenant-72B's 146x fewer bytes than
fp32, 0.219 bits per number, counted on the codec's own layout: with Elias-Fano indices up to 95 of
each 4096); denser ones are tried and recorded as the trade-off, since more bytes always lose less.
Without it, the runs use the settings below as given (the earlier 4-round sweep's lr 8 for sparse).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from fractions import Fraction
from pathlib import Path

from benchmarks.sparse_outer_report import write_report
from benchmarks.sparse_outer_train import make_run_codec, train

#: DiLoCo's schedule: the whole model in one round (P = 1), applied at once (τ = 0), no mixing
DILOCO_SCHEDULE = dict(fragments=1, tau=0, alpha=0.0)
#: the 2-bit code on DiLoCo's schedule; its variants below differ from it in one option each
DILOCO_DENSE_2BIT = dict(
    codec="dense2bit", **DILOCO_SCHEDULE, lr=0.7, momentum=0.9, tune=("lr", "momentum", "decay")
)
RUNS: dict[str, dict] = {
    # the references are tuned too: DiLoCo's published lr (0.7, for H = 500) need not suit H = 8, and a
    # codec that beats an untuned baseline proves nothing
    "diloco_fp32": dict(codec="fp32", **DILOCO_SCHEDULE, lr=0.7, momentum=0.9, tune=("lr",)),
    "streaming_nf4": dict(codec="nf4", alpha=0.5, lr=0.7, momentum=0.9, tune=("lr",)),
    "sparse": dict(codec="sparse", alpha=0.0, lr=8.0, momentum=0.0, tune=("lr",)),
    "sparse2bit": dict(codec="sparse2bit", alpha=0.0, lr=8.0, momentum=0.0, tune=("lr", "density")),
    # the overlap's τ steps carried onto the new global copy instead of dropped (α = 0) or halved (α = 0.5)
    "sparse2bit_carry": dict(
        codec="sparse2bit", alpha=0.0, carry=True, lr=8.0, momentum=0.0, tune=("lr", "density")
    ),
    "streaming_nf4_carry": dict(codec="nf4", alpha=0.0, carry=True, lr=0.7, momentum=0.9, tune=("lr",)),
    "sparse2bit_nesterov": dict(codec="sparse2bit", alpha=0.0, lr=0.7, momentum=0.9, tune=("lr",)),
    # error feedback decay as a knob too: a dense code's rounding error is unbiased noise that a decay
    # below 1 partly forgets, where SparseLoCo's top-k rest is momentum-like and meant to fade
    "dense_2bit": dict(codec="dense2bit", alpha=0.0, lr=0.7, momentum=0.9, tune=("lr", "momentum", "decay")),
    # the 2-bit code on DiLoCo's schedule (P = 1, τ = 0), as MuLoCo ran it; and fp32 on the streaming
    # schedule of the codec runs, which tells what the schedule costs from what a code costs
    "diloco_dense_2bit": DILOCO_DENSE_2BIT,
    # MuLoCo's 2-bit runs leave embeddings and norms unquantized: here the trunk (tied embedding and
    # head, positions, final norm: a tenth of the values) goes in 4 bits, the blocks in 2
    "diloco_dense_2bit_trunk4": {**DILOCO_DENSE_2BIT, "trunk_codec": "nf4"},
    # MuLoCo's skip_norm_quantization: every 1-D parameter (norms, biases: 1.6% of the values) unquantized
    "diloco_dense_2bit_vectors32": {**DILOCO_DENSE_2BIT, "vector_codec": "fp32"},
    # the early rounds' large outer gradients in 4 bits, then 2 (the gap to fp32 is set by round 20-40)
    "diloco_dense_2bit_warm10": {**DILOCO_DENSE_2BIT, "warm_codec": "nf4", "warm_rounds": 10},
    "streaming_fp32": dict(codec="fp32", alpha=0.0, lr=0.7, momentum=0.9, tune=("lr",)),
    # MuLoCo: Muon inside (the manifest's inner.muon); its 2-bit result is with Muon, so the pair runs
    # with its own fp32 reference and each reports its ratio to it beside the one to AdamW's DiLoCo
    "diloco_fp32_muon": dict(codec="fp32", **DILOCO_SCHEDULE, lr=0.7, momentum=0.9, muon=True, tune=("lr",)),
    "dense_2bit_muon": dict(
        codec="dense2bit", alpha=0.0, lr=0.7, momentum=0.9, muon=True, tune=("lr", "momentum", "decay")
    ),
    "diloco_dense_2bit_muon": dict(
        codec="dense2bit",
        **DILOCO_SCHEDULE,
        lr=0.7,
        momentum=0.9,
        muon=True,
        tune=("lr", "momentum", "decay"),
    ),
}
#: a run's reference with the same inner optimizer (the codec's own cost), where not REFERENCE
SAME_INNER_REFERENCE = {
    name: "diloco_fp32_muon" for name in ("diloco_fp32_muon", "dense_2bit_muon", "diloco_dense_2bit_muon")
}
REFERENCE = "diloco_fp32"
#: what runs without --runs: sparse2bit_nesterov only on request (it costs two more runs)
DEFAULT_RUNS = ("diloco_fp32", "streaming_nf4", "sparse", "sparse2bit", "dense_2bit")


def _floats(text: str) -> list[float]:
    return [float(Fraction(x.strip())) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse_outer", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--runs",
        default=",".join(DEFAULT_RUNS),
        help=f"comma-separated, of {list(RUNS)} ({REFERENCE} always)",
    )
    p.add_argument("--seeds", default="1,2", help="initial weights and batch orders, one set of runs each")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--steps", type=int, default=800, help="inner steps of every replica (a multiple of H)")
    p.add_argument("--inner_steps", type=int, default=8, help="H")
    p.add_argument("--fragments", type=int, default=4, help="P of the streaming runs")
    p.add_argument(
        "--overlap_steps",
        type=int,
        default=None,
        help="τ of the streaming runs, below H/P (default: 1 where H/P > 1)",
    )
    p.add_argument("--d_model", type=int, default=64, help="the lab model's width (the lab's own: 256)")
    p.add_argument("--blocks", type=int, default=4, help="blocks of the lab's one module")
    p.add_argument("--error_feedback_decay", type=float, default=0.95)
    p.add_argument("--eval_docs", type=int, default=100, help="eval (and validation) documents scored")
    p.add_argument("--eval_every", type=int, default=20, help="rounds between points of the loss curve")
    p.add_argument("--tune", action="store_true", help="pick lr / momentum / density on the validation split")
    p.add_argument(
        "--tune_runs", default="", help="comma-separated runs --tune tunes (default: every tunable one)"
    )
    p.add_argument("--tune_seed", type=int, default=0)
    p.add_argument("--tune_steps", type=int, default=None, help="steps of a tuning run (default: --steps)")
    p.add_argument("--tune_lr_factors", default="0.5,1,2", help="× each tunable run's lr")
    p.add_argument("--tune_momenta", default="0,0.9")
    p.add_argument("--tune_decays", default="0.95,1", help="error feedback decay (runs that tune it)")
    p.add_argument("--tune_densities", default="1/128,1/64,92/4096", help="sparse2bit's kept share per chunk")
    p.add_argument(
        "--tune_inner_lrs",
        default="",
        help="inner (AdamW / Muon) peak lrs every run tries (default: none, the lab's --lr for all)",
    )
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    args.tune_runs = [r.strip() for r in args.tune_runs.split(",") if r.strip()]
    if stray := set(args.tune_runs) - set(args.runs) - {REFERENCE}:
        p.error(f"--tune_runs: {sorted(stray)} not among --runs")
    unknown = set(args.runs) - set(RUNS)
    if unknown:
        p.error(f"--runs: unknown {sorted(unknown)}; choose from {list(RUNS)}")
    for run in list(args.runs):  # a run's same-inner reference runs beside it
        ref = SAME_INNER_REFERENCE.get(run)
        if ref and ref not in args.runs:
            args.runs.insert(args.runs.index(run), ref)
    if REFERENCE not in args.runs:
        args.runs.insert(0, REFERENCE)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        args.tune_lr_factors, args.tune_momenta = _floats(args.tune_lr_factors), _floats(args.tune_momenta)
        args.tune_densities = _floats(args.tune_densities)
        args.tune_decays = _floats(args.tune_decays)
        args.tune_inner_lrs = _floats(args.tune_inner_lrs)
    except ValueError as e:
        p.error(f"--seeds / --tune_*: not a comma-separated list of numbers ({e})")
    if not args.seeds:
        p.error("--seeds: give at least one seed")
    args.tune_steps = args.tune_steps or args.steps
    if args.steps % args.inner_steps or args.tune_steps % args.inner_steps or args.blocks % args.fragments:
        p.error("--steps and --tune_steps must be multiples of --inner_steps, --blocks of --fragments")
    if args.overlap_steps is None:
        args.overlap_steps = min(1, args.inner_steps // args.fragments - 1)
    if not 0 <= args.overlap_steps < args.inner_steps // args.fragments:
        p.error(f"--overlap_steps must be below H/P = {args.inner_steps // args.fragments}")
    return args


def candidates(run: dict, args: argparse.Namespace) -> list[dict]:
    """The settings `--tune` tries for a run: its lr times each factor, × the other tuned knobs.

    Where momentum is tuned, each momentum's lrs keep the run's effective step lr / (1 - m): the
    steady update of (Nesterov) momentum m is lr / (1 - m) times the outer gradient, so lr 0.7 at
    0.9 is lr 7 without momentum. Scaling the same lrs across momenta (until session 25) tried
    momentum 0 only at a tenth of the step and never SparseLoCo's shape (no momentum, a large lr)."""
    knobs = run.get("tune", ())
    factors = args.tune_lr_factors if "lr" in knobs else [1.0]
    momenta = args.tune_momenta if "momentum" in knobs else [run["momentum"]]
    densities = args.tune_densities if "density" in knobs else [run.get("density")]
    decays = args.tune_decays if "decay" in knobs else [run.get("decay")]
    inner_lrs = args.tune_inner_lrs or [run.get("inner_lr")]  # every run's, where given at all
    effective = run["lr"] / (1 - run["momentum"])
    return [
        {
            **run,
            "lr": round(effective * (1 - m) * f, 6),
            "momentum": m,
            "density": d,
            "decay": e,
            "inner_lr": i,
        }
        for f, m, d, e, i in itertools.product(factors, momenta, densities, decays, inner_lrs)
    ]


def _settings(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "tune"}


def tunable(runs: dict[str, dict], args: argparse.Namespace) -> list[str]:
    """The runs `--tune` tunes: those with knobs to tune, of `--tune_runs` where given (the others run
    with the table's settings, e.g. a reference already tuned on the same schedule)."""
    return [n for n, r in runs.items() if r.get("tune") and (not args.tune_runs or n in args.tune_runs)]


def tune(pool, runs: dict[str, dict], args: argparse.Namespace) -> dict[str, dict]:
    """Every tunable run's candidates at the tune seed, scored on the validation split."""
    short = argparse.Namespace(**{**vars(args), "steps": args.tune_steps})
    futures = {
        name: [
            (c, pool.submit(train, _settings(c), short, args.tune_seed, "validation"))
            for c in candidates(runs[name], args)
        ]
        for name in tunable(runs, args)
    }
    out = {}
    for name, tried in futures.items():
        scored = [
            dict(_settings(c), validation_loss=f.result()["loss"], eligible=_within_budget(c))
            for c, f in tried
        ]
        best = min((c for c in scored if c["eligible"]), key=lambda c: c["validation_loss"])
        out[name] = dict(
            picked={k: best[k] for k in ("lr", "momentum", "density", "decay", "inner_lr")}, candidates=scored
        )
        print(
            f"tuned {name}: {out[name]['picked']} (validation loss {best['validation_loss']:.4f})",
            file=sys.stderr,
        )
    return out


#: the record's bytes: Covenant-72B sent 146x fewer than fp32 (0.219 bits per number)
RECORD_BYTES_RATIO = 146.0


def _within_budget(run: dict) -> bool:
    """A denser code always loses less, so density is picked within the record's byte budget, on
    the codec's exact bits per number (indices and scales included); denser candidates are tried
    and recorded, not picked."""
    if run.get("density") is None:
        return True
    spec = make_run_codec(run).spec
    return 32 / (8 * spec.wire_bytes_per_value) >= RECORD_BYTES_RATIO


def summarise(runs: dict[str, dict], results: dict[str, dict], args: argparse.Namespace) -> dict:
    """Per run: the JSON's ratios against DiLoCo, seed by seed and their mean."""
    ref = results[REFERENCE]
    out = {}
    for name, run in runs.items():
        per_seed = results[name]
        ratios = [per_seed[s]["loss"] / ref[s]["loss"] for s in per_seed]
        same = results.get(SAME_INNER_REFERENCE.get(name, REFERENCE), {})
        same_ratios = [per_seed[s]["loss"] / same[s]["loss"] for s in per_seed if s in same]
        sent = [per_seed[s]["payload_bytes_per_peer"] for s in per_seed]
        ref_sent = [ref[s]["payload_bytes_per_peer"] for s in per_seed]
        out[name] = dict(
            _settings(run),
            rounds=args.steps // args.inner_steps,
            seeds=list(args.seeds),
            eval_loss=sum(r["loss"] for r in per_seed.values()) / len(per_seed),
            eval_loss_ratio=sum(ratios) / len(ratios),
            eval_loss_ratio_per_seed=ratios,
            # × the fp32 run with the same inner optimizer: what the codec alone costs
            eval_loss_ratio_same_inner=sum(same_ratios) / len(same_ratios) if same_ratios else None,
            bytes_ratio=sum(ref_sent) / sum(sent),
            payload_bytes_per_peer=sum(sent) / len(sent),
            wire_bits_per_value_per_round=next(iter(per_seed.values()))["wire_bits_per_value_per_round"],
            per_seed={str(s): r for s, r in per_seed.items()},
        )
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {name: dict(RUNS[name]) for name in args.runs}
    started = time.monotonic()
    tuning: dict[str, dict] = {}
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        if args.tune:
            tuning = tune(pool, runs, args)
            for name, t in tuning.items():
                runs[name].update(t["picked"])
        futures = {
            (name, seed): pool.submit(train, _settings(run), args, seed, "eval")
            for name, run in runs.items()
            for seed in args.seeds
        }
        results: dict[str, dict] = {name: {} for name in runs}
        for (name, seed), future in futures.items():
            results[name][seed] = r = future.result()
            print(
                f"{name} seed {seed}: eval loss {r['loss']:.4f}, {r['cpu_seconds']:.0f} s CPU",
                file=sys.stderr,
            )
    given = argv if argv is not None else sys.argv[1:]
    report = dict(
        {k: v for k, v in vars(args).items() if k != "out"}, out=str(args.out), tuned=bool(args.tune),
        tuning=tuning, runs=summarise(runs, results, args), wall_seconds=time.monotonic() - started,
        command=" ".join(["python -m benchmarks.sparse_outer", *given]),
    )  # fmt: skip
    (args.out / "sparse_outer.json").write_text(json.dumps(report, indent=1))
    print(write_report(args.out, report))
    print(f"wrote {args.out}/sparse_outer.json, .md, .png in {report['wall_seconds']:.0f}s")


if __name__ == "__main__":
    main()
