"""Batches made ahead of the training loop (`PrefetchedBatches`), on a thread of their own.

Making a batch is Python and numpy: the first pass over a path's shard reads and routes documents,
later ones cut and stack windows. Made in the training loop, that was 3–5% of a rotating peer's
loop on the goodput benchmark (docs/benchmarks/goodput.md, session 37): seconds in which no inner
step ran. One producer thread per stream makes the next `depth` batches while the inner step runs
(its kernels let go of the interpreter), so the loop finds its batch ready.

Off by default (`--prefetch_batches 0`): on CPU peers sharing their cores (the goodput benchmark's
rotation arm, session 42) the time outside the steps rose from 1.5–1.9 to 2.4–2.9 ms a step with
two batches made ahead: the producer's Python competes with the step's for the interpreter, and
no core is idle to take it. Where the step runs on an accelerator and cores are free, it may pay;
that is not measured yet.

The order is the stream's: one producer at a time, first in first out. A stream paused (its peer
moved to another path) keeps what it made, and hands it out first when the peer comes back, so the
data a peer sees is the same as without prefetching. `handed` counts the batches the loop took, not
the ones made: that is where a checkpoint says the stream stands (`PathData.positions`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator

import torch


class _Failed:
    """What the producer met instead of a batch (no documents routed to the path, a file gone)."""

    def __init__(self, error: BaseException):
        self.error = error


class PrefetchedBatches:
    """An endless batch iterator whose next `depth` batches are made by a thread of its own."""

    def __init__(
        self, stream: Iterator[torch.Tensor], handed: int = 0, depth: int = 2, name: str = "batches"
    ):
        """`handed`: batches the stream gave before it was wrapped (a resumed position); `depth` 0: no
        thread, each batch made when it is asked for."""
        if depth < 0:
            raise ValueError(f"prefetch depth {depth} must be >= 0")
        self.stream, self.handed, self.depth, self.name = stream, handed, depth, name
        self._ready: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._failed: _Failed | None = None

    def __iter__(self) -> PrefetchedBatches:
        return self

    def __next__(self) -> torch.Tensor:
        if self.depth == 0:
            batch = next(self.stream)
            self.handed += 1
            return batch
        with self._cond:
            if not self._ready and self._failed is not None:
                raise self._failed.error
            while not self._ready:
                self._start()  # again after a pause from another thread: a wait never outlives its producer
                self._cond.wait()
            item = self._ready.popleft()
            self._cond.notify_all()  # room for the producer
        if isinstance(item, _Failed):
            self._failed = item
            raise item.error
        self.handed += 1
        return item

    @property
    def pending(self) -> int:
        """Batches made and not handed out yet."""
        with self._cond:
            return len(self._ready)

    def pause(self) -> None:
        """Stops the producer once the batch it is making is made (kept); the next `next` starts it
        again. The stream is untouched while paused, so another may share what it reads."""
        with self._cond:
            thread, self._stop = self._thread, True
            self._cond.notify_all()
        if thread is not None:
            thread.join()
        with self._cond:
            self._thread, self._stop = None, False

    def _start(self) -> None:
        # called holding the condition
        if self._thread is None and self._failed is None:
            self._thread = threading.Thread(target=self._produce, name=f"prefetch-{self.name}", daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        while True:
            with self._cond:
                while not self._stop and len(self._ready) >= self.depth:
                    self._cond.wait()
                if self._stop:
                    return
            try:
                item = next(self.stream)
            except BaseException as e:  # handed to the loop, which raises it where it asked for a batch
                item = _Failed(e)
            with self._cond:
                self._ready.append(item)
                self._cond.notify_all()
            if isinstance(item, _Failed):
                return
