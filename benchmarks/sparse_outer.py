"""The sparse codec's outer step, measured: `python -m benchmarks.sparse_outer --out DIR`.

The WAN lab's model, data, schedule and peers (4 replicas of its one path, H = 48, P = 4, τ = 11,
192 steps) trained in one process without the network, so that only the outer step differs between
runs: the project's own inner loop (`peer.offline.simulate.InnerLoop`), fragment schedule
(`peer.sync.fragments`), codecs, error feedback (`ModuleSync.with_error` / `keep_unsent`), robust
aggregator (`peer.sync.aggregate`, centered clip) and outer step (`ModuleSync.apply`). Every member
of a fragment round encodes its Δ, the group aggregates the decoded parts, τ steps later every member
applies the result: what `peer.sync.outer` does, minus the wire.

Why: with DiLoCo's outer step (lr 0.7, Nesterov 0.9, α = 0.5) the sparse codec's global copy ended
at 1.27x DiLoCo's eval loss in the lab. A group's mean of members' top-k parts moves a coordinate by
the share of the members that picked it (about 1/n where their choices differ), so the outer lr that
suits a dense Δ̄ is too small for a sparse one; SparseLoCo (Templar, 2025) also drops outer momentum
(error feedback accumulates instead) and replaces the local copy with the global one. This sweeps
the outer lr of that shape against DiLoCo and the dense nf4 stream, and the lab takes its setting
from it. Loss is deterministic for a seed (one thread per run); runs go two at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

RUNS: dict[str, dict] = {
    "diloco_fp32": dict(codec="fp32", fragments=1, tau=0, alpha=0.0, lr=0.7, momentum=0.9),
    "streaming_nf4": dict(codec="nf4", alpha=0.5, lr=0.7, momentum=0.9),
    "sparse, DiLoCo's outer step": dict(codec="sparse", alpha=0.5, lr=0.7, momentum=0.9),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse_outer", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lrs", default="2,4,8,16", help="outer lrs of sparse without momentum, α = 0")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--steps", type=int, default=192)
    p.add_argument("--inner_steps", type=int, default=48)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--overlap_steps", type=int, default=11)
    p.add_argument("--error_feedback_decay", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=1000, help="of the replicas' batch orders")
    p.add_argument("--workers", type=int, default=2)
    return p.parse_args(argv)


def train(run: dict, args: argparse.Namespace) -> dict:
    """One run: `peers` replicas, their fragment rounds aggregated in process; eval of replica 0."""
    import numpy as np
    import torch

    from benchmarks.wan.driver import base_manifest
    from benchmarks.wan.driver import parse_args as lab_args
    from peer.codecs.formats import make_codec
    from peer.config import OuterOptimizerConfig
    from peer.data.sources import eval_documents, load_documents, split_of
    from peer.model.tokenizer import load_tokenizer
    from peer.model.transformer import PathModel
    from peer.offline.evaluation import evaluate
    from peer.offline.simulate import InnerLoop, document_batches
    from peer.sync.aggregate import AggregatorConfig, Contribution, aggregate
    from peer.sync.fragments import fragments_due
    from peer.sync.module_sync import ModuleSync

    torch.set_num_threads(1)
    lab = lab_args(["--out", "unused", "--steps", str(args.steps), "--inner_steps", str(args.inner_steps)])
    manifest = base_manifest(lab)
    cfg, tokenizer = manifest.model, load_tokenizer(manifest.tokenizer)
    docs = [d for d in load_documents(manifest.dataset) if split_of(d, manifest.dataset) == "train"]
    m = run["momentum"]
    outer = OuterOptimizerConfig(lr=run["lr"], momentum=m, nesterov=m > 0)
    P, tau = run.get("fragments", args.fragments), run.get("tau", args.overlap_steps)
    path = (0,) * cfg.n_levels
    loops, syncs = [], []
    for i in range(args.peers):
        model = PathModel(cfg, path, seed=manifest.seed)
        batches = document_batches(docs, tokenizer, manifest.seq_len, lab.batch_size, seed=args.seed + i)
        loops.append(InnerLoop(model, batches, manifest.inner, total_steps=args.steps))
        syncs.append(
            {mid: ModuleSync(cfg, mid, part, outer, n_fragments=P) for mid, part in model.parts.items()}
        )
    codec = make_codec(run["codec"])
    feedback = codec.spec.error_feedback
    pending: list[tuple[int, int, dict]] = []
    sent = 0
    started = time.monotonic()

    def finish(fragment: int, parts: dict) -> None:
        for mid, decoded in parts.items():
            mean = aggregate(
                [Contribution(f"p{i}", d, 1.0) for i, d in enumerate(decoded)], AggregatorConfig()
            )
            for s in syncs:
                s[mid].apply(fragment, torch.from_numpy(mean), run["alpha"])

    for clock in range(1, args.steps + 1):
        for loop in loops:
            loop.step()
        for fragment in fragments_due(clock, args.inner_steps, P):
            parts: dict[str, list[np.ndarray]] = {}
            for mid in syncs[0]:
                if syncs[0][mid].fragment_size(fragment) == 0:
                    continue
                parts[mid] = []
                for s in syncs:
                    ms = s[mid]
                    delta = ms.outer_gradient(fragment)
                    if feedback:
                        delta = ms.with_error(fragment, delta, args.error_feedback_decay)
                    payload = codec.encode(delta)
                    sent += len(payload)
                    decoded = codec.decode(payload, delta.numel()).view_as(delta)
                    if feedback:
                        ms.keep_unsent(fragment, delta, decoded)
                    parts[mid].append(decoded.numpy())
            pending.append((clock + tau, fragment, parts))
        for item in [p for p in pending if p[0] <= clock]:
            pending.remove(item)
            finish(item[1], item[2])
    for item in pending:
        finish(item[1], item[2])

    eval_docs = eval_documents(manifest.dataset, limit=100)

    def loss(model: PathModel) -> float:
        r = evaluate(model, eval_docs, tokenizer, context=manifest.seq_len)
        return r.nll / r.tokens

    global_model = PathModel(cfg, path, seed=manifest.seed)
    with torch.no_grad():
        for mid, ms in syncs[0].items():
            for p, t in zip(global_model.parts[mid].parameters(), ms.plan.join(ms.global_flats), strict=True):
                p.copy_(t.view_as(p))
    return run | dict(
        fragments=P, tau=tau, eval_loss=loss(global_model), eval_loss_local_model=loss(loops[0].model),
        payload_bytes_per_peer=sent // args.peers, seconds=time.monotonic() - started,
    )  # fmt: skip


def write_report(out: Path, report: dict) -> str:
    runs, ref = report["runs"], report["runs"]["diloco_fp32"]["eval_loss"]
    lines = [
        f"{report['peers']} replicas, {report['steps']} steps, H = {report['inner_steps']}, "
        f"P = {report['fragments']}, τ = {report['overlap_steps']} (diloco_fp32: P = 1, τ = 0), "
        f"error feedback decay {report['error_feedback_decay']}; eval loss of replica 0's global copy",
        "",
        "| run | codec | outer lr | momentum | α | eval loss | × diloco_fp32 | local model "
        "| payload / peer |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r['codec']} | {r['lr']:g} | {r['momentum']:g} | {r['alpha']:g} "
            f"| {r['eval_loss']:.4f} "
            f"| {r['eval_loss'] / ref:.3f} | {r['eval_loss_local_model']:.4f} "
            f"| {r['payload_bytes_per_peer'] / 1e3:,.0f} kB |"
        )
    text = "\n".join(lines) + "\n"
    (out / "sparse_outer.md").write_text(text)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = sorted((r["lr"], r["eval_loss"]) for n, r in runs.items() if n.startswith("sparse, lr"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([x for x, _ in sweep], [y for _, y in sweep], marker="o", label="sparse, no momentum, α = 0")
    for name, style in (
        ("diloco_fp32", "k--"),
        ("streaming_nf4", "g:"),
        ("sparse, DiLoCo's outer step", "r-."),
    ):
        ax.axhline(runs[name]["eval_loss"], linestyle=style[1:], color=style[0], label=name)
    ax.axhline(1.02 * ref, color="grey", linewidth=0.8, label="1.02 × diloco_fp32")
    ax.set(xscale="log", xlabel="outer lr", ylabel="eval loss (global copy)", title="sparse codec: outer lr")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sparse_outer.png", dpi=120)
    plt.close(fig)
    return text


def main(argv: list[str] | None = None) -> None:
    from tqdm import tqdm

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = dict(RUNS)
    for lr in (float(x) for x in args.lrs.split(",") if x.strip()):
        runs[f"sparse, lr {lr:g}"] = dict(codec="sparse", alpha=0.0, lr=lr, momentum=0.0)
    started = time.monotonic()
    results: dict[str, dict] = {}
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = {name: pool.submit(train, run, args) for name, run in runs.items()}
        for name, future in tqdm(futures.items(), desc="runs", file=sys.stderr):
            results[name] = future.result()
    given = argv if argv is not None else sys.argv[1:]
    report = dict(
        vars(args) | dict(out=str(args.out)), runs=results, wall_seconds=time.monotonic() - started,
        command=" ".join(["python -m benchmarks.sparse_outer", *given]),
    )  # fmt: skip
    (args.out / "sparse_outer.json").write_text(json.dumps(report, indent=1))
    print(write_report(args.out, report))
    print(f"wrote {args.out}/sparse_outer.json, .md, .png in {report['wall_seconds']:.0f}s")


if __name__ == "__main__":
    main()
