"""What a peer checks about itself before it claims a path: memory for the path, the run's data."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from peer.config import PeerConfig, RunManifest
from peer.data.files import check_fingerprints
from peer.data.sources import local_files
from peer.errors import ConfigError
from peer.run.memory import available_bytes, check_path_fits

logger = logging.getLogger(__name__)


def check_memory(manifest: RunManifest, cfg: PeerConfig, device: torch.device) -> None:
    """Refuses a path that would not fit, before its model or optimizer is allocated."""
    available = available_bytes(device.type, device.index)
    cpu = available_bytes("cpu")
    if cfg.max_memory_bytes is not None:
        available, cpu = min(available, cfg.max_memory_bytes), min(cpu, cfg.max_memory_bytes)
    estimate = check_path_fits(manifest, cfg.batch_size, device.type, available, cpu)
    logger.info(
        f"a path needs about {estimate.total_bytes(cfg.batch_size) / 2**20:.0f} MiB at batch size "
        f"{cfg.batch_size}; {available / 2**20:.0f} MiB available on {device}"
    )


def check_data(manifest: RunManifest, cfg: PeerConfig) -> Path | None:
    """Finds the run's data before anything is claimed, and checks that it is the run's (the
    fingerprints `run create` recorded); returns the root its local files are read under. A run from
    the swarm that names local files is read only under --data_root (a stranger chose its patterns)."""
    spec = manifest.dataset
    if spec.kind in ("text", "json", "parquet") and not spec.shards:  # shards are fetched by hash
        if cfg.manifest_path is None and cfg.data_root is None:
            raise ConfigError(
                f"run {cfg.run_name} trains on local files {spec.data_files}: every peer needs a copy; "
                "give --data_root DIR of yours that holds them"
            )
        files = local_files(spec, cfg.data_root)
        where = (
            f"under --data_root {cfg.data_root}" if cfg.data_root else f"from the current folder {Path.cwd()}"
        )
        # a copy that is another version or a part of the run's files would train without a word
        check_fingerprints(spec.fingerprints, files, where)
    return cfg.data_root
