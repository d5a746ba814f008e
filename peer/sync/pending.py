"""What the outer loop keeps of its fragment syncs (`peer/sync/outer.py`): a sync in flight
(`PendingSync`), one finished and applied (`FragmentDone`), and the counts since the peer started
(`SyncTotals`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from peer.sync.rounds import RoundResult


@dataclass
class PendingSync:
    """A fragment sync in flight: started after one step, applied at `due_step`."""

    fragment: int
    due_step: int
    weight: float
    futures: dict[str, object] = field(default_factory=dict)
    #: each module's own Δ at the start (error feedback added in), which it applies if its round failed
    deltas: dict[str, object] = field(default_factory=dict)
    #: each module's state epoch at the start: a round started before a download does not apply
    epochs: dict[str, int] = field(default_factory=dict)
    #: each module's digest of the copy it reported at the start
    digests: dict[str, str] = field(default_factory=dict)
    results: dict[str, RoundResult] = field(default_factory=dict)
    #: each module's outer step, computed off the training thread as soon as its round ended
    prepared: dict[str, Future] = field(default_factory=dict)
    #: when the loop reached `due_step` with the round still running and trained on (`StreamingOuter.due`)
    held_since: float | None = None
    held_steps: int = 0
    #: the rounds a sit-out held past the hold, split off the fragment's sync (`StreamingOuter.due`):
    #: the schedule goes on without them, and they are applied when they end
    detached: bool = False
    #: when its rounds were started (monotonic), and when each module's round ended: how long the
    #: sync took beside the τ steps meant to hide it (`OverlapTuner`)
    started_at: float | None = None
    ended_at: dict[str, float] = field(default_factory=dict)

    def finished(self) -> bool:
        return all(f.done() for f in self.futures.values())

    def took_seconds(self) -> float | None:
        """From the start to its last round's end; None while one has not ended or it never started."""
        if self.started_at is None or not self.futures or set(self.ended_at) != set(self.futures):
            return None
        return max(0.0, max(self.ended_at.values()) - self.started_at)


@dataclass
class FragmentDone:
    """One fragment's sync, finished and applied for every module of the path."""

    fragment: int
    step: int
    results: dict[str, RoundResult]
    #: τ in effect when it was applied (raised from the manifest's when syncs outlast it)
    overlap_steps: int = 0
    #: rounds of modules that sat out a round, applied after the fragment's other modules: not an
    #: outer round of the peer's (that ended with the rest of the fragment)
    late: bool = False

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
