"""How a run's documents become batches for one peer's own path.

Routing is a pure function of a document's tokens, so every peer agrees on it without talking to the
others; a peer keeps only the training documents routed to its path, which is how DiPaCo shards the
data.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from peer.data.routed import RoutedDocuments
from peer.errors import ConfigError
from peer.model.route import ROUTE_CHUNK, Route, route_documents
from peer.model.tokenizer import Tokenizer
from peer.seeding import stable_seed


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


def shard_documents(
    documents: Iterable[str], route: Route, tokenizer: Tokenizer, chunk_size: int = ROUTE_CHUNK
) -> dict[int, list[int]]:
    """Path index -> indices of the documents routed to it (every document, train and eval)."""
    shards: dict[int, list[int]] = {}
    index = 0
    for chunk in _chunks(documents, chunk_size):
        for path in route_documents(route, [encode_document(tokenizer, t) for t in chunk], chunk_size):
            shards.setdefault(path, []).append(index)
            index += 1
    return dict(sorted(shards.items()))


class PathBatches:
    """Endless (batch_size, seq_len + 1) int64 batches from the training documents routed to one path.

    Documents are read once: the first pass routes them `chunk_size` at a time (those that another
    pass sharing `routed` has routed already are looked up instead) and keeps this path's token ids
    (its shard only, about 1/n_paths of the data); later epochs replay that cache in a new seeded
    order. Documents (BOS + tokens + EOS) are packed end to end and cut into windows with a
    stride of seq_len, so every token is a target exactly once; windows pass through a seeded shuffle
    buffer. `tokens_yielded` counts predicted positions, batch_size * seq_len per batch. The stream
    is a function of the documents, the route, the path and `seed`, so `skip(n)` after a restart goes
    on exactly where a stream of the same seed stopped after n batches.
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
        routed: RoutedDocuments | None = None,
    ):
        """`routed`: what other passes over the same documents with the same route found out (a
        peer's streams share one); None: a pass of its own."""
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
        if routed is None:
            routed = RoutedDocuments(route, eval_fraction, chunk_size)
        elif routed.route is not route or routed.eval_fraction != eval_fraction:
            raise ValueError("the routed documents given are of another route or eval split")
        self.routed = routed
        self.tokens_yielded = 0
        self.batches_yielded = 0
        self.docs_seen = 0  # documents read in the first pass, every split and path
        self.docs_routed = 0  # training documents of this path
        self.epoch = 0
        self._rng = random.Random(stable_seed("pathswarm-batches", seed, path_index))
        self._cache: list[np.ndarray] = []
        self._gen: Iterator[torch.Tensor] | None = None
        self._skipping = 0  # batches still to pass over without making them (`skip`)

    def __iter__(self) -> PathBatches:
        return self

    def __next__(self) -> torch.Tensor:
        return next(self._stream())

    def _stream(self) -> Iterator[torch.Tensor]:
        if self._gen is None:
            self._gen = self._batches()
        return self._gen

    def skip(self, n: int) -> None:
        """Passes over the next `n` batches (read, routed and drawn as the stream would, not stacked)."""
        if n < 0:
            raise ValueError(f"cannot skip {n} batches")
        stream, self._skipping = self._stream(), n
        while self._skipping > 0:
            next(stream)

    def _first_pass(self) -> Iterator[np.ndarray]:
        dtype = np.int32 if self.tokenizer.vocab_size < 2**31 else np.int64
        encode = functools.partial(encode_document, self.tokenizer)
        for chunk in _chunks(self.documents, self.chunk_size):
            start, self.docs_seen = self.docs_seen, self.docs_seen + len(chunk)
            for path, tokens in self.routed.paths(start, chunk, encode, wanted=self.path_index):
                if path == self.path_index:
                    doc = np.asarray(tokens, dtype=dtype)
                    self._cache.append(doc)
                    self.docs_routed += 1
                    yield doc

    def _documents_forever(self) -> Iterator[np.ndarray]:
        yield from self._first_pass()
        if not self._cache:
            raise ConfigError(
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
                skipped, self._skipping = self._skipping > 0, max(0, self._skipping - 1)
                out = None if skipped else torch.from_numpy(np.stack(batch).astype(np.int64))
                batch = []
                self.tokens_yielded += self.batch_size * self.seq_len
                self.batches_yielded += 1
                yield out
