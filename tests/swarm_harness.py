"""Helpers for tests that run swarms of real `pathswarm` processes on loopback."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from hivemind.utils.crypto import RSAPrivateKey
from safetensors.torch import load_file

from peer.checkpoint import list_checkpoints, load_latest_checkpoint
from peer.cli.local_swarm import LocalSwarm
from peer.config import AdmissionConfig, InnerOptimizerConfig, SyncConfig
from peer.config.manifest import SchedulerConfig
from peer.data.sources import DatasetSpec
from peer.model.grid import ModelConfig
from peer.run.create import build_manifest
from peer.run.record import save_record, sign_manifest

RUN = "swarmtest"


def write_manifest(
    folder: Path,
    inner_steps: int = 10,
    fragments: int = 1,
    grid: tuple[int, int] = (2, 2),
    creator: RSAPrivateKey | None = None,
    admission: AdmissionConfig | None = None,
    scheduler: SchedulerConfig | None = None,
    **sync: object,
) -> tuple[Path, str]:
    """A tiny signed run (an LxK grid of d=32, H = `inner_steps`, P = `fragments`) in `folder`, signed
    by `creator` (a fresh key by default); `admission` and `scheduler`: manifest sections."""
    levels, k = grid
    manifest = build_manifest(
        RUN,
        ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64, n_levels=levels, modules_per_level=k),
        DatasetSpec(kind="builtin", builtin_docs=400),
        seq_len=32,
        inner=InnerOptimizerConfig(lr=2e-3, warmup_steps=5, total_steps=400),
        sync=SyncConfig(
            inner_steps=inner_steps, fragments=fragments, **{"averaging_timeout_seconds": 10.0, **sync}
        ),
        router_docs=200,
        sections={k: v for k, v in {"admission": admission, "scheduler": scheduler}.items() if v is not None}
        or None,
    )
    record = sign_manifest(manifest, creator or RSAPrivateKey())
    path = folder / "manifest.json"
    save_record(record, path)
    return path, record.run_id


def peer_args(run_id: str, ckpt: Path, *extra: str) -> list[str]:
    return ["--run", f"{RUN}@{run_id[:16]}", "--checkpoint_dir", str(ckpt), "--torch_threads", "1",
            "--batch_size", "4", "--heartbeat_seconds", "1", "--max_inner_steps_per_second", "20",
            *extra]  # fmt: skip


def wait_for(predicate, timeout: float, what: str, swarm: LocalSwarm | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    logs = ""
    if swarm is not None:
        logs = "\n".join(f"--- {n}\n" + swarm.log_path(n).read_text()[-1500:] for n in swarm.procs)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def final_state(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict]:
    loaded = load_latest_checkpoint(ckpt)
    assert loaded is not None, f"no checkpoint in {ckpt}"
    return loaded


def shared_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What holders of a module must agree on bit for bit: global copies and outer momenta."""
    return {k: v for k, v in tensors.items() if "/global/" in k or "/momentum/" in k}


def states_by_round(ckpt: Path) -> dict[int, Path]:
    """Complete checkpoints of a peer by its outer round (needs --keep_checkpoints large)."""
    out = {}
    for info in list_checkpoints(ckpt):
        if info.complete:
            out.setdefault(info.manifest["meta"]["outer_round"], info.path)
    return out


def outcomes(meta: dict) -> list[dict[str, str]]:
    return [entry["outcomes"] for entry in meta.get("history", [])]


def logs_of(swarm: LocalSwarm, *names: str) -> str:
    return "\n".join(f"--- {n}\n{swarm.log_path(n).read_text()[-3000:]}" for n in names)


def checkpoints_by_count(ckpt, module: str) -> dict:
    """The checkpoints of a peer by how many syncs `module` had done (the first of each count), among
    those that hold it (a peer that rotated held other modules before)."""
    out = {}
    for info in list_checkpoints(ckpt):
        rounds = info.manifest["meta"]["fragment_rounds"].get(module) if info.complete else None
        if rounds is not None:
            out.setdefault(rounds[0], info.path)
    return out


def final_lineage_by_count(ckpt, module: str) -> dict:
    """The checkpoints of a peer by `module`'s sync count since the count last went down (a peer whose
    rounds ran away from the others' takes their state, and with it their lower count), the last of
    each count: the copy this peer ended up keeping."""
    out: dict = {}
    for info in list_checkpoints(ckpt):
        rounds = info.manifest["meta"]["fragment_rounds"].get(module) if info.complete else None
        if rounds is None:
            continue
        if out and rounds[0] < max(out):
            out = {}
        out[rounds[0]] = info.path
    return out


def module_tensors(tensors: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    """One module's shared tensors (global copy and outer momentum) of a checkpoint's tensors."""
    return {k: v for k, v in shared_state(tensors).items() if k.startswith(f"{module}/")}


def module_state(path, module: str) -> dict:
    """One module's shared tensors in a checkpoint folder."""
    return module_tensors(load_file(str(path / "tensors.safetensors")), module)


def downloaded_state(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """What a joiner downloaded: the checkpoint it writes once caught up, before its first step."""
    first = min((i for i in list_checkpoints(ckpt) if i.complete), key=lambda i: i.step)
    assert first.manifest["meta"]["step"] == 0, first.manifest["meta"]["step"]
    return load_file(str(first.path / "tensors.safetensors")), first.manifest["meta"]
