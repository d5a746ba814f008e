"""A peer's checkpoints (`PeerCheckpoints`): what it writes to --checkpoint_dir and how it resumes.

A checkpoint holds the sync layer's state (global copies, outer momentum), the path model's own
weights (`local/<name>`) and a meta dict: the counters, the path and the paths trained before a
rotation, every fragment's round, the round history, and the router version trained with. The store
(peer/checkpoint/) writes it crash-safe and prunes to --keep_checkpoints, on a writer thread of its own
(`CheckpointWriter`: training copies the tensors and goes on); the directory lock keeps a
second peer out of the directory for the whole life of this one, and a directory that holds
checkpoints is taken only with --resume (a fresh start there would prune them).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from peer.checkpoint import (
    CheckpointDirLock,
    CheckpointError,
    CheckpointWriter,
    list_checkpoints,
    load_latest_checkpoint,
    snapshot_tensors,
)
from peer.config import PeerConfig
from peer.errors import ConfigError
from peer.model.transformer import PathModel
from peer.sync.path_sync import PathSync
from peer.sync.sent_rounds import SentRounds
from peer.training.history import RoundHistory

logger = logging.getLogger(__name__)

#: round-history entries a checkpoint keeps (the meta stays small; `own_rounds` keeps the count)
HISTORY_KEPT = 200
#: how long leaving waits for the checkpoints still being written (a hung disk must not pin the peer)
FLUSH_TIMEOUT_SECONDS = 120.0


@dataclass
class Counters:
    """A peer's training counters, as a checkpoint keeps them."""

    step: int
    outer_round: int
    tokens_total: int
    #: path index -> inner steps this peer trained on it: now, as of its last round's end, in that round
    #: (what its claims say: a resumed peer's claims count as the last before its stop did)
    path_steps: dict[int, int]
    round_path_steps: dict[int, int] = field(default_factory=dict)
    round_steps: dict[int, int] = field(default_factory=dict)


class PeerCheckpoints:
    """Writes and restores one peer's checkpoints; a no-op without --checkpoint_dir."""

    def __init__(self, config: PeerConfig):
        self.config = config
        #: the step of the last checkpoint taken (-1: none): rotation and close skip a repeat
        self.saved_step = -1
        self._writer = (
            CheckpointWriter(config.checkpoint_dir, config.keep_checkpoints)
            if config.checkpoint_dir is not None
            else None
        )
        self._lock: CheckpointDirLock | None = None
        self._sent: SentRounds | None = None

    def lock(self) -> None:
        """Takes the directory (before anything joins: a second peer here stops at once), and refuses
        one that holds checkpoints when the peer does not --resume from them: a fresh start there
        would prune them as it saves its own."""
        if self.config.checkpoint_dir is not None:
            self._lock = CheckpointDirLock(self.config.checkpoint_dir).acquire()
            if not self.config.resume:
                try:
                    self._refuse_earlier_checkpoints()
                except ConfigError:
                    self.release()
                    raise

    def _refuse_earlier_checkpoints(self) -> None:
        saved = [info for info in list_checkpoints(self.config.checkpoint_dir) if info.complete]
        if not saved:
            return
        meta = saved[-1].manifest.get("meta") or {}
        run, where = meta.get("run"), f"--checkpoint_dir {self.config.checkpoint_dir}"
        held = f"checkpoints of run {run} up to step {saved[-1].step}" if run else "checkpoints"
        if run == self.config.run_name:
            raise ConfigError(
                f"{where} already holds {held}: pass --resume to continue from them, or give another "
                "--checkpoint_dir to start afresh (nothing was deleted)"
            )
        raise ConfigError(
            f"{where} already holds {held}, not of run {self.config.run_name}: give another "
            "--checkpoint_dir (nothing was deleted)"
        )

    def release(self) -> None:
        """Writes what is queued, then gives the directory back."""
        if self._writer is not None and not self._writer.close(FLUSH_TIMEOUT_SECONDS):
            logger.error(f"a checkpoint was still being written after {FLUSH_TIMEOUT_SECONDS:.0f} s; leaving")
        if self._lock is not None:
            self._lock.release()

    def errors(self) -> list[str]:
        """The background writes that failed since the last call (each names its step and reason)."""
        return self._writer.errors() if self._writer is not None else []

    def sent_rounds(self, run_id: str) -> SentRounds:
        """The rounds this peer sent parts for, in this directory (read once per life, at first use)."""
        if self._sent is None:
            self._sent = SentRounds(self.config.checkpoint_dir, run_id)
        return self._sent

    def load(self, run_id: str) -> tuple[dict[str, torch.Tensor], dict] | None:
        """The latest checkpoint (tensors, meta), None if there is none; refuses another run's."""
        loaded = load_latest_checkpoint(self.config.checkpoint_dir)
        if loaded is None:
            logger.info(f"no checkpoint in {self.config.checkpoint_dir}; starting fresh")
            return None
        tensors, meta = loaded
        if meta.get("run_id") != run_id:
            raise ConfigError(f"checkpoint in {self.config.checkpoint_dir} belongs to another run")
        return tensors, meta

    def save(
        self,
        counters: Counters,
        sync: PathSync,
        model: PathModel,
        history: RoundHistory,
        *,
        run_id: str,
        peer_id: str,
        path: tuple[int, ...],
        loss: float,
        extra_meta: dict,
        wait: bool = False,
    ) -> None:
        """Takes a checkpoint of the peer training `path` (nothing without --checkpoint_dir) and has it
        written in the background, or before returning with `wait` (raising CheckpointError if that
        write, or one queued before it, failed); `extra_meta`: the router version it trains with
        (`RouterFollower.meta`), its contribution, where its data streams stand (`PathData.positions`)."""
        if self._writer is None:
            return
        tensors = sync.state_tensors()
        for name, p in model.named_parameters():
            tensors[f"local/{name}"] = p.detach()
        snapshot = snapshot_tensors(tensors)  # on this thread: training changes the originals next
        meta = dict(
            step=counters.step,
            run_id=run_id,
            run=self.config.run_name,
            path=list(path),
            path_steps={str(p): n for p, n in sorted(counters.path_steps.items())},
            round_path_steps={str(p): n for p, n in sorted(counters.round_path_steps.items())},
            round_steps={str(p): n for p, n in sorted(counters.round_steps.items())},
            outer_round=counters.outer_round,
            fragment_rounds=sync.fragment_rounds(),
            tokens_total=counters.tokens_total,
            peer_id=peer_id,
            loss=loss if math.isfinite(loss) else None,
            history=history.entries[-HISTORY_KEPT:],
            own_rounds=history.own_rounds,
            train_seconds=history.train_seconds,
            **extra_meta,
        )
        self._writer.submit(snapshot, meta)
        self.saved_step = counters.step
        if wait:
            if not self._writer.flush(FLUSH_TIMEOUT_SECONDS):
                late = f"{FLUSH_TIMEOUT_SECONDS:.0f} s"
                raise CheckpointError(f"checkpoint step {counters.step} not written after {late}")
            if errors := self._writer.errors():
                raise CheckpointError("; ".join(errors))

    def restore(
        self,
        tensors: dict[str, torch.Tensor],
        meta: dict,
        path_index: int,
        sync: PathSync,
        model: PathModel,
        history: RoundHistory,
    ) -> Counters:
        """Loads a checkpoint into `sync`, `model` and `history` (of the path it names, `path_index`);
        returns the counters it holds."""
        step, outer_round = int(meta["step"]), int(meta["outer_round"])
        tokens_total = int(meta.get("tokens_total", 0))
        # a checkpoint from before rotation trained only the path it names
        steps = meta.get("path_steps") or {path_index: step}
        path_steps = {int(p): int(n) for p, n in steps.items() if int(n) > 0}
        # as of the last round's end (a checkpoint from before session 46: the steps it was taken at)
        round_end = {int(p): int(n) for p, n in (meta.get("round_path_steps") or path_steps).items()}
        in_round = {int(p): int(n) for p, n in (meta.get("round_steps") or {}).items()}
        own = meta.get("own_rounds")
        history.restore(
            meta.get("history", []), float(meta.get("train_seconds", 0.0)), None if own is None else int(own)
        )
        sync.restore(tensors, meta.get("fragment_rounds"), outer_round, tokens_total)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(tensors[f"local/{name}"].to(p.dtype))
        logger.info(
            f"resumed from checkpoint at step {step}, outer round {outer_round} "
            f"(own rounds {history.own_rounds}), fragment rounds {sync.fragment_rounds()}"
        )
        return Counters(step, outer_round, tokens_total, path_steps, round_end, in_round)
