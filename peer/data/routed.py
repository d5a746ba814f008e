"""Where each document of a run's corpus goes, as far as this peer has read it (`RoutedDocuments`).

A peer that moves to a path it has not trained reads the corpus again from the top to find that
path's documents (peer/data/batches.py). Routing is a pure function of a document's tokens, so what
one path's first pass found out about every document holds for all of them: the index keeps, per
position in the corpus, a hash of the document's text and its path (or the eval split), and a later
pass encodes and routes only the documents that are its own or that no pass has read. A document
whose hash differs at its position (the corpus changed under the same route) is routed again.

Given a `file` (the peer keeps one per run and router version in its checkpoint folder), what the
index learns is appended there as it goes (16 bytes a document) and read back by the next life of
the peer: a restarted peer reads its path's data up to where its stream stood (peer/training/
path_data.py), and without the file it routed every document on the way again — a prefix forward
pass each, about 4 documents for every one it trains on with 4 paths. A torn last record (a kill
mid-write) is dropped; any other record is believed only where the text's hash at its position
still matches.

A run's creator can route the corpus once for every peer (`build_index`, written by `pathswarm run
create` as the run's `routing_index`, peer/run/routing_index.py): a peer given that file (`run_index`)
reads it before its own and routes only what neither covers. DiPaCo shards its data by the router
before training (Douillard et al. 2024); without the shared index every peer made that pass itself,
a prefix forward pass per document: 2.2 points of a rotating peer's loop on the goodput benchmark
(its batches took 4.8% of the loop without the index, 2.6% with it).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from peer.data.sources import split_of
from peer.model.route import ROUTE_CHUNK, Route, route_documents

#: the path of a held-out document (never trained on, never routed)
EVAL = -1
#: documents an index records at most (12 bytes each): past them, of a corpus streamed from a hub
#: that no peer reads to its end, every pass routes for itself again
MAX_DOCUMENTS = 10_000_000
#: one record of an index file: corpus position, the text's hash, its path
RECORD = np.dtype([("position", "<u4"), ("hash", "<i8"), ("path", "<i4")])

logger = logging.getLogger(__name__)


def text_hash(text: str) -> int:
    """A 64-bit hash of a document's text that every process agrees on (kept in index files)."""
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little", signed=True
    )


class RoutedDocuments:
    """Per corpus position: the text's hash and its path (`EVAL` for the eval split), for one route.

    Shared by a peer's path streams (peer/training/path_data.py); 12 bytes per document read, for the
    first `max_documents`."""

    def __init__(
        self,
        route: Route,
        eval_fraction: float,
        chunk_size: int = ROUTE_CHUNK,
        max_documents: int = MAX_DOCUMENTS,
        file: Path | None = None,
        run_index: Path | None = None,
    ):
        """`file`: where this route's index is kept between lives of the peer (read, then appended
        to); None: in memory only. `run_index`: the run's index of this route (`build_index`), read
        first and never written."""
        self.route, self.eval_fraction, self.chunk_size = route, eval_fraction, chunk_size
        self.max_documents = max_documents
        self._hashes = array("q")
        self._paths = array("i")
        self._lock = threading.Lock()
        self.file = file
        self._appending = None
        found = [r for f in (run_index, file) if f is not None and len(r := _records(f))]
        if found:
            self._keep(np.concatenate(found))
        if file is not None:
            _untear(file)

    def _keep(self, records: np.ndarray) -> None:
        # the last record of each position wins (a document that changed there was routed again; the
        # peer's own records come after the run's)
        order = np.argsort(records["position"], kind="stable")
        ordered = records[order]
        last = np.r_[ordered["position"][1:] != ordered["position"][:-1], True]
        kept = ordered[last][: self.max_documents]
        # positions are recorded without gaps, from the first: keep the run of them from 0
        gaps = np.flatnonzero(kept["position"] != np.arange(len(kept)))
        kept = kept[: gaps[0] if len(gaps) else len(kept)]
        self._hashes.frombytes(np.ascontiguousarray(kept["hash"]).astype("<i8").tobytes())
        self._paths.frombytes(np.ascontiguousarray(kept["path"]).astype("<i4").tobytes())

    def close(self) -> None:
        with self._lock:
            if self._appending is not None:
                self._appending.close()
                self._appending = None

    def __len__(self) -> int:
        return len(self._paths)

    def paths(
        self, start: int, texts: Sequence[str], encode: Callable[[str], list[int]], wanted: int | None
    ) -> list[tuple[int, list[int] | None]]:
        """(path, tokens) of the documents at positions start, start + 1, ...: the path from the
        index where it knows the text there, else from the split and the route (and recorded).
        `tokens` are given for the documents of path `wanted` (encoded once) and None otherwise (for
        all, with `wanted` None)."""
        hashes = [text_hash(t) for t in texts]
        known = self._known(start, hashes)
        out: list[tuple[int, list[int] | None]] = [
            (p, None) if p is not None else (EVAL, None) for p in known
        ]
        fresh = [i for i, p in enumerate(known) if p is None]
        train = [i for i in fresh if split_of(texts[i], self.eval_fraction) == "train"]
        token_lists = [encode(texts[i]) for i in train]
        routed = route_documents(self.route, token_lists, self.chunk_size) if train else []
        for i, tokens, path in zip(train, token_lists, routed, strict=True):
            out[i] = (path, tokens if path == wanted else None)
        self._record(start, [(i, hashes[i], out[i][0]) for i in fresh])
        for i, (path, tokens) in enumerate(out):
            if path == wanted and tokens is None:
                out[i] = (path, encode(texts[i]))
        return out

    def _known(self, start: int, hashes: list[int]) -> list[int | None]:
        with self._lock:
            n = len(self._paths)
            return [
                self._paths[start + i] if start + i < n and self._hashes[start + i] == h else None
                for i, h in enumerate(hashes)
            ]

    def _record(self, start: int, found: list[tuple[int, int, int]]) -> None:
        with self._lock:
            kept = []
            for i, h, path in found:
                position = start + i
                if position < len(self._paths):  # the corpus changed here: the new text's path
                    self._hashes[position], self._paths[position] = h, path
                elif position == len(self._paths) < self.max_documents:  # passes read in order: no gaps
                    self._hashes.append(h)
                    self._paths.append(path)
                else:
                    continue
                kept.append((position, h, path))
            if kept and self.file is not None:
                self._append(np.array(kept, dtype=RECORD).tobytes())

    def _append(self, records: bytes) -> None:
        """Appends to the index file (no fsync: a record lost costs routing that document again)."""
        try:
            if self._appending is None:
                self.file.parent.mkdir(parents=True, exist_ok=True)
                self._appending = open(self.file, "ab")  # noqa: SIM115 - kept open, closed in close()
            self._appending.write(records)
            self._appending.flush()
        except OSError as e:
            logger.warning(f"could not keep the routing index in {self.file}: {e}; kept in memory only")
            self.file = None


def _records(file: Path) -> np.ndarray:
    """The whole records of an index file (none where it is missing or unreadable)."""
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        data = b""
    except OSError as e:
        logger.warning(f"could not read the routing index {file}: {e}; routing again")
        data = b""
    return np.frombuffer(data, RECORD, count=len(data) // RECORD.itemsize)


def _untear(file: Path) -> None:
    """Cuts a record torn by a kill off the end of our index file: the next appends start whole."""
    try:
        size = file.stat().st_size
        if size % RECORD.itemsize:
            with open(file, "r+b") as f:
                f.truncate(size - size % RECORD.itemsize)
    except OSError:
        pass  # missing (a first life) or unreadable (said when read)


def build_index(
    route: Route,
    eval_fraction: float,
    texts: Iterable[str],
    encode: Callable[[str], list[int]],
    file: Path,
    max_documents: int,
) -> int:
    """Routes the first `max_documents` of `texts` (the corpus, in order) into a new index `file`, as
    peers' first passes would; returns the documents indexed."""
    file.unlink(missing_ok=True)
    index = RoutedDocuments(route, eval_fraction, file=file, max_documents=max_documents)
    bar = tqdm(desc="routing the corpus", unit="doc", total=max_documents, disable=None)
    try:
        texts = iter(texts)
        while chunk := list(islice(texts, index.chunk_size)):
            start = len(index)
            index.paths(start, chunk[: max_documents - start], encode, wanted=None)
            bar.update(len(index) - start)
            if len(index) >= max_documents:
                break
    finally:
        bar.close()
        index.close()
    if index.file is None:
        raise OSError(f"could not write the routing index {file}")
    return len(index)
