"""The batches of every path a peer has trained in this life (`PathData`), so that one it rotates back
to goes on where it stopped.

A path's batches (`PathBatches`) read the run's documents once and keep that path's tokens; later
epochs replay them in a new order. Built afresh at every rotation, a path visited again read and
routed the whole corpus again (on the goodput benchmark, 2–5% of a rotating peer's loop) and started
over from the first documents of its shard, so that a peer moving among paths kept training on the
beginnings of their shards. Kept per path, a visit continues the same stream: the data a peer sees
on a path is one pass after another, whatever its moves. The streams of the `KEPT_PATHS` most
recently trained paths are kept (each holds its shard's token ids, about 1/paths of the corpus);
a new route (a router version) starts the stream of its path again.

The streams share what their first passes found out about every document (`RoutedDocuments`): a
path visited for the first time routes only the documents no earlier pass of this route has read,
and encodes only its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from peer.config import RunManifest
from peer.data.batches import PathBatches
from peer.data.routed import RoutedDocuments
from peer.data.sources import load_documents
from peer.model.route import Route
from peer.seeding import stable_seed


class PathData:
    """A peer's batch streams, one per path trained, the most recent `KEPT_PATHS` of them."""

    KEPT_PATHS = 4

    def __init__(self, manifest: RunManifest, tokenizer, batch_size: int, root: Path | None, seed_of: str):
        """`root`: where the run's local data lies (`check_data`); `seed_of`: what makes this peer's
        data order its own (its peer id)."""
        self.manifest, self.tokenizer, self.batch_size = manifest, tokenizer, batch_size
        self.root, self.seed_of = root, seed_of
        self._streams: dict[int, PathBatches] = {}  # path index -> its stream, least recent first
        self._routed: RoutedDocuments | None = None  # of the latest route a stream was made with

    def batches(
        self, index: int, route: Route, shard_folders: Sequence[Path], step: int
    ) -> Iterator[torch.Tensor]:
        """The batches of path `index` read with `route`: where its stream stopped, or a new one (whose
        order depends on `step`). The first batch is made here: it routes the first documents of the
        shard (seconds on a big corpus), before the peer says it is ready."""
        stream = self._streams.pop(index, None)
        if stream is None or stream.route is not route:
            m = self.manifest
            if self._routed is None or self._routed.route is not route:
                self._routed = RoutedDocuments(route, m.dataset.eval_fraction)
            stream = PathBatches(
                load_documents(m.dataset, root=self.root, shard_folders=shard_folders),
                route, index, self.tokenizer, m.seq_len, self.batch_size,
                seed=stable_seed(self.seed_of, step), eval_fraction=m.dataset.eval_fraction,
                routed=self._routed,
            )  # fmt: skip
        self._streams[index] = stream
        while len(self._streams) > self.KEPT_PATHS:
            del self._streams[next(iter(self._streams))]
        return itertools.chain([next(stream)], stream)
