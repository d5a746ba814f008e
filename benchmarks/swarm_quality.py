"""The live swarm's quality against three dense baselines: `python -m benchmarks.swarm_quality --out DIR`.

What a researcher gets from a real run, measured: the script creates a warm-started run over the
corpus (the built-in one, or `--data_files`), trains it on a local swarm of real processes (a
bootstrap node serving the run and its base model, and one peer per path, each fetching the base by
hash and averaging its modules with the other holders over the DHT), evaluates the composite the way
`pathswarm eval` does, and trains in the same script, on the same held-out documents and routing:

* `dense_ppl`: path-size, from the run's base for as many steps as one path trained (DiPaCo's
  comparison at equal per-path compute; the target is composite <= 0.92 x this);
* `dense_same_tokens_ppl`: path-size, from the run's base for as many steps as all paths together
  (the grid's tokens): DiPaCo earns its keep per token only if the composite beats this one;
* `dense_all_params_ppl`: the dense shape whose parameter count is closest to all the grid's
  modules together (`benchmarks.dipaco.all_params_shape`), from scratch for the grid's whole
  batch-step budget, base included (the same tokens as the grid; DiPaCo's headline is composite
  <= 1.0 x this).

With `--reroute_after_rounds R` (default 6, half the rounds) it also trains a second swarm of the
same run with DiPaCo's re-routing phase: the run pauses after round R (its peers checkpoint and
stop; the bootstrap stays up), `pathswarm run reroute` with the creator's key scores training
documents with every path from the checkpoints and publishes a router that sends each to its best
path (or says that it would not pay and publishes nothing), and the peers resume, take the new
router at once and train their new shards to the end. Its composite (`composite_rerouted_ppl`,
evaluated with the router the peers trained with last) stands beside the plain swarm's: whether
re-routing pays. (The tool re-routes a run that keeps training too, fetching the paths from their
holders: tests/test_reroute.py. Here rounds last 3 s, shorter than the scoring; in a real run they
last minutes.)

Settings default to `benchmarks.dipaco`'s (the in-process simulator), so the two composite/dense
ratios can be read side by side. Writes DIR/swarm_quality.json, .png and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see benchmarks/dipaco.py

import torch

from benchmarks.dipaco import all_params_shape, dataset_spec, n_parameters
from benchmarks.dipaco_report import TARGET_RATIO, shared_fraction
from dht.identity import load_identity
from peer.cli.local_swarm import LOOPBACK, LocalSwarm
from peer.config import InnerOptimizerConfig, OuterOptimizerConfig, SyncConfig
from peer.data.batches import encode_document
from peer.data.sources import eval_documents, load_documents, split_of
from peer.model.base import base_model
from peer.model.grid import ModelConfig
from peer.model.route import route_documents
from peer.model.tokenizer import ByteTokenizer
from peer.model.transformer import PathModel
from peer.offline.evaluation import evaluate
from peer.offline.grid_checkpoints import assemble_grid, path_steps, read_checkpoints
from peer.offline.simulate import DenseTrainer, SimConfig
from peer.offline.warm_start import make_base
from peer.run.create import RunOptions, build_manifest
from peer.run.rebuild import make_route
from peer.run.record import save_record, sign_manifest
from peer.run.router_versions import router_trained_with

RUN = "quality"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.swarm_quality", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data_files", default=None, help="glob of local .txt (one doc per line) or .jsonl files")
    p.add_argument("--builtin_docs", type=int, default=6000)
    p.add_argument("--grid", default="2x2")
    p.add_argument("--steps_per_path", type=int, default=600)
    p.add_argument("--warm_start_steps", type=int, default=200)
    p.add_argument("--inner_steps", type=int, default=50, help="H")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--max_eval_docs", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout_seconds", type=float, default=900.0, help="for the swarm's training")
    p.add_argument(
        "--reroute_after_rounds",
        type=int,
        default=6,
        help="also train a swarm re-routed live after this many rounds (0: only the plain swarm)",
    )
    p.add_argument("--reroute_docs", type=int, default=1000, help="training documents the re-routing scores")
    p.add_argument("--work_dir", type=Path, default=None, help="keep the run, logs and checkpoints here")
    return p.parse_args(argv)


def create_run(args: argparse.Namespace, folder: Path):
    """The run, as `pathswarm run create --warm_start_steps` makes it, with the simulator's shapes."""
    levels, k = (int(x) for x in args.grid.split("x"))
    model = ModelConfig(d_model=64, n_heads=4, d_ff=256, max_seq_len=max(128, args.seq_len + 1),
                        n_levels=levels, modules_per_level=k, blocks_per_module=1)  # fmt: skip
    dataset = dataset_spec(args)
    inner = InnerOptimizerConfig(lr=args.lr, warmup_steps=50, total_steps=args.steps_per_path)
    options = RunOptions(
        name=RUN,
        seq_len=args.seq_len,
        seed=args.seed,
        warm_start_steps=args.warm_start_steps,
        warm_start_batch_size=args.batch_size,
    )
    tok = ByteTokenizer()
    base, ref = make_base(options, model, dataset, tok, folder / "artifacts", inner)
    manifest = build_manifest(
        RUN, model, dataset, seed=args.seed, seq_len=args.seq_len, inner=inner,
        outer=OuterOptimizerConfig(lr=0.7, momentum=0.9), sync=SyncConfig(inner_steps=args.inner_steps),
        base=base, base_ref=ref,
    )  # fmt: skip
    key, _ = load_identity(folder / "creator.key")  # `run reroute` signs router versions with it
    record = sign_manifest(manifest, key)
    save_record(record, folder / "manifest.json")
    return manifest, base


def train_swarm(
    args: argparse.Namespace, manifest, folder: Path, reroute_after: int = 0
) -> tuple[list[Path], float, dict]:
    """The swarm's training. With `reroute_after` the run pauses after that many rounds (its peers
    checkpoint and stop, the bootstrap stays), `pathswarm run reroute` scores the paths from the
    checkpoints and publishes a router, and the peers resume on their re-routed shards to the end.
    Returns the peers' checkpoint folders, the swarm's seconds and what the re-routing said."""
    n = manifest.model.n_paths
    rounds = args.steps_per_path // args.inner_steps
    tag = "rerouted" if reroute_after else "plain"
    ckpts = [folder / tag / f"p{i}" for i in range(n)]
    rerouted: dict = {}
    started = time.monotonic()
    # peers of a run over local files are given the manifest (a run from the swarm may not name
    # local files outside --data_root); on the built-in corpus they join by name and fetch the base
    local = ["--manifest_path", str(folder / "manifest.json")] if args.data_files else []
    with LocalSwarm(folder / f"logs-{tag}") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(folder / "manifest.json")])

        def train(upto: int, phase: str) -> None:
            for i in range(n):
                swarm.start_peer(f"p{i}{phase}", [*local,
                    "--run", RUN, "--path", str(i), "--checkpoint_dir", str(ckpts[i]),
                    "--max_rounds", str(upto), "--wait_for_peers", str(n),
                    "--batch_size", str(args.batch_size), "--torch_threads", "1",
                    "--rotate_every_rounds", "0", "--heartbeat_seconds", "2",
                    *(["--resume"] if phase else []),
                ])  # fmt: skip
            for i in range(n):
                left = max(60.0, args.timeout_seconds - (time.monotonic() - started))
                if (code := swarm.wait(f"p{i}{phase}", timeout=left)) != 0:
                    log = swarm.log_path(f"p{i}{phase}").read_text()[-2000:]
                    raise SystemExit(f"peer p{i}{phase} exited with {code}: {log}")

        if not reroute_after:
            train(rounds, "")
        else:
            train(reroute_after, "")
            swarm.spawn("reroute", ["run", "reroute", "--manifest_path", str(folder / "manifest.json"),
                "--identity_path", str(folder / "creator.key"), "--initial_peers", *swarm.initial_peers,
                "--host_maddrs", LOOPBACK, "--switch_after_rounds", "0", "--docs", str(args.reroute_docs),
                "--eval_docs", "100", "--serve_seconds", str(args.timeout_seconds),
                "--score_tokens", str(4 * args.seq_len), "--checkpoints", *map(str, ckpts),
            ])  # fmt: skip
            log = swarm.log_path("reroute")
            wait_for_text(
                log, ("peer(s) switched", "not published"), swarm.procs["reroute"], args.timeout_seconds
            )
            train(rounds, "-resumed")
            rerouted = _reroute_said(log.read_text(), swarm.log_path("p0-resumed").read_text())
    return ckpts, time.monotonic() - started, rerouted


def wait_for_text(log: Path, texts: tuple[str, ...], proc, timeout: float) -> None:
    """Until `log` holds one of `texts` (the tool published, or said why not), or its process ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if any(t in text for t in texts) or proc.poll() is not None:
            return
        time.sleep(0.5)
    raise SystemExit(f"pathswarm run reroute said nothing in {timeout:.0f} s")


def _reroute_said(log: str, peer_log: str) -> dict:
    """What `run reroute` printed (documents moved, held-out losses now) and when p0 switched."""
    said: dict = {}
    m = re.search(r"held-out loss from ([\d.]+) to ([\d.]+) .*: not published", log)
    if m is not None:  # the tool found that the new router would not pay, and said so
        return dict(router_version=0, not_published=True, held_out_loss_now=float(m[1]),
                    held_out_loss_rerouted=float(m[2]))  # fmt: skip
    m = re.search(r"router version (\d+): (\d+) of (\d+) training documents change path; .* ([\d.]+)x", log)
    if m is None:
        raise SystemExit(
            "pathswarm run reroute published no router before the peers finished (a smaller "
            f"--reroute_after_rounds or --reroute_docs gives it time): {log[-1500:]}"
        )
    said.update(router_version=int(m[1]), documents_changed=int(m[2]), documents_scored=int(m[3]),
                rerouted_balance=float(m[4]))  # fmt: skip
    m = re.search(r"routed as now ([\d.]+), re-routed ([\d.]+), best path per document ([\d.]+)", log)
    if m:
        said.update(held_out_loss_now=float(m[1]), held_out_loss_rerouted=float(m[2]),
                    held_out_loss_best_path=float(m[3]))  # fmt: skip
    m = re.search(r"router version \d+ from round (\d+)", peer_log)  # the resumed peer's log
    said["p0_switched_at_round"] = int(m[1]) if m else None
    return said


def dense_from_base(args, manifest, base, train: list[str], tok, steps: int) -> PathModel:
    """Path-size dense: the base (path 0's modules, a dense model of one path) trained on."""
    model = base_model(manifest.model, base)
    sim = SimConfig.from_manifest(manifest, batch_size=args.batch_size)
    return DenseTrainer(sim, train, tok, steps, model=model, desc="dense").train(steps)


def dense_all_params(args, manifest, train: list[str], tok, steps: int) -> PathModel:
    shape = all_params_shape(manifest.model)
    sim = SimConfig.from_manifest(manifest, batch_size=args.batch_size).model_copy(update={"model": shape})
    model = PathModel(shape, (0,), seed=args.seed)
    return DenseTrainer(sim, train, tok, steps, model=model, desc="dense all params").train(steps)


def plot(out: Path, r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [
        "composite (live swarm)",
        "dense (path size)",
        "dense (path size,\nthe grid's tokens)",
        "dense (all params)",
    ]
    ppls = [r["composite_ppl"], r["dense_ppl"], r["dense_same_tokens_ppl"], r["dense_all_params_ppl"]]
    colors = ["#1f77b4", "#888888", "#777777", "#555555"]
    if "composite_rerouted_ppl" in r:
        names.insert(1, "composite,\n" + _rerouted_label(r).replace(": ", ":\n"))
        ppls.insert(1, r["composite_rerouted_ppl"])
        colors.insert(1, "#2ca02c")
    fig, ax = plt.subplots(figsize=(1.9 * len(names) + 1.5, 4.5))
    bars = ax.bar(names, ppls, color=colors)
    ax.bar_label(bars, labels=[f"{p:.3f}" for p in ppls])
    ax.axhline(TARGET_RATIO * r["dense_ppl"], ls="--", color="red", lw=1, label=f"{TARGET_RATIO} x dense")
    ax.set_ylabel("held-out perplexity (tokens after the first 32)")
    ax.set_ylim(0, max(ppls) * 1.25)
    ax.set_title(
        f"{r['grid']} live swarm: {r['warm_start_steps']} base steps, then {r['steps_per_path']} per path"
    )
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _rerouted_label(r: dict) -> str:
    if r["reroute"].get("not_published"):
        return f"second swarm: the re-routing at round {r['reroute_after_rounds']} declined"
    return f"re-routed after round {r['reroute_after_rounds']}"


def verdict(ratio: float, target: float) -> str:
    return "met" if ratio <= target else "missed"


def table(r: dict) -> str:
    rows = [
        "| model | params | batch-steps | held-out ppl | composite / this |",
        "|---|---:|---:|---:|---:|",
        f"| composite (live swarm, {r['grid']}) | {r['grid_params']:,} | {r['warm_start_steps']} + "
        f"{r['paths']} × {r['steps_per_path']} | {r['composite_ppl']:.3f} | — |",
        *(
            [
                f"| composite (live swarm, {_rerouted_label(r)}) | "
                f"{r['grid_params']:,} | same | {r['composite_rerouted_ppl']:.3f} | — |"
            ]
            if "composite_rerouted_ppl" in r
            else []
        ),
        f"| dense, path size, from the base | {r['path_params']:,} | {r['warm_start_steps']} + "
        f"{r['dense_steps']} | {r['dense_ppl']:.3f} | {r['ratio']:.3f} |",
        f"| dense, path size, from the base, the grid's tokens | {r['path_params']:,} | "
        f"{r['warm_start_steps']} + {r['dense_same_tokens_steps']} | {r['dense_same_tokens_ppl']:.3f} "
        f"| {r['ratio_same_tokens']:.3f} |",
        f"| dense, all params, from scratch | {r['dense_all_params_params']:,} "
        f"| {r['dense_all_params_steps']} | {r['dense_all_params_ppl']:.3f} | {r['ratio_all_params']:.3f} |",
        "",
        f"composite / dense: {r['ratio']:.3f} (target <= {TARGET_RATIO}: "
        f"{verdict(r['ratio'], TARGET_RATIO)}); composite / dense same tokens: {r['ratio_same_tokens']:.3f} "
        f"(target <= 0.95: {verdict(r['ratio_same_tokens'], 0.95)}); "
        f"composite / dense all params: {r['ratio_all_params']:.3f} "
        f"(target <= 1.0: {verdict(r['ratio_all_params'], 1.0)}); "
        f"shared fraction {r['shared_fraction']:.2f}; routing balance {r['routing_balance']:.2f}x; "
        f"swarm {r['swarm_seconds']:.0f} s, "
        + (
            f"re-routed swarm {r['rerouted_swarm_seconds']:.0f} s (composite / dense "
            f"{r['ratio_rerouted']:.3f}, / dense all params {r['ratio_all_params_rerouted']:.3f}, "
            f"/ plain composite {r['rerouted_vs_plain']:.3f}), "
            if "composite_rerouted_ppl" in r
            else ""
        )
        + f"all {r['wall_seconds']:.0f} s",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # a SIGTERM unwinds like Ctrl-C, so the local swarm's processes are stopped with it
    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt(f"signal {s}")))
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    # the run, its logs and checkpoints stay out of the results folder (kept with --work_dir)
    work = tempfile.TemporaryDirectory(prefix="pathswarm-quality-") if args.work_dir is None else None
    try:
        return _measure(args, Path(work.name) if work else args.work_dir, started)
    finally:
        if work is not None:
            work.cleanup()


def composite_of(manifest, base, ckpts: list[Path], folder: Path, docs: list[str], tok) -> dict:
    """The composite of one swarm's checkpoints, routed as `pathswarm eval` routes: with the router
    the peers trained with last."""
    checkpoints = read_checkpoints(manifest, ckpts)
    folders = [folder / "artifacts", *(Path(c) / "artifacts" for c in ckpts)]
    version, router = router_trained_with([c.meta for c in checkpoints], folders)
    route = make_route(manifest, base, folders, router=router)
    routed = route_documents(route, [encode_document(tok, d) for d in docs])
    result = evaluate(assemble_grid(manifest, checkpoints), docs, tok, route, context=manifest.seq_len,
                      routed=routed)  # fmt: skip
    counts = [routed.count(p) for p in range(manifest.model.n_paths)]
    return dict(
        result=result,
        route=route,
        routed=routed,
        steps=path_steps(manifest, checkpoints),
        balance=max(counts) / max(1, min(counts)),
        router_versions=[int(c.meta.get("router_version") or 0) for c in checkpoints],
    )


def _measure(args: argparse.Namespace, folder: Path, started: float) -> dict:
    torch.manual_seed(args.seed)
    manifest, base = create_run(args, folder)
    ckpts, swarm_seconds, _ = train_swarm(args, manifest, folder)
    tok = ByteTokenizer()
    docs = eval_documents(manifest.dataset, limit=args.max_eval_docs)
    plain = composite_of(manifest, base, ckpts, folder, docs, tok)
    composite, route, routed, steps = plain["result"], plain["route"], plain["routed"], plain["steps"]
    rerouted = None
    if args.reroute_after_rounds:
        r_ckpts, r_seconds, said = train_swarm(args, manifest, folder, args.reroute_after_rounds)
        rerouted = composite_of(manifest, base, r_ckpts, folder, docs, tok)

    train = [d for d in load_documents(manifest.dataset) if split_of(d, manifest.dataset) == "train"]
    per_path = max(steps.values())
    dense = evaluate(dense_from_base(args, manifest, base, train, tok, per_path), docs, tok, route,
                     context=manifest.seq_len, routed=routed)  # fmt: skip
    same_steps = sum(steps.values())
    same_tokens = evaluate(dense_from_base(args, manifest, base, train, tok, same_steps), docs, tok, route,
                           context=manifest.seq_len, routed=routed)  # fmt: skip
    all_steps = args.warm_start_steps + same_steps
    big = dense_all_params(args, manifest, train, tok, all_steps)
    dense_big = evaluate(big, docs, tok, route, context=manifest.seq_len, routed=routed)

    n = manifest.model.n_paths
    results = dict(
        grid=args.grid,
        paths=n,
        data=args.data_files or f"built-in corpus ({args.builtin_docs} docs)",
        warm_start_steps=args.warm_start_steps,
        steps_per_path=per_path,
        path_steps={str(p): s for p, s in steps.items()},
        tokens=sum(steps.values()) * args.batch_size * args.seq_len,
        composite_ppl=composite.ppl,
        dense_ppl=dense.ppl,
        dense_steps=per_path,
        dense_same_tokens_ppl=same_tokens.ppl,
        dense_same_tokens_steps=same_steps,
        dense_all_params_ppl=dense_big.ppl,
        dense_all_params_steps=all_steps,
        dense_all_params_params=n_parameters(all_params_shape(manifest.model)),
        grid_params=n_parameters(manifest.model),
        path_params=sum(
            p.numel() for p in PathModel(manifest.model, (0,) * manifest.model.n_levels).parameters()
        ),
        ratio=composite.ppl / dense.ppl,
        ratio_same_tokens=composite.ppl / same_tokens.ppl,
        ratio_all_params=composite.ppl / dense_big.ppl,
        shared_fraction=shared_fraction(manifest.model),
        routing_balance=plain["balance"],
        eval_docs=len(docs),
        swarm_seconds=swarm_seconds,
        wall_seconds=time.monotonic() - started,
    )
    if rerouted is not None:
        ppl = rerouted["result"].ppl
        results.update(
            composite_rerouted_ppl=ppl,
            ratio_rerouted=ppl / dense.ppl,
            ratio_same_tokens_rerouted=ppl / same_tokens.ppl,
            ratio_all_params_rerouted=ppl / dense_big.ppl,
            rerouted_vs_plain=ppl / composite.ppl,
            reroute_after_rounds=args.reroute_after_rounds,
            reroute=said,
            rerouted_peer_router_versions=rerouted["router_versions"],
            rerouted_routing_balance=rerouted["balance"],
            rerouted_path_steps={str(p): s for p, s in rerouted["steps"].items()},
            rerouted_swarm_seconds=r_seconds,
            wall_seconds=time.monotonic() - started,
        )
        assert math.isfinite(ppl)
    (args.out / "swarm_quality.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(args.out / "swarm_quality.png", results)
    text = table(results)
    (args.out / "swarm_quality.md").write_text(text + "\n")
    print(text)
    assert math.isfinite(composite.ppl)
    return results


if __name__ == "__main__":
    main()
