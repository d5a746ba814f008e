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

A checkpoint keeps where each stream stands (`positions`: its seed and the batches it handed out), and
a resumed peer goes on from there (`resume_from`): before, every restart began its path's shard at the
top again, so a volunteer whose machine restarts every hour trained the first hour of its shard over
and over. The stream is a function of its seed, so going on is reading up to the same place again
(`PathBatches.skip`), not storing data.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from peer.config import RunManifest
from peer.data.batches import PathBatches
from peer.data.prefetch import PrefetchedBatches
from peer.data.routed import RoutedDocuments
from peer.data.sources import load_documents
from peer.model.route import Route
from peer.run.routing_index import run_index_file
from peer.seeding import stable_seed

logger = logging.getLogger(__name__)

#: batches a saved position may name at most (a year of 10 steps a second): past it, not a position
MAX_BATCHES = 1 << 32


class PathData:
    """A peer's batch streams, one per path trained, the most recent `KEPT_PATHS` of them."""

    KEPT_PATHS = 4

    def __init__(
        self,
        manifest: RunManifest,
        tokenizer,
        batch_size: int,
        root: Path | None,
        seed_of: str,
        index_dir: Path | None = None,
        prefetch: int = 0,
        artifact_folders: Sequence[Path] = (),
    ):
        """`root`: where the run's local data lies (`check_data`); `seed_of`: what makes this peer's
        data order its own (its peer id); `index_dir`: where the routing index of each router version
        is kept for the next life of the peer (its checkpoint folder; None: not kept); `prefetch`: batches
        made ahead of the loop (`PrefetchedBatches`; 0: none); `artifact_folders`: where the run's
        routing index of the manifest's router is (peer/run/routing_index.py), read before our own."""
        self.manifest, self.tokenizer, self.batch_size = manifest, tokenizer, batch_size
        self.root, self.seed_of, self.index_dir = root, seed_of, index_dir
        self.prefetch, self.run_index = prefetch, run_index_file(manifest, list(artifact_folders))
        #: path index -> its stream, least recent first
        self._streams: dict[int, PrefetchedBatches] = {}
        self._routed: RoutedDocuments | None = None  # of the latest route a stream was made with
        #: a checkpoint's positions not taken up yet: path index -> (seed, batches), and their router
        self._resume: dict[int, tuple[int, int]] = {}
        self._resume_router = 0

    def batches(
        self, index: int, route: Route, shard_folders: Sequence[Path], step: int, router_version: int = 0
    ) -> Iterator[torch.Tensor]:
        """The batches of path `index` read with `route` (of `router_version`, 0: the manifest's
        router): where its stream stopped, in this life or (`resume_from`) the last, or a new one
        (whose order depends on `step`). The first batch is made here: it routes the first documents
        of the shard (seconds on a big corpus), before the peer says it is ready."""
        if router_version != self._resume_router:
            self._resume.clear()  # the positions of another route's streams
        for kept in self._streams.values():
            kept.pause()  # one producer at a time: the streams share what their first passes read
        stream = self._streams.pop(index, None)
        if stream is None or stream.stream.route is not route:
            m = self.manifest
            if self._routed is None or self._routed.route is not route:
                if self._routed is not None:
                    self._routed.close()
                file = None
                if self.index_dir is not None:
                    name = f"{m.run_id}-router{router_version}-eval{m.dataset.eval_fraction}.idx"
                    file = Path(self.index_dir) / "routes" / name
                shared = self.run_index if router_version == 0 else None  # another route's index is no help
                self._routed = RoutedDocuments(route, m.dataset.eval_fraction, file=file, run_index=shared)
            seed, skip = self._resume.pop(index, (stable_seed(self.seed_of, step), 0))
            made = PathBatches(
                load_documents(m.dataset, root=self.root, shard_folders=shard_folders),
                route, index, self.tokenizer, m.seq_len, self.batch_size,
                seed=seed, eval_fraction=m.dataset.eval_fraction, routed=self._routed,
            )  # fmt: skip
            if skip:
                started = time.monotonic()
                logger.info(f"reading path {index}'s data again up to where it stood: {skip} batches in")
                made.skip(skip)
                logger.info(
                    f"path {index}'s data goes on after the {skip} batches its stream gave before the "
                    f"restart (read again in {time.monotonic() - started:.1f} s)"
                )
            stream = PrefetchedBatches(made, handed=skip, depth=self.prefetch, name=f"path{index}")
        self._streams[index] = stream
        while len(self._streams) > self.KEPT_PATHS:
            del self._streams[next(iter(self._streams))]
        return itertools.chain([next(stream)], stream)

    def shutdown(self) -> None:
        """Stops every stream's producer (the peer is leaving)."""
        for stream in self._streams.values():
            stream.pause()
        if self._routed is not None:
            self._routed.close()

    def positions(self, router_version: int) -> dict:
        """Where each kept stream of the latest route stands, for a checkpoint (`resume_from`)."""
        latest = self._routed.route if self._routed is not None else None
        # the batches handed to the loop, not those made ahead of it: a resumed stream makes those again
        streams = {i: (s.stream.seed, s.handed) for i, s in self._streams.items() if s.stream.route is latest}
        if router_version == self._resume_router:
            streams = {**self._resume, **streams}
        return dict(
            router_version=router_version,
            streams=[dict(path=i, seed=seed, batches=n) for i, (seed, n) in sorted(streams.items())],
        )

    def resume_from(self, saved: object) -> None:
        """Takes up a checkpoint's `positions`: each path's stream goes on where it stood, if the route
        is the same. A record that is not one is ignored with a warning (the data starts at the top)."""
        n_paths = self.manifest.model.n_paths
        try:
            version, streams = saved["router_version"], saved["streams"]
            ok = type(version) is int and version >= 0 and isinstance(streams, list)
            resume = {}
            for e in streams if ok else []:
                path, seed, n = e["path"], e["seed"], e["batches"]
                ok = ok and all(type(x) is int for x in (path, seed, n))
                ok = ok and 0 <= path < n_paths and 0 <= seed < 2**64 and 0 <= n <= MAX_BATCHES
                resume[path] = (seed, n)
        except (TypeError, KeyError):
            ok = False
        if not ok:
            logger.warning("the checkpoint's data positions are not a record of streams; data starts again")
            return
        self._resume, self._resume_router = resume, version
