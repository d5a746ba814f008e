"""Checkpoints written on a thread of their own (`CheckpointWriter`), so that training never waits for
the disk.

A peer checkpoints at every round's end by default. Written on the training thread, that is the
serialisation plus three fsyncs each round: 1–7% of the loop's time on the goodput benchmark's tiny
model (docs/benchmarks/goodput.md), seconds per round for a model of billions of parameters. The
training thread now only copies the tensors (`snapshot_tensors`) and hands the copy over; one writer
thread saves it with `save_checkpoint`, crash-safe as before. A crash while a write is in flight
loses that write only: the previous checkpoint is complete and is what `--resume` finds.

Memory stays bounded: at most one snapshot waits while one is written. A newer snapshot replaces a
waiting one (the older would be pruned at once anyway); the one being written is never dropped.
Failures (a full disk) are kept and handed to the caller by `errors()`, since nobody waits on them.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from peer.checkpoint.store import CheckpointError, EncodedMeta, TensorSnapshot, encode_meta, save_checkpoint

logger = logging.getLogger(__name__)


class CheckpointWriter:
    """One background writer of checkpoints into `directory`, keeping the latest `keep`."""

    def __init__(self, directory: Path, keep: int):
        self.directory = Path(directory)
        self.keep = keep
        self._cond = threading.Condition()
        self._waiting: tuple[TensorSnapshot, EncodedMeta] | None = None
        self._writing = False
        self._errors: list[str] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        #: the step of the last checkpoint this writer completed (-1: none yet)
        self.written_step = -1

    def submit(self, tensors: TensorSnapshot, meta: dict[str, Any]) -> None:
        """Queues a checkpoint (tensors already copied). `meta` is encoded here, on the caller's thread:
        nothing the caller changes later can reach what is written (raises CheckpointError when it is
        not JSON-serialisable)."""
        meta = encode_meta(meta)
        with self._cond:
            if self._closed:
                raise CheckpointError(f"the checkpoint writer of {self.directory} is closed")
            if self._waiting is not None:
                logger.debug(
                    f"checkpoint step {self._waiting[1].step} replaced by step {meta.step} "
                    "before it was written (the disk is slower than the rounds)"
                )
            self._waiting = (tensors, meta)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout_seconds: float | None = None) -> bool:
        """Waits until every queued checkpoint is written (or failed); False if `timeout_seconds` passed."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting is None and not self._writing, timeout_seconds)

    def errors(self) -> list[str]:
        """The failures since the last call, oldest first (each names the step and the reason)."""
        with self._cond:
            errors, self._errors = self._errors, []
        return errors

    def close(self, timeout_seconds: float | None = None) -> bool:
        """Writes what is queued, then stops the thread; False if that took longer than the timeout."""
        done = self.flush(timeout_seconds)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if done and self._thread is not None:  # idle now: it returns at once (none may outlive the peer)
            self._thread.join(timeout=timeout_seconds)
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting is not None or self._closed)
                if self._waiting is None:
                    return
                (tensors, meta), self._waiting = self._waiting, None
                self._writing = True
            try:
                save_checkpoint(self.directory, tensors, meta, keep=self.keep)
                failed = None
            except CheckpointError as e:
                failed = str(e)
            except Exception as e:  # the thread must outlive any one write; the caller hears of it
                failed = f"writing checkpoint step {meta.step} failed: {type(e).__name__}: {e}"
            with self._cond:
                self._writing = False
                if failed is None:
                    self.written_step = meta.step
                else:
                    self._errors.append(failed)
                self._cond.notify_all()
