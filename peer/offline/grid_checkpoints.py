"""The grid of a run, assembled from its peers' checkpoints (their global copies).

Every module comes from the most advanced checkpoint that holds it; folders of another run are
refused, and a module that no checkpoint holds is named in the error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peer.checkpoint import load_latest_checkpoint
from peer.config import RunManifest
from peer.errors import ConfigError
from peer.model.grid import all_module_ids, all_paths, path_from_index, path_index, path_module_ids
from peer.model.transformer import GridModel

logger = logging.getLogger(__name__)


@dataclass
class PeerCheckpoint:
    """The newest valid checkpoint of one peer's folder."""

    directory: Path
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def rank(self) -> tuple[int, int]:
        return int(self.meta.get("outer_round", 0)), int(self.meta.get("step", 0))

    @property
    def modules(self) -> set[str]:
        return {name.split("/", 1)[0] for name in self.tensors if "/global/" in name}


def read_checkpoints(manifest: RunManifest, checkpoint_dirs: Iterable[str | Path]) -> list[PeerCheckpoint]:
    """The newest valid checkpoint of each folder; refuses folders of another run."""
    out = []
    for directory in map(Path, checkpoint_dirs):
        loaded = load_latest_checkpoint(directory)
        if loaded is None:
            raise ConfigError(f"no valid checkpoint in {directory}")
        tensors, meta = loaded
        if meta.get("run_id") != manifest.run_id:
            raise ConfigError(
                f"checkpoint in {directory} is of run {str(meta.get('run_id'))[:12]}, "
                f"not of this manifest's run {manifest.run_id[:12]}"
            )
        out.append(PeerCheckpoint(directory, meta, tensors))
    if not out:
        raise ConfigError("no checkpoint folders given")
    return out


@torch.no_grad()
def assemble_grid(
    manifest: RunManifest,
    checkpoint_dirs: Iterable[str | Path] | Sequence[PeerCheckpoint],
    paths: Iterable[tuple[int, ...]] | None = None,
) -> GridModel:
    """The grid from peers' global copies; a module held by several peers comes from the most
    advanced (highest outer round, then step). Every module of `paths` (default: all) must be found."""
    dirs = list(checkpoint_dirs)
    ckpts = dirs if dirs and isinstance(dirs[0], PeerCheckpoint) else read_checkpoints(manifest, dirs)
    cfg = manifest.model
    best: dict[str, PeerCheckpoint] = {}
    for ckpt in ckpts:
        for mid in ckpt.modules:
            if mid not in best or ckpt.rank > best[mid].rank:
                best[mid] = ckpt
    if paths is None:
        needed = all_module_ids(cfg)
    else:
        needed = list(dict.fromkeys(mid for p in paths for mid in path_module_ids(cfg, tuple(p))))
    missing = [mid for mid in needed if mid not in best]
    if missing:
        raise ConfigError(
            f"no checkpoint holds module(s) {', '.join(missing)}; add the checkpoint of a peer whose path "
            "runs through them"
        )
    grid = GridModel(cfg, seed=manifest.seed)
    for mid, ckpt in best.items():
        if mid not in grid.grid:
            raise ConfigError(f"checkpoint in {ckpt.directory} holds module {mid!r}, which this grid has not")
        for name, p in grid.grid[mid].named_parameters():
            t = ckpt.tensors.get(f"{mid}/global/{name}")
            if t is None or t.shape != p.shape:
                raise ConfigError(
                    f"checkpoint in {ckpt.directory}: {mid}/global/{name} is missing or misshapen"
                )
            p.copy_(t.to(p.dtype))
    return grid.eval()


def path_steps(manifest: RunManifest, ckpts: Sequence[PeerCheckpoint]) -> dict[int, int]:
    """Inner steps trained on each path of the grid: the sum over the peers whose checkpoint says
    they trained it — its `path_steps` (a peer that rotated trained several paths), else all its
    steps on the path it names. A path whose modules all come from other paths' peers still has 0:
    its modules were trained, the combination never was."""
    cfg = manifest.model
    steps = {path_index(cfg, p): 0 for p in all_paths(cfg)}
    for ckpt in ckpts:
        per_path = ckpt.meta.get("path_steps")
        if isinstance(per_path, dict) and per_path:
            for key, n in per_path.items():
                try:
                    index, count = int(key), int(n)
                except (ValueError, TypeError):
                    continue
                if index in steps and count > 0:
                    steps[index] += count
            continue
        path = ckpt.meta.get("path")
        if isinstance(path, list) and len(path) == cfg.n_levels:
            try:
                index = path_index(cfg, tuple(int(m) for m in path))
            except (ConfigError, ValueError, TypeError):
                continue
            steps[index] = steps.get(index, 0) + int(ckpt.meta.get("step", 0))
    return steps


def refuse_untrained(
    manifest: RunManifest, steps: dict[int, int], used: dict[int, float], allow: bool, what: str
) -> None:
    """Raises a one-line error when `used` (path index -> share of the work) includes a path nobody
    trained, unless `allow` (--allow_untrained); otherwise only warns."""
    untrained = {p: share for p, share in used.items() if steps.get(p, 0) == 0 and share > 0}
    if not untrained:
        return
    cfg = manifest.model
    named = ", ".join(
        f"{p} ({','.join(map(str, path_from_index(cfg, p)))}: {share:.0%})"
        for p, share in sorted(untrained.items())
    )
    message = f"{what} path(s) that no checkpoint's peer trained: {named}"
    if not allow:
        raise ConfigError(
            f"{message}; add those peers' checkpoints, or pass --allow_untrained to use their modules as "
            "other paths left them"
        )
    logger.warning(message)
