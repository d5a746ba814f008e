"""The monitor's DHT side: find the run's verified manifest, then read its claims, keepers' stash
records and peers' contribution records on an interval and hand each `SwarmView` to the exporter and
the status page.

The monitor is a client-mode DHT node: it reads, never claims, and is reachable by nobody. Every
record it reads was validated by the DHT (signature, schema, expiry) and is parsed again here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import hivemind

from dht.keys import claim_shards, claims_key, contributions_key, manifest_key, probes_key, stash_key
from dht.records import read_records
from dht.schema import ClaimRecord, ContributionRecord, ManifestRecord, ProbeRecord, StashRecord
from monitoring.swarm.contributions import ContributionBoard
from monitoring.swarm.exporter import SwarmCollector
from monitoring.swarm.plan import MeasuredRounds, PlanView, plan_view
from monitoring.swarm.rates import MeasuredRates
from monitoring.swarm.view import SwarmView, build_view, select_shards
from peer.config import RunManifest
from peer.errors import SwarmError
from peer.run.admission import AdmissionCheck
from peer.run.record import verify_record

logger = logging.getLogger(__name__)

#: points of history the status page draws (one per poll: an hour at the default 10 s interval)
HISTORY_POINTS = 360


def find_manifest(
    dht: hivemind.DHT, run_name: str, pin: str | None, timeout_seconds: float = 20.0
) -> tuple[RunManifest, ManifestRecord]:
    """The one verified manifest of `run_name` (starting with `pin` if given); several candidates are
    an error that lists them, never a silent choice."""
    deadline = time.monotonic() + timeout_seconds
    refused: set[str] = set()  # why: a manifest over the grid's caps, say, is named, not just missing
    while True:
        candidates: dict[str, tuple[RunManifest, ManifestRecord]] = {}
        for record, _ in read_records(dht, manifest_key(run_name), ManifestRecord):
            try:
                manifest = verify_record(record)
            except ValueError as e:
                refused.add(str(e).splitlines()[0])
                continue
            if manifest.name == run_name and (pin is None or record.run_id.startswith(pin)):
                candidates[record.run_id] = (manifest, record)
        if len(candidates) == 1:
            return next(iter(candidates.values()))
        if len(candidates) > 1:
            ids = ", ".join(f"{run_name}@{rid[:16]}" for rid in sorted(candidates))
            raise SwarmError(f"several runs are named {run_name!r}; pin one with --run NAME@HASH: {ids}")
        if time.monotonic() > deadline:
            pinned = f" with hash {pin}..." if pin else ""
            why = f" (refused records: {'; '.join(sorted(refused))})" if refused else ""
            raise SwarmError(f"no verified manifest for run {run_name!r}{pinned} in the DHT{why}")
        time.sleep(0.5)


@dataclass
class HistoryPoint:
    """One poll's headline numbers, for the status page's charts."""

    time: float
    tokens_per_second: float
    max_round_spread: int
    loss_by_path: dict[int, float] = field(default_factory=dict)
    peers: int = 0


class SwarmPoller:
    """Polls the run's records every `interval_seconds` from a daemon thread."""

    def __init__(
        self,
        dht: hivemind.DHT,
        manifest: RunManifest,
        record: ManifestRecord,
        collector: SwarmCollector,
        interval_seconds: float = 10.0,
    ):
        self.dht, self.manifest, self.run_id = dht, manifest, record.run_id
        self.collector = collector
        self.interval_seconds = interval_seconds
        self.history: deque[HistoryPoint] = deque(maxlen=HISTORY_POINTS)
        self.view: SwarmView | None = None
        #: the peers' tokens/s, measured from their counters over this monitor's clock
        self.rates = MeasuredRates()
        #: every volunteer's verified contribution over the run, remembered after it leaves
        self.admission = AdmissionCheck.of(record)
        #: whether any claim this monitor read was admitted: from then on only admitted holders confirm
        self.seen_admission = False
        self.board = ContributionBoard(self.run_id, self.admission)
        #: the peers' seconds per outer round, measured over this monitor's clock
        self.rounds = MeasuredRounds()
        self._reads = 0
        self.stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _claim_shards(self):
        """Each claim shard's records, read one shard at a time (each reply bounded, and only the
        kept claims of the shards read so far held); counts each read in `self._reads`."""
        for shard in claim_shards(self.manifest.model.n_paths):
            self._reads += 1
            yield read_records(self.dht, claims_key(self.manifest.name, self.run_id, shard), ClaimRecord)

    def poll(self) -> SwarmView:
        """One cycle: the DHT reads (each claim shard, stash, contributions), the view, the exporter
        and the history updated."""
        started = time.perf_counter()
        name, self._reads = self.manifest.name, 0
        try:
            selected = select_shards(self._claim_shards(), str(self.dht.peer_id), self.admission.admitted)
            self._reads += 1
            stash = [r for r, _ in read_records(self.dht, stash_key(name, self.run_id), StashRecord)]
            self._reads += 1
            found = read_records(self.dht, contributions_key(name, self.run_id), ContributionRecord)
        except Exception:
            self.collector.poll_failed(self._reads)
            raise
        self._reads += 1
        try:  # the plan's measurements: without them the plan is priced on defaults, the poll goes on
            probed = read_records(self.dht, probes_key(name, self.run_id), ProbeRecord)
        except Exception as e:
            logger.warning(f"probe records unread ({type(e).__name__}: {e}); planning without them")
            probed = []
        counters = {p: c.tokens_total for p, c in selected.claims.items()}
        rates = self.rates.update(time.monotonic(), counters)
        model, admitted = self.manifest.model, self.admission.admitted
        view = build_view(name, self.run_id, model, selected, stash, rates, admitted, self.seen_admission)
        # once the run admitted anyone, a key without admission never counts as a confirmed holder again
        self.seen_admission = self.seen_admission or view.admitted > 0
        view.contributions = self.board.update([r for r, _ in found], selected.claims)
        view.contributions_rejected = dict(self.board.rejected)
        view.plan = self._plan(view, selected.claims, {r.peer_id: r for r, _ in probed})
        seconds = time.perf_counter() - started
        self.collector.publish(view, seconds, self._reads)
        spread = max(view.module_round_spread.values(), default=0)
        with self._lock:
            self.view = view
            self.history.append(
                HistoryPoint(
                    time.time(), view.tokens_per_second, spread, dict(view.loss_by_path), len(view.peers)
                )
            )
        return view

    def _plan(
        self, view: SwarmView, claims: dict[str, ClaimRecord], probes: dict[str, ProbeRecord]
    ) -> PlanView:
        """The plan for the claims the view counts as training, and the measured round time."""
        training = {r.peer_id for r in view.peers if r.state == "training" and not r.client_mode}
        mine = {p: c for p, c in claims.items() if p in training}
        measured = self.rounds.update(time.monotonic(), {p: c.outer_round for p, c in mine.items()})
        try:
            return plan_view(self.manifest, self.run_id, mine, probes, measured)
        except Exception as e:  # the plan is shown, never needed: a failure is said, the poll goes on
            s = self.manifest.scheduler
            note = f"planning failed: {type(e).__name__}: {e}"
            return PlanView(s.mode, s.replan_online, len(mine), measured_round_seconds=measured, note=note)

    def snapshot(self) -> tuple[SwarmView | None, list[HistoryPoint]]:
        with self._lock:
            return self.view, list(self.history)

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                view = self.poll()
                logger.info(
                    f"{len(view.peers)} peers, {view.tokens_per_second:.0f} tokens/s, "
                    f"orphaned {view.orphaned}, under-replicated {view.under_replicated}"
                )
            except Exception as e:  # a failed poll is counted and retried, the monitor stays up
                logger.warning(f"poll failed: {e!r}")
            self.stop_event.wait(self.interval_seconds)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="swarm-poller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
