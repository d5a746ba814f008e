"""Where a run's documents come from, and which of them are held out.

All sources go through Hugging Face `datasets` (the builtin toy corpus too), so a real run swaps in
local text/json/parquet files or a hub dataset by changing the `DatasetSpec` alone. The train/eval
split is a hash of each document, so every peer agrees on it without talking to the others.
"""

from __future__ import annotations

import glob
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from peer.artifacts.ref import ArtifactRef
from peer.artifacts.store import require_artifact
from peer.data.corpus import iter_documents
from peer.data.files import FileFingerprint, check_formats
from peer.errors import ConfigError

#: a manifest names at most this many shards (each reference is about 300 bytes of the manifest)
MAX_SHARDS = 4096


class DatasetSpec(BaseModel):
    """Which documents a run trains on. Frozen: it is part of the signed run manifest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["builtin", "text", "json", "parquet", "hub"] = Field(
        "builtin",
        description="where the documents come from: builtin (the built-in corpus), local --data_files "
        "of text (one document per line), json (JSON lines, the document in --text_field) or parquet, "
        "or hub (--dataset_name)",
        json_schema_extra={"flag": "dataset"},
    )
    data_files: list[str] = Field([], description="local files or globs (text/json/parquet)")
    #: each of data_files' files as `run create` found it (peer/data/files.py): a peer refuses a copy
    #: of its own that differs
    fingerprints: list[FileFingerprint] = Field(default_factory=list, max_length=MAX_SHARDS)
    #: the run's local files by content hash, in order: served over P2P like its base model, so a
    #: volunteer needs no copy of its own (`run create --share_data`); replaces data_files
    shards: list[ArtifactRef] = Field(default_factory=list, max_length=MAX_SHARDS)
    name: str | None = Field(
        None,
        description="hub dataset name (streamed), for --dataset hub",
        json_schema_extra={"flag": "dataset_name"},
    )
    split: str = "train"
    text_field: str = Field("text", description="the field of a json/parquet/hub record that holds the text")
    builtin_docs: int = Field(2000, ge=1)
    seed: int = 0
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _check_source(self) -> DatasetSpec:
        local = self.kind in ("text", "json", "parquet")
        if local and not self.data_files and not self.shards:
            raise ValueError(f"dataset kind {self.kind!r} needs data_files (one or more paths or globs)")
        if not local and (self.data_files or self.shards):
            raise ValueError(
                f"data_files and shards are only used with kind text/json/parquet, not {self.kind!r}"
            )
        if self.fingerprints and not self.data_files:
            raise ValueError("fingerprints are of data_files' files: a dataset without data_files has none")
        if self.data_files and self.shards:
            raise ValueError(
                "a dataset names its files either by path (data_files) or by hash (shards), not both"
            )
        if self.kind == "hub" and not self.name:
            raise ValueError("dataset kind 'hub' needs a dataset name, e.g. name='HuggingFaceFW/fineweb-edu'")
        if self.kind != "hub" and self.name is not None:
            raise ValueError(
                f"name is only used with kind 'hub', not {self.kind!r}; local files go in data_files"
            )
        return self


def _expand(patterns: list[str]) -> list[str]:
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        if not matched:
            raise ConfigError(f"data_files pattern {pattern!r} matches no file")
        files += [m for m in matched if Path(m).is_file() and m not in files]
    # Sorted and deduplicated: every peer reads the same files in the same order.
    return files


def shard_files(spec: DatasetSpec, folders: Sequence[Path]) -> list[str]:
    """The run's shards as files, in the manifest's order, from the first of `folders` that holds
    each (see `require_artifact`)."""
    return [str(require_artifact(ref, folders, f"the run's data shard {ref.name}")) for ref in spec.shards]


def local_files(spec: DatasetSpec, root: Path | None = None, shard_folders: Sequence[Path] = ()) -> list[str]:
    """The local files a spec names, checked to exist. A spec with shards names them by hash: they are
    looked up in `shard_folders`. With `root` (a manifest from the swarm: a stranger chose these
    patterns), patterns must be relative, stay inside `root`, and are resolved under it, so a run
    cannot make a volunteer train on files elsewhere on their disk."""
    if spec.shards:
        return shard_files(spec, shard_folders)
    if root is None:
        return _expand(spec.data_files)
    base = Path(root).expanduser().resolve()
    if not base.is_dir():
        raise ConfigError(f"--data_root {root} is not a folder")
    for pattern in spec.data_files:
        if Path(pattern).is_absolute() or ".." in Path(pattern).parts or pattern.startswith("~"):
            raise ConfigError(f"the run's data_files pattern {pattern!r} leaves --data_root: refused")
    files = _expand([str(base / p) for p in spec.data_files])
    outside = [f for f in files if not Path(f).resolve().is_relative_to(base)]
    if outside:
        raise ConfigError(f"data file {outside[0]} resolves outside --data_root {base}: refused")
    return files


def load_documents(
    spec: DatasetSpec,
    cache_dir: str | None = None,
    root: Path | None = None,
    shard_folders: Sequence[Path] = (),
) -> Iterable[str]:
    """The documents of the spec as strings, in a fixed order. Local files are checked and loaded
    right away (errors surface here, not at the first batch); a hub dataset is streamed lazily.
    `root` and `shard_folders`: see `local_files`."""
    if spec.kind == "builtin":  # without `datasets`: its import is a second and a half of every start
        return _texts(iter_documents(spec.builtin_docs, spec.seed), "text")
    import datasets  # heavy import, kept off the path of modules that only need DatasetSpec

    if spec.kind == "hub":
        ds = datasets.load_dataset(spec.name, split=spec.split, streaming=True, cache_dir=cache_dir)
        return _texts(ds, spec.text_field)
    files = local_files(spec, root, shard_folders)
    if not files:
        raise ConfigError(f"data_files {spec.data_files} match only folders, no files")
    check_formats(spec.kind, files)  # a reader given another format trains on garbage, silently
    ds = datasets.load_dataset(spec.kind, data_files=files, split="train", cache_dir=cache_dir)
    field = "text" if spec.kind == "text" else spec.text_field
    if field not in ds.column_names:
        raise ConfigError(
            f"{spec.kind} files have no field {field!r} (fields: {ds.column_names}); set text_field"
        )
    return _texts(ds, field)


def _texts(ds: Iterable[dict], field: str) -> Iterator[str]:
    for row in ds:
        text = row.get(field)
        if text is None:
            raise ConfigError(f"a document has no field {field!r} (fields: {sorted(row)}); set text_field")
        # Blank lines of text files (and empty records) are not documents.
        if isinstance(text, str) and text.strip():
            yield text


_SPLIT_SALT = b"pathswarm-split-v1\0"


def split_of(text: str, spec: DatasetSpec | float) -> Literal["train", "eval"]:
    """Train or eval, from a hash of the document alone: every peer and every run agree."""
    fraction = spec if isinstance(spec, float | int) else spec.eval_fraction
    digest = hashlib.sha256(_SPLIT_SALT + text.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") < fraction * 2**64 else "train"


def eval_documents(
    spec: DatasetSpec,
    limit: int | None = None,
    cache_dir: str | None = None,
    shard_folders: Sequence[Path] = (),
) -> list[str]:
    out: list[str] = []
    if limit is not None and limit <= 0:
        return out
    for text in load_documents(spec, cache_dir=cache_dir, shard_folders=shard_folders):
        if split_of(text, spec) == "eval":
            out.append(text)
            if limit is not None and len(out) >= limit:
                break
    return out
