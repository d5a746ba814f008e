"""What the swarm benchmarks (`byzantine`, `chaos`) share: a small 1x1-grid run on the built-in corpus,
the peer command line, and the eval loss of a peer's final global copy (or of a keeper's kept one)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.wan.report import eval_loss
from peer.checkpoint import load_latest_checkpoint
from peer.config import AdmissionConfig, InnerOptimizerConfig, RunManifest, SyncConfig
from peer.data.sources import DatasetSpec, eval_documents
from peer.model.grid import ModelConfig
from peer.run.create import build_manifest
from peer.run.record import save_record, sign_manifest

#: what a peer logs when it must start a module from initial weights (peer/sync/path_sync.py)
RESET_MARK = "starts again from its initial weights"


def count_marks(logs: Path, marks: tuple[str, ...]) -> int:
    """How often any of `marks` occurs in the peers' logs (`p*.log`, restarted processes' included)."""
    return sum(log.read_text(errors="replace").count(m) for log in logs.glob("p*.log") for m in marks)


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=12, help="outer rounds per run")
    p.add_argument("--inner_steps", type=int, default=10, help="H")
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--builtin_docs", type=int, default=1500)
    p.add_argument("--max_eval_docs", type=int, default=300)
    p.add_argument("--run_timeout_seconds", type=float, default=300.0)


def make_manifest(
    args: argparse.Namespace, name: str, admission: AdmissionConfig | None = None, **sync: object
) -> RunManifest:
    """One path (a 1x1 grid), so every peer holds every module and averages every round."""
    steps = args.rounds * args.inner_steps
    return build_manifest(
        name,
        ModelConfig(
            d_model=args.d_model,
            n_heads=4,
            d_ff=4 * args.d_model,
            max_seq_len=64,
            n_levels=1,
            modules_per_level=1,
        ),  # fmt: skip
        DatasetSpec(kind="builtin", builtin_docs=args.builtin_docs),
        seq_len=32,
        inner=InnerOptimizerConfig(lr=3e-3, warmup_steps=10, total_steps=steps),
        sync=SyncConfig(**{"inner_steps": args.inner_steps, "averaging_timeout_seconds": 20.0, **sync}),
        router_docs=200,
        sections={"admission": admission} if admission is not None else None,
    )


def write_run(manifest: RunManifest, folder: Path) -> str:
    """Signs the manifest into folder/manifest.json; returns the `--run NAME@PIN` to join it."""
    # a new run: its peers refuse an earlier run's checkpoints without --resume (and must not resume them)
    earlier = sorted(ckpt.parent for ckpt in folder.glob("*/ckpt-*"))
    if earlier:
        raise SystemExit(f"{folder} holds an earlier run's checkpoints ({earlier[0]}): give another --out")
    record = sign_manifest(manifest, RSAPrivateKey())
    folder.mkdir(parents=True, exist_ok=True)
    save_record(record, folder / "manifest.json")
    return f"{manifest.name}@{record.run_id[:16]}"


def peer_argv(args: argparse.Namespace, run: str, checkpoint_dir: Path, *extra: str) -> list[str]:
    return ["--run", run, "--checkpoint_dir", str(checkpoint_dir), "--torch_threads", "1",
            "--batch_size", str(args.batch_size), "--heartbeat_seconds", "1",
            "--max_rounds", str(args.rounds), *extra]  # fmt: skip


def final_eval_loss(
    args: argparse.Namespace, manifest: RunManifest, checkpoint_dir: Path
) -> tuple[float, dict]:
    """Eval loss of the global copy in a peer's newest checkpoint, and that checkpoint's meta."""
    loaded = load_latest_checkpoint(checkpoint_dir)
    if loaded is None:
        raise RuntimeError(f"no checkpoint in {checkpoint_dir}")
    tensors, meta = loaded
    docs = eval_documents(manifest.dataset, limit=args.max_eval_docs)
    return eval_loss(manifest, tensors, "global", docs), meta


def kept_eval_loss(args: argparse.Namespace, manifest: RunManifest, keep_dir: Path) -> float:
    """Eval loss of the modules a keeper kept (`--keep_state keep_dir`); inf where it kept none or a
    state no model may load."""
    import math

    from peer.model.transformer import PathModel
    from peer.sync.module_sync import ModuleSync, StateRejected

    model = PathModel(manifest.model, (0,) * manifest.model.n_levels, seed=manifest.seed)
    tensors = {}
    for mid in model.module_ids:
        loaded = load_latest_checkpoint(keep_dir / mid)
        if loaded is None:
            return math.inf
        kept, meta = loaded
        ms = ModuleSync(manifest.model, mid, model.parts[mid], manifest.outer, manifest.sync.fragments)
        try:
            ms.load_state(
                dict(module=mid, fragment_rounds=meta["fragment_rounds"]),
                [kept[f"t{i}"] for i in range(len(kept))],
            )
        except StateRejected:
            return math.inf
        tensors.update(ms.named_state())
    docs = eval_documents(manifest.dataset, limit=args.max_eval_docs)
    return eval_loss(manifest, tensors, "global", docs)
