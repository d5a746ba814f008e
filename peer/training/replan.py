"""Online re-planning in a live peer (`OnlineReplanner`): at a round's end, when the swarm changed
since the last look (a peer joined or left, a claim moved or became ready, a probe reported another
speed or link), the peer re-runs the run's plan on its views (peer/swarm/planning.py `online_move`)
and moves itself when the plan's predicted gain beats the move's cost (peer/scheduler/online.py).
Every decision is logged (one `online re-plan` line) and exported as metrics for the monitor.

It decides only on views that have settled: unchanged for a heartbeat (a renewal of the views) since
the last change. Peers see a change at different moments: a probe renews one peer's links before
another's, and a mover's new claim reaches its path's holders at once (HELLO) but the measurement
that moved it only at their next heartbeat. A peer that re-planned on such a half-renewed view could
pick another mover than the plan on the full view, and both would move (the live re-plan test saw
three movers where the plan has two). The price is one heartbeat of reaction.

A claim change that the plan on our previous view already asked for (a mover went where that plan
sends it, or a peer only became ready or not) is no news: it does not start the wait again. Without
this, the plan's second mover took the first one's move for a new change and waited a round more;
with rounds of 20-70 s after a link slowed, it had not moved when the benchmark's arm ended
(scheduler_live, session 22: one move of the two the plan asked for, in each run).
"""

from __future__ import annotations

import hashlib
import logging
import time

from peer.scheduler import OnlineDecision
from peer.seeding import stable_seed
from peer.swarm.membership import Membership
from peer.swarm.planning import online_move
from peer.swarm.rotation import Rotation

logger = logging.getLogger(__name__)


class OnlineReplanner:
    """Re-plans when the swarm's inputs to the plan changed, and says whether this peer moves."""

    def __init__(
        self, membership: Membership, metrics=None, settle_seconds: float | None = None, clock=time.monotonic
    ):
        """`metrics`: the peer's PeerMetrics (None: decisions go to the log only). `settle_seconds`:
        how long the views must stay unchanged before a decision (None: the peer's heartbeat).
        `clock`: seconds, monotonic."""
        self.membership = membership
        self.clock = clock
        self.metrics = metrics
        self.settle_seconds = (
            membership.config.heartbeat_seconds if settle_seconds is None else settle_seconds
        )
        self._inputs: tuple[frozenset[str], str, str] | None = None
        #: the claims and snapshot of the last look (to tell a move the plan asked for from news)
        self._view: tuple[dict, object] | None = None
        #: the first change not decided on yet, and when the views last changed (monotonic seconds)
        self._pending: str | None = None
        self._changed_at = 0.0
        #: the last decision (None before the first)
        self.last: OnlineDecision | None = None
        self._retry = False

    def retry(self) -> None:
        """Decide again at the next round's end although nothing changed (a move was put off)."""
        self._retry = True

    @property
    def enabled(self) -> bool:
        s = self.membership.manifest.scheduler
        return s.replan_online and s.mode == "planned"

    def _changed(self, claims, snapshot) -> str | None:
        """What changed since the last evaluation ("join", "leave", "measurement", "claims"), or None."""
        peers = frozenset(p for p, c in claims.items() if not c.client_mode and not c.leaving)
        lines = sorted(f"{p}:{c.path}:{int(c.ready)}" for p, c in claims.items() if p in peers)
        arrays = (snapshot.tokens_per_second, snapshot.latency_seconds, snapshot.bandwidth_bytes_per_second)
        measured = hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()
        claimed = hashlib.sha256(" ".join(lines).encode()).hexdigest()
        inputs = (peers, claimed, measured + ",".join(snapshot.peer_ids))
        before, self._inputs = self._inputs, inputs
        if before is None:
            return "start"
        if peers - before[0]:
            return "join"
        if before[0] - peers:
            return "leave"
        if inputs[2] != before[2]:
            return "measurement"
        return "claims" if inputs[1] != before[1] else None

    def _planned(self, claims_before: dict, snapshot_before, claims: dict) -> bool:
        """Whether every peer whose path changed since the last look went where the plan on that
        look sends it (a peer that only became ready, or not, counts as planned)."""
        moved = {
            p: c.path for p, c in claims.items() if p in claims_before and claims_before[p].path != c.path
        }
        if not moved:
            return True
        m = self.membership
        plan = online_move(m.manifest, snapshot_before, claims_before, m.peer_id, stable_seed(m.run_id)).plan
        return all(plan.path_of_peer.get(p) == k for p, k in moved.items())

    def decide(self, outer_round: int) -> Rotation | None:
        """Our move at the end of `outer_round` (None: we stay), from the heartbeat's views."""
        m = self.membership
        if not self.enabled or m.snapshot is None:
            return None
        claims = dict(m.claims)
        claims[m.peer_id] = m.claim_record()  # our claim as it is now, not as last published
        now = self.clock()
        change = self._changed(claims, m.snapshot)
        before, self._view = self._view, (claims, m.snapshot)
        if change is not None:
            if not (change == "claims" and before is not None and self._planned(*before, claims)):
                self._changed_at = now
            self._pending = self._pending or change
        if self._pending is None and not self._retry:
            return None
        if self._pending is not None and now - self._changed_at < self.settle_seconds:
            return None  # the views are still changing: decide on them once they have settled
        trigger = self._pending or "retry"
        self._pending, self._retry = None, False
        d = online_move(m.manifest, m.snapshot, claims, m.peer_id, stable_seed(m.run_id))
        self.last = d
        logger.info(
            f"online re-plan ({trigger}, round {outer_round}): {'move' if d.move else 'stay'} "
            f"path {d.source} -> {d.target}; round {d.current_round_seconds:.3f}s now, "
            f"{d.planned_round_seconds:.3f}s planned; gain {d.gain_seconds:.1f}s, "
            f"cost {d.cost_seconds:.1f}s; "
            f"movers {len(d.movers)}: {d.reason}"
        )
        if self.metrics is not None:
            self.metrics.observe_plan(d.current_round_seconds, d.planned_round_seconds, d.gain_seconds,
                                      d.cost_seconds, d.move)  # fmt: skip
        if not d.move:
            return None
        return Rotation(m.peer_id, int(d.source), int(d.target), {})
