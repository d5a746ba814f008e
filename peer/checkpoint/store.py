"""Crash-safe checkpoints of a peer: safetensors weights plus a JSON manifest, written atomically.

A checkpoint is a folder ``ckpt-{step:09d}/`` holding ``tensors.safetensors`` and ``manifest.json``. It is
built in ``ckpt-{step:09d}.tmp-<pid>/`` and renamed into place only when complete, and inside it the
manifest (with the sha256 of the tensors file) is written last, so a reader can trust exactly the folders
whose manifest parses and whose tensors hash matches. Every file is fsynced before its rename and every
directory after, so a power cut leaves either the old state or the new one, never a torn file.

Temp folders of writers that died (their pid no longer runs) are removed by the next save; this assumes
one checkpoint directory is written from one host, as pids of other hosts mean nothing here.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import safetensors.torch
import torch
from safetensors.torch import load_file

from peer.errors import PathswarmError
from peer.faults import fault_point

FORMAT = "pathswarm-checkpoint"
FORMAT_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
# Headroom over the raw tensor bytes for the safetensors header, the manifest and filesystem slack.
SPACE_MARGIN_BYTES = 1 << 20

_CKPT_RE = re.compile(r"^ckpt-(\d{9,})$")
_TEMP_RE = re.compile(r"^ckpt-\d{9,}\.(?:tmp|old)-(\d+)$")

# safetensors' dtype codes; files use the format's own names so any safetensors reader can open them.
_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

logger = logging.getLogger(__name__)

# Temp folders this process is writing right now: never "stale", whatever their pid says.
_active_lock = threading.Lock()
_active_temps: set[Path] = set()
# Manifests this process found complete or not, by folder, with the manifest's (inode, size, mtime).
_complete_seen: dict[Path, tuple[tuple[int, int, int], bool]] = {}


class CheckpointError(PathswarmError, RuntimeError):
    """A checkpoint could not be written (disk full, bad input); the previous checkpoints are untouched."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One ``ckpt-*`` folder. ``manifest`` is None when it is missing or unreadable (incomplete)."""

    path: Path
    step: int
    manifest: dict[str, Any] | None

    @property
    def complete(self) -> bool:
        return self.manifest is not None


def save_checkpoint(
    directory: Path, tensors: Mapping[str, torch.Tensor], meta: dict[str, Any] | EncodedMeta, keep: int = 2
) -> Path:
    """Write ``tensors`` and ``meta`` as checkpoint ``meta["step"]``, prune to ``keep``; return its folder.

    ``meta`` must be JSON-serialisable (it comes back as JSON would: tuples as lists). Tensors may live on
    any device and may share storage (tied weights); each is saved as its own contiguous CPU copy, made
    here unless ``tensors`` is already a `TensorSnapshot` (`snapshot_tensors`: a writer thread saves
    what the training thread copied). Saving a step that already exists replaces it.
    """
    directory = Path(directory)
    encoded = encode_meta(meta)
    step = encoded.step
    if keep < 1:
        raise CheckpointError(f"keep must be >= 1, got {keep}")
    cpu_tensors = tensors if isinstance(tensors, TensorSnapshot) else snapshot_tensors(tensors)

    directory.mkdir(parents=True, exist_ok=True)
    need = sum(t.numel() * t.element_size() for t in cpu_tensors.values()) + SPACE_MARGIN_BYTES
    free = shutil.disk_usage(directory).free
    if free < need:
        raise CheckpointError(
            f"not enough disk space in {directory}: need {need / 2**20:.1f} MB, have {free / 2**20:.1f} MB"
        )
    _remove_stale_temps(directory)

    final = directory / f"ckpt-{step:09d}"
    temp = directory / f"{final.name}.tmp-{os.getpid()}"
    with _active_lock:
        _active_temps.add(temp)
    try:
        if temp.exists():  # our own leftover from an attempt that raised
            shutil.rmtree(temp)
        temp.mkdir()
        size, sha256 = _write_durably(temp / TENSORS_FILE, lambda f: _write_safetensors(f, cpu_tensors))
        _fsync_dir(temp)
        fault_point("checkpoint.after_tensors")

        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "created_unix": time.time(),
            "tensors_file": {"name": TENSORS_FILE, "size": size, "sha256": sha256},
            "tensors": {
                name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                for name, t in cpu_tensors.items()
            },
        }
        # compact (an indented dump takes json's pure-Python encoder, ~4x slower), and the meta (~100 KB
        # of round history, every round) goes in as `encode_meta` encoded it, as the last key
        body = (json.dumps(manifest, separators=(",", ":"))[:-1] + ',"meta":' + encoded.text + "}").encode()
        _write_durably(
            temp / MANIFEST_FILE, lambda f: f.write(body), before_rename="checkpoint.before_manifest"
        )
        _fsync_dir(temp)
        _move_into_place(temp, final)
        _fsync_dir(directory)
    except OSError as e:
        shutil.rmtree(temp, ignore_errors=True)
        reason = os.strerror(e.errno) if e.errno else str(e)
        hint = " (disk full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise CheckpointError(
            f"writing checkpoint step {step} to {directory} failed{hint}: {reason}; previous checkpoints kept"
        ) from e
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    finally:
        with _active_lock:
            _active_temps.discard(temp)

    _prune(directory, keep)
    logger.info("saved checkpoint %s (%.1f MB)", final, size / 2**20)
    return final


def list_checkpoints(directory: Path) -> list[CheckpointInfo]:
    """All ``ckpt-*`` folders under ``directory``, oldest first; temp folders are not listed.

    A manifest that parses and has the expected format counts as complete; the tensors hash is only
    checked by ``load_latest_checkpoint``, as hashing every checkpoint on each listing would be slow.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return [
        CheckpointInfo(folder, step, _read_manifest(folder))
        for step, folder in _checkpoint_folders(directory)
    ]


def load_latest_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """Tensors (on CPU, in saved order) and meta of the newest valid checkpoint, or None if there is none.

    Incomplete or corrupt checkpoints (no manifest, size or sha256 mismatch, unreadable tensors) are
    skipped with a warning in favour of older ones.
    """
    for info in reversed(list_checkpoints(directory)):
        if info.manifest is None:
            logger.warning("skipping incomplete checkpoint %s: no valid %s", info.path, MANIFEST_FILE)
            continue
        try:
            tensors = _load_verified(info)
        except Exception as e:  # any failure means "not this one": fall back to an older checkpoint
            logger.warning("skipping corrupt checkpoint %s: %s", info.path, e)
            continue
        return tensors, info.manifest["meta"]
    return None


@dataclass(frozen=True)
class EncodedMeta:
    """A checkpoint's meta serialised once (`encode_meta`): immutable, so a writer thread can save it
    while the caller changes its own dicts, and embedded in the manifest as it is."""

    step: int
    text: str


def encode_meta(meta: dict[str, Any] | EncodedMeta) -> EncodedMeta:
    """`meta` as JSON (tuples become lists); raises CheckpointError when it is not JSON-serialisable
    or has no valid ``step``. The round history makes it ~100 KB: it is encoded once per checkpoint."""
    if isinstance(meta, EncodedMeta):
        return meta
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"meta['step'] must be a non-negative int, got {step!r}")
    try:
        return EncodedMeta(step, json.dumps(meta, separators=(",", ":"), allow_nan=True))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint meta is not JSON-serialisable: {e}") from None


class TensorSnapshot(dict):
    """Private contiguous CPU copies of a checkpoint's tensors (`snapshot_tensors`), checked: nothing
    else holds them, so they can be written later, on another thread, while training goes on."""


def snapshot_tensors(tensors: Mapping[str, torch.Tensor]) -> TensorSnapshot:
    """Checks every tensor a checkpoint may hold and copies it to the CPU (raises CheckpointError)."""
    out = TensorSnapshot()
    for name, tensor in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise CheckpointError(f"invalid tensor name {name!r}")
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise CheckpointError(f"tensor {name!r} is not a dense torch.Tensor")
        if tensor.dtype not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
        # Always a private copy: tied weights and views then serialise independently, and training that
        # goes on after this call cannot change what is being written.
        out[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return out


def _write_safetensors(f: BinaryIO, tensors: dict[str, torch.Tensor]) -> None:
    """Writes ``tensors`` to ``f`` in the safetensors format (through the safetensors library; the
    serialized bytes are built in memory once, which a checkpoint of one path's modules affords)."""
    f.write(safetensors.torch.save(tensors, metadata={"format": "pt"}))


class _HashingWriter:
    """File wrapper that hashes and counts what is written through it."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        n = self._f.write(data)
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return n


def _write_durably(path: Path, write: Any, before_rename: str | None = None) -> tuple[int, str]:
    """Write via ``write(file)`` to a temp name, fsync, rename to ``path``; return (size, sha256 hex)."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as raw:
        f = _HashingWriter(raw)
        write(f)
        raw.flush()
        os.fsync(raw.fileno())
    if before_rename:
        fault_point(before_rename)
    os.replace(partial, path)
    return f.size, f.sha256.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(temp: Path, final: Path) -> None:
    if not final.exists():
        os.rename(temp, final)
        return
    # rename() cannot replace a non-empty folder: park the old one under a temp name (cleaned up as
    # stale if we die here), then swap. Older steps stay intact throughout.
    trash = final.with_name(f"{final.name}.old-{os.getpid()}")
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(final, trash)
    try:
        os.rename(temp, final)
    except OSError:
        os.rename(trash, final)
        raise
    shutil.rmtree(trash, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _remove_stale_temps(directory: Path) -> None:
    with _active_lock:
        active = set(_active_temps)
    for entry in directory.iterdir():
        match = _TEMP_RE.match(entry.name)
        if not match or entry in active:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or not _pid_alive(pid):
            logger.info("removing stale checkpoint temp folder %s", entry)
            shutil.rmtree(entry, ignore_errors=True)


def _prune(directory: Path, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints; drop older complete and incomplete ones."""
    folders = _checkpoint_folders(directory)
    kept = [(step, folder) for step, folder in folders if _is_complete(folder)][-keep:]
    if not kept:
        return
    oldest_kept = kept[0][0]
    for step, folder in folders:
        if step < oldest_kept:
            logger.info("pruning checkpoint %s", folder)
            shutil.rmtree(folder, ignore_errors=True)
            with _active_lock:
                _complete_seen.pop(folder, None)


def _checkpoint_folders(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for entry in directory.iterdir():
        match = _CKPT_RE.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _is_complete(folder: Path) -> bool:
    """`_read_manifest(folder) is not None`, remembered per manifest file (inode, size, mtime): a save
    prunes after every checkpoint, and parsing each kept manifest again (the round history, ~100 KB)
    cost more than the save's own JSON."""
    try:
        st = (folder / MANIFEST_FILE).stat()
    except OSError:
        return False
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _active_lock:
        seen = _complete_seen.get(folder)
    if seen is not None and seen[0] == stamp:
        return seen[1]
    complete = _read_manifest(folder) is not None
    with _active_lock:
        _complete_seen[folder] = (stamp, complete)
    return complete


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or manifest.get("version") != FORMAT_VERSION
        or not isinstance(manifest.get("tensors_file"), dict)
        or not isinstance(manifest.get("tensors"), dict)
        or "meta" not in manifest
    ):
        return None
    return manifest


def _load_verified(info: CheckpointInfo) -> dict[str, torch.Tensor]:
    assert info.manifest is not None
    expected = info.manifest["tensors_file"]
    path = info.path / expected.get("name", TENSORS_FILE)
    size = path.stat().st_size
    if size != expected.get("size"):
        raise ValueError(f"{path.name} has {size} bytes, manifest says {expected.get('size')}")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != expected.get("sha256"):
        raise ValueError(f"{path.name} sha256 mismatch")
    loaded = load_file(path)
    spec = info.manifest["tensors"]
    if set(loaded) != set(spec):
        raise ValueError("tensor names differ from the manifest")
    for name, t in loaded.items():
        if list(t.shape) != spec[name]["shape"] or str(t.dtype).removeprefix("torch.") != spec[name]["dtype"]:
            raise ValueError(f"tensor {name!r} differs from the manifest")
    return {name: loaded[name] for name in spec}
