"""Where each document of a run's corpus goes, as far as this peer has read it (`RoutedDocuments`).

A peer that moves to a path it has not trained reads the corpus again from the top to find that
path's documents (peer/data/batches.py). Routing is a pure function of a document's tokens, so what
one path's first pass found out about every document holds for all of them: the index keeps, per
position in the corpus, a hash of the document's text and its path (or the eval split), and a later
pass encodes and routes only the documents that are its own or that no pass has read. A document
whose hash differs at its position (the corpus changed under the same route) is routed again.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Sequence

from peer.data.sources import split_of
from peer.model.route import ROUTE_CHUNK, Route, route_documents

#: the path of a held-out document (never trained on, never routed)
EVAL = -1
#: documents an index records at most (12 bytes each): past them, of a corpus streamed from a hub
#: that no peer reads to its end, every pass routes for itself again
MAX_DOCUMENTS = 10_000_000


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
    ):
        self.route, self.eval_fraction, self.chunk_size = route, eval_fraction, chunk_size
        self.max_documents = max_documents
        # Python's str hash: salted per process, which is where this index lives
        self._hashes = array("q")
        self._paths = array("i")
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._paths)

    def paths(
        self, start: int, texts: Sequence[str], encode: Callable[[str], list[int]], wanted: int
    ) -> list[tuple[int, list[int] | None]]:
        """(path, tokens) of the documents at positions start, start + 1, ...: the path from the
        index where it knows the text there, else from the split and the route (and recorded).
        `tokens` are given for the documents of path `wanted` (encoded once) and None otherwise."""
        hashes = [hash(t) for t in texts]
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
            for i, h, path in found:
                position = start + i
                if position < len(self._paths):  # the corpus changed here: the new text's path
                    self._hashes[position], self._paths[position] = h, path
                elif position == len(self._paths) < self.max_documents:  # passes read in order: no gaps
                    self._hashes.append(h)
                    self._paths.append(path)
