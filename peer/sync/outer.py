"""The outer loop of one peer: Streaming DiLoCo over every module on its path.

Each module is cut into P fragments; fragment p of every module starts syncing after inner steps
t ≡ p·H/P (mod H) (arXiv 2501.18512), so about 1/P of the parameters is on the wire at once. The
all-reduce runs in the background (hivemind's averager process) while inner steps go on; τ steps
later the outer step is applied to the fragment's global copy and merged into the local model with
α. τ = 0 blocks until the average is in (P = 1, τ = 0 is plain per-module DiLoCo). A module held by
nobody else, or a group that does not form in time, still gets its outer step, from this peer's
own Δ, and the miss is logged and counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from monitoring.metrics import PeerMetrics
from peer.config import RunManifest
from peer.sync.averager import RoundResult
from peer.sync.fragments import fragments_due
from peer.sync.module_sync import ModuleSync, StateRejected

logger = logging.getLogger(__name__)

#: (module, round) -> (subgroup index, members) of this peer's planned averaging subgroup, or None
#: when every holder averages together
GroupOf = Callable[[str, int], tuple[int, list[str]] | None]


@dataclass
class PendingSync:
    """A fragment sync in flight: started after one step, applied at `due_step`."""

    fragment: int
    due_step: int
    weight: float
    controls: dict[str, object] = field(default_factory=dict)
    results: dict[str, RoundResult] = field(default_factory=dict)


@dataclass
class FragmentDone:
    """One fragment's sync, finished and applied for every module of the path."""

    fragment: int
    step: int
    results: dict[str, RoundResult]

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.results.values())

    def summary(self) -> dict[str, str]:
        return {mid: f"{r.outcome}/{r.group_size}" for mid, r in self.results.items()}


@dataclass
class SyncTotals:
    """Counts since this peer started: module syncs by outcome, rejected parts by reason, bytes."""

    outcomes: dict[str, int] = field(default_factory=dict)
    bad_parts: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0

    def add(self, r: RoundResult) -> None:
        self.outcomes[r.outcome] = self.outcomes.get(r.outcome, 0) + 1
        for reason, count in r.bad_parts.items():
            self.bad_parts[reason] = self.bad_parts.get(reason, 0) + count
        self.bytes_sent += r.bytes_sent
        self.bytes_received += r.bytes_received


class StreamingOuter:
    """Starts each fragment's sync at its offset and applies it τ steps later, for every module."""

    def __init__(
        self,
        syncs: dict[str, ModuleSync],
        manifest: RunManifest,
        peer_id: str,
        metrics: PeerMetrics,
        group_of: GroupOf | None = None,
        round_of: Callable[[], int] | None = None,
    ):
        """`group_of(module, round)` gives this peer's planned subgroup of the module's holders
        (None: all holders average together); `round_of()` the swarm's round, which rotates them."""
        self.syncs = syncs
        self.group_of = group_of
        self.round_of = round_of
        self.sync = manifest.sync
        self.inner_steps = manifest.inner_steps
        self.peer_id = peer_id
        self.metrics = metrics
        self.pending: list[PendingSync] = []
        self._tokens_at_sync = [0] * manifest.sync.fragments
        self.outer_round_index = 0  # tag for gathered metadata
        self.totals = SyncTotals()

    def reset_tokens(self, tokens_total: int) -> None:
        self._tokens_at_sync = [tokens_total] * self.sync.fragments

    def after_step(self, step: int, tokens_total: int, holders: dict[str, list[str]]) -> list[FragmentDone]:
        """Starts the syncs due after inner step `step` and finishes those whose τ ran out."""
        for fragment in fragments_due(step, self.inner_steps, self.sync.fragments):
            self._start(fragment, step, tokens_total, holders)
        done = []
        for pending in [p for p in self.pending if p.due_step <= step]:
            done.append(self._finish(pending, step))
        return done

    def drain(self, step: int) -> list[FragmentDone]:
        """Finishes every sync still in flight (before a checkpoint or leaving)."""
        return [self._finish(p, step) for p in list(self.pending)]

    def _start(self, fragment: int, step: int, tokens_total: int, holders: dict[str, list[str]]) -> None:
        weight = max(1, tokens_total - self._tokens_at_sync[fragment])
        self._tokens_at_sync[fragment] = tokens_total
        pending = PendingSync(fragment, step + self.sync.overlap_steps, float(weight))
        for mid, ms in self.syncs.items():
            if ms.fragment_size(fragment) == 0:
                continue
            delta = ms.outer_gradient(fragment)
            n_holders = len(set(holders.get(mid, [])) | {self.peer_id})
            round_index = self.round_of() if self.round_of else 0
            group = self.group_of(mid, round_index) if self.group_of else None
            if group is not None:
                n_holders = len(group[1])
            if n_holders < 2 or ms.averager is None:
                pending.results[mid] = RoundResult("alone", delta, 1, detail="no other holder")
                continue
            subgroup = None if group is None else group[0]
            ms.averager.set_group(fragment, self.sync.fragments, subgroup, round_index)
            ms.averager.set_target_group_size(n_holders)
            pending.controls[mid] = ms.averager.start_round(
                delta,
                weight,
                self.outer_round_index,
                timeout=self.sync.averaging_timeout_seconds,
                global_fingerprint=ms.averager.fingerprint(ms.global_flats[fragment]),
                module_round=ms.fragment_rounds[fragment],
                fragment=fragment,
            )
        self.pending.append(pending)

    def _finish(self, pending: PendingSync, step: int) -> FragmentDone:
        self.pending.remove(pending)
        fragment = pending.fragment
        for mid, control in pending.controls.items():
            pending.results[mid] = self.syncs[mid].averager.finish_round(
                control, self.sync.averaging_timeout_seconds + 10
            )
        alpha = None if self.sync.overlap_steps == 0 else self.sync.mixing_alpha
        for mid, r in pending.results.items():
            ms = self.syncs[mid]
            ms.apply(fragment, r.delta, alpha)
            if r.repair_from:
                self._repair(ms, fragment, r.repair_from)
            self.metrics.observe_round(r.outcome, r.seconds, r.group_size, r.bytes_sent, r.bytes_received)
            self.totals.add(r)
            for reason, count in r.bad_parts.items():
                for _ in range(count):
                    self.metrics.bad_part(reason)
            if r.outcome not in ("averaged", "alone"):
                logger.warning(
                    f"{mid} fragment {fragment}: went on with our own outer gradient "
                    f"({r.outcome}: {r.detail})"
                )
        if fragment == 0:
            self.outer_round_index += 1
        return FragmentDone(fragment, step, pending.results)

    def _repair(self, ms: ModuleSync, fragment: int, donors: dict[str, int], attempts: int = 10) -> bool:
        """Our copy disagreed with the group's majority before this round: take a majority member's
        state once it has applied this round as well."""
        for attempt in range(attempts):
            got = ms.averager.download_state(sorted(donors), timeout=self.sync.averaging_timeout_seconds)
            if got is None:
                continue
            donor, metadata, tensors = got
            rounds = metadata.get("fragment_rounds") if isinstance(metadata, dict) else None
            if not isinstance(rounds, list) or len(rounds) <= fragment or rounds[fragment] < donors[donor]:
                time.sleep(0.2 * (attempt + 1))  # the donor has not applied this round yet
                continue
            try:
                ms.load_state(metadata, tensors)
            except StateRejected as e:
                logger.warning(f"refused repair state from {donor}: {e}")
                continue
            logger.warning(
                f"{ms.module_id}: our copy had drifted from the group's majority; repaired from {donor}"
            )
            return True
        logger.error(f"{ms.module_id}: could not repair a drifted copy; will try again next round")
        return False
