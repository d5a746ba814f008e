"""Where a peer's training text comes from, and how it becomes batches for the peer's own path.

All sources go through Hugging Face `datasets` (the builtin toy corpus too), so a real run swaps in
local text/json/parquet files or a hub dataset by changing the `DatasetSpec` alone. The train/eval
split is a hash of each document and routing is a pure function of its tokens, so every peer agrees
on both without talking to the others; a peer then keeps only the training documents routed to its
path, which is how DiPaCo shards the data.
"""

from __future__ import annotations

import glob
import hashlib
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from peer.corpus import generate_documents
from peer.model import stable_seed
from peer.tokenizer import Tokenizer

Route = Callable[[list[list[int]]], list[int]]
"""Token ids of documents (as made by `encode_document`) -> one path index per document."""

ROUTE_CHUNK = 256


class DatasetSpec(BaseModel):
    """Which documents a run trains on. Frozen: it is part of the signed run manifest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["builtin", "text", "json", "parquet", "hub"] = "builtin"
    data_files: list[str] = []
    name: str | None = None
    split: str = "train"
    text_field: str = "text"
    builtin_docs: int = Field(2000, ge=1)
    seed: int = 0
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _check_source(self) -> DatasetSpec:
        local = self.kind in ("text", "json", "parquet")
        if local and not self.data_files:
            raise ValueError(f"dataset kind {self.kind!r} needs data_files (one or more paths or globs)")
        if not local and self.data_files:
            raise ValueError(f"data_files is only used with kind text/json/parquet, not {self.kind!r}")
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
            raise FileNotFoundError(f"data_files pattern {pattern!r} matches no file")
        files += [m for m in matched if Path(m).is_file() and m not in files]
    # Sorted and deduplicated: every peer reads the same files in the same order.
    return files


def load_documents(spec: DatasetSpec, cache_dir: str | None = None) -> Iterable[str]:
    """The documents of the spec as strings, in a fixed order. Local files are checked and loaded
    right away (errors surface here, not at the first batch); a hub dataset is streamed lazily."""
    import datasets  # heavy import, kept off the path of modules that only need DatasetSpec

    if spec.kind == "builtin":
        ds = datasets.Dataset.from_list(generate_documents(spec.builtin_docs, spec.seed))
        return _texts(ds, "text")
    if spec.kind == "hub":
        ds = datasets.load_dataset(spec.name, split=spec.split, streaming=True, cache_dir=cache_dir)
        return _texts(ds, spec.text_field)
    files = _expand(spec.data_files)
    if not files:
        raise FileNotFoundError(f"data_files {spec.data_files} match only folders, no files")
    ds = datasets.load_dataset(spec.kind, data_files=files, split="train", cache_dir=cache_dir)
    field = "text" if spec.kind == "text" else spec.text_field
    if field not in ds.column_names:
        raise ValueError(
            f"{spec.kind} files have no field {field!r} (fields: {ds.column_names}); set text_field"
        )
    return _texts(ds, field)


def _texts(ds: Iterable[dict], field: str) -> Iterator[str]:
    for row in ds:
        text = row.get(field)
        if text is None:
            raise ValueError(f"a document has no field {field!r} (fields: {sorted(row)}); set text_field")
        # Blank lines of text files (and empty records) are not documents.
        if isinstance(text, str) and text.strip():
            yield text


_SPLIT_SALT = b"pathswarm-split-v1\0"


def split_of(text: str, spec: DatasetSpec | float) -> Literal["train", "eval"]:
    """Train or eval, from a hash of the document alone: every peer and every run agree."""
    fraction = spec if isinstance(spec, float | int) else spec.eval_fraction
    digest = hashlib.sha256(_SPLIT_SALT + text.encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") < fraction * 2**64 else "train"


def eval_documents(spec: DatasetSpec, limit: int | None = None, cache_dir: str | None = None) -> list[str]:
    out: list[str] = []
    if limit is not None and limit <= 0:
        return out
    for text in load_documents(spec, cache_dir=cache_dir):
        if split_of(text, spec) == "eval":
            out.append(text)
            if limit is not None and len(out) >= limit:
                break
    return out


def encode_document(tokenizer: Tokenizer, text: str) -> list[int]:
    """BOS + tokens + EOS: the form that is both routed and trained on."""
    return [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _route_checked(route: Route, token_lists: list[list[int]]) -> list[int]:
    paths = [int(p) for p in route(token_lists)]
    if len(paths) != len(token_lists):
        raise ValueError(f"route returned {len(paths)} paths for {len(token_lists)} documents")
    return paths


def shard_documents(
    documents: Iterable[str], route: Route, tokenizer: Tokenizer, chunk_size: int = ROUTE_CHUNK
) -> dict[int, list[int]]:
    """Path index -> indices of the documents routed to it (every document, train and eval)."""
    shards: dict[int, list[int]] = {}
    index = 0
    for chunk in _chunks(documents, chunk_size):
        for path in _route_checked(route, [encode_document(tokenizer, t) for t in chunk]):
            shards.setdefault(path, []).append(index)
            index += 1
    return dict(sorted(shards.items()))


class PathBatches:
    """Endless (batch_size, seq_len + 1) int64 batches from the training documents routed to one path.

    Documents are read once: the first pass routes them `chunk_size` at a time and keeps this path's
    token ids (its shard only, about 1/n_paths of the data); later epochs replay that cache in a new
    seeded order. Documents (BOS + tokens + EOS) are packed end to end and cut into windows with a
    stride of seq_len, so every token is a target exactly once; windows pass through a seeded shuffle
    buffer. `tokens_yielded` counts predicted positions, batch_size * seq_len per batch.
    """

    def __init__(
        self,
        documents: Iterable[str],
        route: Route,
        path_index: int,
        tokenizer: Tokenizer,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        eval_fraction: float = 0.05,
        chunk_size: int = ROUTE_CHUNK,
        shuffle_buffer: int = 1024,
    ):
        if seq_len < 1 or batch_size < 1 or chunk_size < 1 or shuffle_buffer < 1:
            raise ValueError("seq_len, batch_size, chunk_size and shuffle_buffer must all be >= 1")
        self.documents = documents
        self.route = route
        self.path_index = path_index
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.eval_fraction = eval_fraction
        self.chunk_size = chunk_size
        self.shuffle_buffer = shuffle_buffer
        self.tokens_yielded = 0
        self.batches_yielded = 0
        self.docs_seen = 0  # documents read in the first pass, every split and path
        self.docs_routed = 0  # training documents of this path
        self.epoch = 0
        self._rng = random.Random(stable_seed("pathswarm-batches", seed, path_index))
        self._cache: list[np.ndarray] = []
        self._gen: Iterator[torch.Tensor] | None = None

    def __iter__(self) -> PathBatches:
        return self

    def __next__(self) -> torch.Tensor:
        if self._gen is None:
            self._gen = self._batches()
        return next(self._gen)

    def _first_pass(self) -> Iterator[np.ndarray]:
        dtype = np.int32 if self.tokenizer.vocab_size < 2**31 else np.int64
        for chunk in _chunks(self.documents, self.chunk_size):
            self.docs_seen += len(chunk)
            train = [t for t in chunk if split_of(t, self.eval_fraction) == "train"]
            if not train:
                continue
            token_lists = [encode_document(self.tokenizer, t) for t in train]
            for tokens, path in zip(token_lists, _route_checked(self.route, token_lists), strict=True):
                if path == self.path_index:
                    doc = np.asarray(tokens, dtype=dtype)
                    self._cache.append(doc)
                    self.docs_routed += 1
                    yield doc

    def _documents_forever(self) -> Iterator[np.ndarray]:
        yield from self._first_pass()
        if not self._cache:
            raise ValueError(
                f"no training documents are routed to path {self.path_index} "
                f"({self.docs_seen} documents read); check the router and the dataset"
            )
        while True:
            self.epoch += 1
            order = list(range(len(self._cache)))
            self._rng.shuffle(order)
            for i in order:
                yield self._cache[i]

    def _windows(self) -> Iterator[np.ndarray]:
        pending: list[np.ndarray] = []
        n_pending = 0
        for doc in self._documents_forever():
            pending.append(doc)
            n_pending += len(doc)
            if n_pending <= self.seq_len:
                continue
            stream = np.concatenate(pending)
            n_windows = (len(stream) - 1) // self.seq_len
            for w in range(n_windows):
                yield stream[w * self.seq_len : w * self.seq_len + self.seq_len + 1]
            # The last target of one window is the first input of the next.
            rest = stream[n_windows * self.seq_len :]
            pending, n_pending = [rest], len(rest)

    def _batches(self) -> Iterator[torch.Tensor]:
        buffer: list[np.ndarray] = []
        batch: list[np.ndarray] = []
        for window in self._windows():
            if len(buffer) < self.shuffle_buffer:
                buffer.append(window)
                continue
            # Swap a random buffered window out for the new one.
            i = self._rng.randrange(len(buffer))
            batch.append(buffer[i])
            buffer[i] = window
            if len(batch) == self.batch_size:
                out = torch.from_numpy(np.stack(batch).astype(np.int64))
                batch = []
                self.tokens_yielded += self.batch_size * self.seq_len
                self.batches_yielded += 1
                yield out
