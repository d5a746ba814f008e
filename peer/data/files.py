"""A run's local data files: whether each holds the format its `--dataset` kind reads, and the
fingerprint (`FileFingerprint`) that `run create` records of each and every peer checks its copy against.

The format check reads the first bytes of a file only: it catches a file given to the wrong reader
(JSON lines read as text lines would train on the raw JSON, braces and all) without parsing it. The
fingerprint is a file's size, line count and sha256, in one pass: a peer whose copy is another
version, or a part, of the run's file says which file differs and how, before it trains.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from peer.errors import ConfigError

#: bytes read to tell a file's format
_HEAD_BYTES = 64 << 10
_PARQUET_MAGIC = b"PAR1"
#: what each kind reads, and the flag that reads each format
_READS = {"text": "one document per line", "json": "JSON lines", "parquet": "parquet"}
_FLAG_FOR = {
    "json": '--dataset json (each line\'s "text" field is a document; another field: --text_field)',
    "text": "--dataset text (each line is a document)",
    "parquet": '--dataset parquet (the "text" column; another: --text_field)',
}


class FileFingerprint(BaseModel):
    """One of a run's data files as its creator had it: a peer's copy must be the same bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(max_length=1024)
    size_bytes: int = Field(ge=0)
    lines: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


def sniff_format(path: Path) -> str | None:
    """ "parquet", "json" (JSON lines or a JSON document), "text", or None when the head says nothing
    sure (empty, binary or compressed: then the loader is left to judge)."""
    with open(path, "rb") as f:
        head = f.read(_HEAD_BYTES)
    if head.startswith(_PARQUET_MAGIC):
        return "parquet"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the end of the head
            return None
        text = head[: e.start].decode("utf-8")
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if not first:
        return None
    if first[0] in "{[":
        try:
            return "json" if isinstance(json.loads(first), dict | list) else "text"
        except json.JSONDecodeError:
            # a JSON document spread over lines, or a line cut by the head's end: JSON either way;
            # else a line of text that starts with a bracket
            return "json" if first in "{[" or len(first) >= len(text.strip()) else "text"
    return "text"


def check_formats(kind: str, files: Sequence[str]) -> None:
    """Refuses a file the `kind` reader would misread, naming the --dataset that reads it."""
    for file in files:
        found = sniff_format(Path(file))
        if found is not None and found != kind and kind in _READS:
            raise ConfigError(
                f"data file {file} holds {_READS[found]}, not {_READS[kind]} as --dataset {kind} reads: "
                f"pass {_FLAG_FOR[found]}"
            )


def fingerprint(path: Path, name: str) -> FileFingerprint:
    """The file's size, lines (newline bytes, plus a last line without one) and sha256."""
    digest, size, lines, last = hashlib.sha256(), 0, 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return FileFingerprint(
        name=name, size_bytes=size, lines=lines + (last != b"\n"), sha256=digest.hexdigest()
    )


def fingerprints(files: Sequence[str]) -> list[FileFingerprint]:
    """Each file's fingerprint, named as `run create` found it (its pattern's spelling)."""
    return [fingerprint(Path(f), f) for f in files]


def check_fingerprints(recorded: Sequence[FileFingerprint], files: Sequence[str], where: str) -> None:
    """Refuses local `files` that are not, one for one in order, the files the run recorded; `where`
    says where they were looked up (for the message)."""
    if not recorded:
        return  # a run whose creator recorded none (shards are checked by their hash instead)
    if len(files) != len(recorded):
        missing = [r.name for r in recorded[len(files) :]]
        extra = list(files[len(recorded) :])
        detail = f"missing {missing[0]}" if missing else f"extra {extra[0]}"
        raise ConfigError(
            f"the run's data_files match {len(files)} file{'s' * (len(files) != 1)} {where}, the run's "
            f"creator had {len(recorded)} ({detail}): give the folder holding exactly the run's files"
        )
    for file, want in zip(files, recorded, strict=True):
        have = fingerprint(Path(file), want.name)
        if have.sha256 == want.sha256:
            continue
        raise ConfigError(
            f"data file {file} is not the run's {want.name}: it has {have.lines:,} lines and "
            f"{have.size_bytes:,} bytes, the run's {want.lines:,} lines and {want.size_bytes:,} bytes "
            f"(sha256 {have.sha256[:12]}…, the run's {want.sha256[:12]}…): get the run's copy"
        )
