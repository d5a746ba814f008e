"""The sparse codec's outer step, measured: `python -m benchmarks.sparse_outer --out DIR`.

The WAN lab's model, data, schedule and peers (4 replicas of its one path, H = 48, P = 4, τ = 11,
192 steps) trained in one process without the network, so that only the outer step differs between
runs: the project's own inner loop (`peer.offline.simulate.InnerLoop`), fragment schedule
(`peer.sync.fragments`), codecs, error feedback (`ModuleSync.corrected_outer_gradient` /
`settle_feedback`), robust
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
    import torch

    from benchmarks.wan import report
    from benchmarks.wan.driver import LabTraining
    from peer.codecs.formats import make_codec
    from peer.config import OuterOptimizerConfig
    from peer.data.sources import eval_documents
    from peer.sync.fragments import fragments_due
    from peer.sync.module_sync import ModuleSync

    torch.set_num_threads(1)
    lab = LabTraining.load("--steps", str(args.steps), "--inner_steps", str(args.inner_steps))
    m = run["momentum"]
    outer = OuterOptimizerConfig(lr=run["lr"], momentum=m, nesterov=m > 0)
    P, tau = run.get("fragments", args.fragments), run.get("tau", args.overlap_steps)
    loops = [lab.replica(args.seed + i, args.steps) for i in range(args.peers)]
    syncs = [
        {
            mid: ModuleSync(lab.manifest.model, mid, part, outer, n_fragments=P)
            for mid, part in loop.model.parts.items()
        }
        for loop in loops
    ]
    codec = make_codec(run["codec"])
    pending: list[tuple[int, int, dict]] = []
    sent = 0
    started = time.monotonic()
    for clock in range(1, args.steps + 1):
        for loop in loops:
            loop.step()
        for fragment in fragments_due(clock, args.inner_steps, P):
            parts = {mid: [] for mid in syncs[0] if syncs[0][mid].fragment_size(fragment)}
            for mid, decoded in parts.items():
                for s in syncs:
                    payload, part = _send(s[mid], fragment, codec, args.error_feedback_decay)
                    sent += len(payload)
                    decoded.append(part)
            pending.append((clock + tau, fragment, parts))
        for item in [p for p in pending if p[0] <= clock]:
            pending.remove(item)
            _finish(syncs, item[1], item[2], run["alpha"])
    for item in pending:
        _finish(syncs, item[1], item[2], run["alpha"])

    eval_docs = eval_documents(lab.manifest.dataset, limit=100)
    global_copy = {k: v for ms in syncs[0].values() for k, v in ms.named_state().items()}
    local = {f"local/{name}": p.detach() for name, p in loops[0].model.named_parameters()}
    return run | dict(
        fragments=P, tau=tau, eval_loss=report.eval_loss(lab.manifest, global_copy, "global", eval_docs),
        eval_loss_local_model=report.eval_loss(lab.manifest, local, "local", eval_docs),
        payload_bytes_per_peer=sent // args.peers, seconds=time.monotonic() - started,
    )  # fmt: skip


def _send(ms, fragment: int, codec, decay: float):
    """What a member puts on the wire for a fragment round, and what the others decode from it; a
    sparse codec's unsent rest stays as error feedback (as `peer.sync.outer` does before sending)."""
    delta = ms.corrected_outer_gradient(fragment, codec, decay)
    payload = codec.encode(delta)
    decoded = codec.decode(payload, delta.numel()).view_as(delta)
    if codec.spec.error_feedback:
        ms.settle_feedback(fragment, delta, decoded)
    return payload, decoded.numpy()


def _finish(syncs: list[dict], fragment: int, parts: dict, alpha: float) -> None:
    """The group's aggregate of every module's decoded parts, applied by every member."""
    import torch

    from peer.sync.aggregate import AggregatorConfig, Contribution, aggregate

    for mid, decoded in parts.items():
        mean = aggregate([Contribution(f"p{i}", d, 1.0) for i, d in enumerate(decoded)], AggregatorConfig())
        for s in syncs:
            s[mid].apply(fragment, torch.from_numpy(mean), alpha)


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
