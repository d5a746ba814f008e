"""The scheduler's plan as the monitor sees it (issue 34: "the plan and its predicted cost are visible").

The monitor builds the snapshot every peer builds (peer/swarm/planning.py: the live claims and the
probe records, each a peer's signed word about itself) and runs the same deterministic re-plan with
the run's seed, so what it shows is what the peers compute for themselves: the cost model's round
time for the swarm as it stands, the plan's, and the moves between them. Beside the prediction, the
round time *measured*: each peer's outer rounds over the monitor's own clock (`MeasuredRounds`), the
median over peers, so one peer's inflated round counter does not move it.

A swarm past `MAX_PLAN_PEERS` is not planned here (the search is the peers' cost, not the monitor's
to repeat on every poll); the view says so.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from dht.schema import ClaimRecord, ProbeRecord
from monitoring.swarm.rates import MAX_REMEMBERED
from peer.config import PeerConfig, RunManifest
from peer.scheduler import round_cost
from peer.seeding import stable_seed
from peer.swarm.planning import build_snapshot, path_parameters, replan_claims

#: the most training peers the monitor plans for on a poll (a 2,000-peer search takes seconds)
MAX_PLAN_PEERS = 2000
#: polls a peer's round counter is remembered over (a minute at the default 10 s interval)
ROUND_WINDOW_POLLS = 7


@dataclass
class PlanMove:
    """A peer the plan moves: from the path it claims to the plan's."""

    peer_id: str
    path: int
    planned_path: int


@dataclass
class PlanView:
    """The plan for one poll's claims, with the cost model's round times in seconds."""

    mode: str
    replan_online: bool
    #: training peers planned for, and those of them with a probe record (the rest are priced
    #: with the snapshot's conservative defaults)
    peers: int = 0
    probed: int = 0
    current_round_seconds: float | None = None
    current_compute_seconds: float | None = None
    current_communication_seconds: float | None = None
    planned_round_seconds: float | None = None
    #: peers the plan moves; the peers themselves move only in `planned` runs with `replan_online`
    moves: list[PlanMove] = field(default_factory=list)
    #: median over peers of seconds per outer round on the monitor's clock (None: not yet measured)
    measured_round_seconds: float | None = None
    #: why there is no plan (too many peers, planning failed), else ""
    note: str = ""

    @property
    def predicted_over_measured(self) -> float | None:
        if self.current_round_seconds is None or not self.measured_round_seconds:
            return None
        return self.current_round_seconds / self.measured_round_seconds


class MeasuredRounds:
    """Seconds per outer round of each peer, from its claimed round counter read at successive polls
    over the last `ROUND_WINDOW_POLLS` polls (a counter that went down starts over); as many peers
    remembered as `MeasuredRates` remembers (a flood of keys cannot grow the monitor)."""

    def __init__(self) -> None:
        self._seen: OrderedDict[str, deque[tuple[float, int]]] = OrderedDict()

    def update(self, now: float, rounds: dict[str, int]) -> float | None:
        """Records this poll's counters; returns the median seconds per round over the peers whose
        counter rose within the window."""
        per_round = []
        for peer, r in rounds.items():
            seen = self._seen.pop(peer, None) or deque(maxlen=ROUND_WINDOW_POLLS)
            if seen and (r < seen[-1][1] or now <= seen[-1][0]):
                seen.clear()
            seen.append((now, r))
            self._seen[peer] = seen
            (t0, r0), (t1, r1) = seen[0], seen[-1]
            if r1 > r0:
                per_round.append((t1 - t0) / (r1 - r0))
        for peer in [p for p in self._seen if p not in rounds]:
            del self._seen[peer]
        while len(self._seen) > MAX_REMEMBERED:
            self._seen.popitem(last=False)
        return statistics.median(per_round) if per_round else None


def plan_view(
    manifest: RunManifest,
    run_id: str,
    claims: dict[str, ClaimRecord],
    probes: dict[str, ProbeRecord],
    measured_round_seconds: float | None = None,
) -> PlanView:
    """The plan for the training peers among `claims` (ready, not leaving, not client mode)."""
    s = manifest.scheduler
    view = PlanView(s.mode, s.replan_online, measured_round_seconds=measured_round_seconds)
    training = {p: c for p, c in claims.items() if c.ready and not c.leaving and not c.client_mode}
    view.peers = len(training)
    view.probed = sum(p in probes for p in training)
    if not training:
        return view
    if len(training) > MAX_PLAN_PEERS:
        view.note = f"{len(training)} training peers: over the monitor's {MAX_PLAN_PEERS} planned per poll"
        return view
    known = {p: r for p, r in probes.items() if p in training}
    # the peers' own batch size is theirs to set; the default prices the plan as most of them run
    batch_size = PeerConfig.model_fields["batch_size"].default
    snapshot = build_snapshot(manifest, known, training, path_parameters(manifest), batch_size)
    current, result = replan_claims(manifest, snapshot, training, stable_seed(run_id))
    now = round_cost(current, snapshot)
    view.current_round_seconds = now.round_seconds
    view.current_compute_seconds = now.compute_seconds
    view.current_communication_seconds = now.communication_seconds
    view.planned_round_seconds = result.cost.round_seconds
    view.moves = [
        PlanMove(p, k, result.assignment.path_of_peer[p])
        for p, k in sorted(current.path_of_peer.items())
        if result.assignment.path_of_peer.get(p, k) != k
    ]
    return view
