"""The swarm view as Prometheus metrics, on the monitor's own registry.

A custom collector renders the latest `SwarmView` at scrape time, so series of modules or peers that
are gone disappear with the view instead of lingering at their last value. Swarm-wide counters
(`_total`) are the monitor's own: each poll adds what every peer's claimed since-start totals grew by
(a peer that restarted counts from zero again), so they only ever go up while peers come and go.
Series per peer are capped (`max_peer_series`); the count left out is a series too. Contributions over
the run get per-peer gauges for the top `max_peer_series` contributors by tokens (departed ones
included, so the series of a volunteer who left stay while it ranks there).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from monitoring.metrics import BAD_PART_REASONS
from monitoring.swarm.view import SYNC_OUTCOMES, SwarmView, top_peers

#: peers whose last totals the counters remember (a departed peer that comes back must not be counted twice)
MAX_REMEMBERED_PEERS = 8192


class SwarmTotals:
    """Monotonic swarm-wide counters built from peers' claimed since-start totals."""

    def __init__(self) -> None:
        # every known label value exists from the start: rate() over a series that appears late misses
        # its first increase, and a dashboard would show "no data" where the truth is zero
        self.totals: dict[str, dict[str, float]] = {
            "syncs": dict.fromkeys(SYNC_OUTCOMES, 0),
            "bad_parts": dict.fromkeys(BAD_PART_REASONS, 0),
            "bytes": {},
            "tokens": {},
        }
        self._last: OrderedDict[str, dict[tuple[str, str], float]] = OrderedDict()

    def _add(self, family: str, key: str, amount: float) -> None:
        self.totals[family][key] = self.totals[family].get(key, 0) + amount

    def update(self, view: SwarmView) -> None:
        for row in view.peers:
            now: dict[tuple[str, str], float] = {("tokens", ""): row.tokens_total,
                   ("bytes", "sent"): row.bytes_sent, ("bytes", "received"): row.bytes_received}  # fmt: skip
            now.update({("syncs", k): v for k, v in row.sync_outcomes.items()})
            now.update({("bad_parts", k): v for k, v in row.bad_parts.items()})
            before = self._last.pop(row.peer_id, {})
            for (family, key), value in now.items():
                previous = before.get((family, key), 0)
                # a value below the last one means the peer restarted: all of it is new
                self._add(family, key, value - previous if value >= previous else value)
            self._last[row.peer_id] = now
            while len(self._last) > MAX_REMEMBERED_PEERS:
                self._last.popitem(last=False)


class MonitorStats:
    """The monitor's own work: polls, failures, DHT reads and the last poll's duration."""

    def __init__(self) -> None:
        self.polls = 0
        self.poll_errors = 0
        self.dht_reads = 0
        self.last_poll_seconds = 0.0
        self.last_poll_timestamp = 0.0


class SwarmCollector:
    """Renders the latest view (set by the poller) whenever Prometheus scrapes."""

    def __init__(self, max_peer_series: int = 100):
        self.max_peer_series = max_peer_series
        self.view: SwarmView | None = None
        self.totals = SwarmTotals()
        self.stats = MonitorStats()
        self._lock = threading.Lock()

    def publish(self, view: SwarmView, poll_seconds: float, dht_reads: int) -> None:
        with self._lock:
            self.totals.update(view)
            self.view = view
            self.stats.polls += 1
            self.stats.dht_reads += dht_reads
            self.stats.last_poll_seconds = poll_seconds
            self.stats.last_poll_timestamp = time.time()

    def poll_failed(self, dht_reads: int) -> None:
        with self._lock:
            self.stats.poll_errors += 1
            self.stats.dht_reads += dht_reads

    def collect(self):
        with self._lock:
            view, stats = self.view, self.stats
            totals = {f: dict(v) for f, v in self.totals.totals.items()}
            yield from self._monitor_metrics(stats)
            if view is not None:
                yield from self._swarm_metrics(view, totals)
                yield from self._peer_metrics(view)
                yield from self._contribution_metrics(view)

    def _monitor_metrics(self, s: MonitorStats):
        yield CounterMetricFamily(
            "pathswarm_monitor_polls", "Polls of the DHT that built a swarm view.", s.polls
        )
        yield CounterMetricFamily(
            "pathswarm_monitor_poll_errors",
            "Polls that failed (DHT unreachable, manifest missing).",
            s.poll_errors,
        )
        yield CounterMetricFamily(
            "pathswarm_monitor_dht_reads", "DHT get requests made by the monitor.", s.dht_reads
        )
        yield GaugeMetricFamily(
            "pathswarm_monitor_poll_duration_seconds", "Wall time of the last poll.", s.last_poll_seconds
        )
        yield GaugeMetricFamily(
            "pathswarm_monitor_last_poll_timestamp_seconds",
            "Unix time of the last successful poll.",
            s.last_poll_timestamp,
        )

    def _swarm_metrics(self, v: SwarmView, totals: dict[str, dict[str, float]]):
        yield InfoMetricFamily(
            "pathswarm_swarm", "The run the monitor watches.", {"run": v.run, "run_id": v.run_id}
        )
        yield GaugeMetricFamily(
            "pathswarm_monitor_claims_read", "Claim records read in the last poll.", v.claims_read
        )
        yield GaugeMetricFamily(
            "pathswarm_monitor_claims_capped",
            "1 when a claim shard had more claims than a reader keeps (dht.keys.MAX_CLAIMS_PER_SHARD).",
            int(v.claims_capped),
        )
        yield GaugeMetricFamily(
            "pathswarm_monitor_claims_refused",
            "Claims left out of the last poll: their module list is not their path's.",
            v.claims_refused,
        )
        g = GaugeMetricFamily(
            "pathswarm_swarm_peers", "Live peers by state (joining, training, leaving).", labels=["state"]
        )
        for state, n in v.by_state.items():
            g.add_metric([state], n)
        yield g
        yield self._per(
            "pathswarm_swarm_path_holders", "Training peers on each path.", "path", v.path_holders
        )
        yield self._per(
            "pathswarm_swarm_module_holders",
            "Training peers claiming each module (their path's), admitted or not.",
            "module",
            v.module_holders,
        )
        yield self._per(
            "pathswarm_swarm_module_holders_confirmed",
            "Training peers holding each module with the run creator's admission (all while nobody is).",
            "module",
            v.module_holders_confirmed,
        )
        yield self._per(
            "pathswarm_swarm_module_kept_copies",
            "Keepers holding a copy of each module.",
            "module",
            v.module_kept,
        )
        yield self._per(
            "pathswarm_swarm_module_round_spread",
            "Largest gap in applied syncs of one fragment between a module's holders (fragment lag).",
            "module",
            v.module_round_spread,
        )
        yield self._per(
            "pathswarm_swarm_module_round",
            "Most advanced holder's applied syncs of each module.",
            "module",
            v.module_round,
        )
        yield GaugeMetricFamily(
            "pathswarm_swarm_modules_under_replicated",
            "Modules with fewer than 2 training holders.",
            len(v.under_replicated),
        )
        yield GaugeMetricFamily(
            "pathswarm_swarm_modules_orphaned", "Modules with no confirmed training holder.", len(v.orphaned)
        )
        yield GaugeMetricFamily(
            "pathswarm_swarm_paths_uncovered", "Paths no peer trains.", len(v.uncovered_paths)
        )
        yield GaugeMetricFamily(
            "pathswarm_swarm_tokens_per_second",
            "Sum of training peers' tokens per second, measured from their token counters over the "
            "monitor's clock (implausible counters left out).",
            v.tokens_per_second,
        )
        yield GaugeMetricFamily(
            "pathswarm_swarm_peers_implausible",
            "Peers whose token counter rises over 10x the median peer's rate (left out of the total).",
            v.implausible,
        )
        yield self._per(
            "pathswarm_swarm_loss", "Mean claimed training loss of each path's peers.", "path", v.loss_by_path
        )
        yield self._counter(
            "pathswarm_swarm_syncs", "Module syncs of all peers, by outcome.", "outcome", totals["syncs"]
        )
        yield self._counter(
            "pathswarm_swarm_bad_parts",
            "Sync parts peers rejected, by reason.",
            "reason",
            totals["bad_parts"],
        )
        yield CounterMetricFamily(
            "pathswarm_swarm_tokens", "Training tokens of all peers.", totals["tokens"].get("", 0)
        )
        yield CounterMetricFamily(
            "pathswarm_swarm_sent_bytes", "Bytes peers sent to each other.", totals["bytes"].get("sent", 0)
        )
        yield CounterMetricFamily(
            "pathswarm_swarm_received_bytes",
            "Bytes peers received from each other.",
            totals["bytes"].get("received", 0),
        )
        if v.plan is not None:
            rounds = {
                "current": v.plan.current_round_seconds,
                "planned": v.plan.planned_round_seconds,
                "measured": v.plan.measured_round_seconds,
            }
            yield self._per(
                "pathswarm_swarm_round_seconds",
                "Seconds per outer round: the cost model's for the swarm as it stands (current) and for "
                "the scheduler's plan (planned); the median peer's on the monitor's clock (measured).",
                "kind",
                {k: x for k, x in rounds.items() if x is not None},
            )
            yield GaugeMetricFamily(
                "pathswarm_swarm_plan_moves",
                "Peers the scheduler's plan would move to another path.",
                len(v.plan.moves),
            )
        yield self._per(
            "pathswarm_swarm_peers_by_version", "Live peers by software version.", "version", v.by_version
        )
        yield self._per(
            "pathswarm_swarm_peers_by_reachability",
            "Live peers by reachability.",
            "reachability",
            v.by_reachability,
        )

    def _peer_metrics(self, v: SwarmView):
        rows = top_peers(v, self.max_peer_series)
        info = GaugeMetricFamily(
            "pathswarm_swarm_peer_info",
            "One series per shown peer (value 1) with its path, state, version and reachability.",
            labels=["peer_id", "path", "state", "version", "reachability"],
        )
        tps = GaugeMetricFamily(
            "pathswarm_swarm_peer_tokens_per_second",
            "A peer's tokens/s, measured from its token counter over the monitor's clock.",
            labels=["peer_id"],
        )
        rnd = GaugeMetricFamily(
            "pathswarm_swarm_peer_outer_round", "A peer's claimed outer round.", labels=["peer_id"]
        )
        loss = GaugeMetricFamily(
            "pathswarm_swarm_peer_loss", "A peer's claimed last loss.", labels=["peer_id"]
        )
        syncs = CounterMetricFamily(
            "pathswarm_swarm_peer_syncs",
            "A peer's claimed module syncs since it started, by outcome.",
            labels=["peer_id", "outcome"],
        )
        for r in rows:
            info.add_metric([r.peer_id, str(r.path), r.state, r.software_version, r.reachability], 1)
            tps.add_metric([r.peer_id], r.tokens_per_second)
            rnd.add_metric([r.peer_id], r.outer_round)
            if r.loss is not None:
                loss.add_metric([r.peer_id], r.loss)
            for outcome in sorted(set(r.sync_outcomes) | {"averaged", "failed"}):
                syncs.add_metric([r.peer_id, outcome], r.sync_outcomes.get(outcome, 0))
        yield from (info, tps, rnd, loss, syncs)
        yield GaugeMetricFamily(
            "pathswarm_swarm_peer_series_omitted",
            "Live peers left without series of their own (over --max_peer_series).",
            len(v.peers) - len(rows),
        )

    def _contribution_metrics(self, v: SwarmView):
        rows = v.contributions[: max(0, self.max_peer_series)]
        docs = {
            "tokens": "Tokens a peer trained over the run (its signed claim, across resumes).",
            "inner_steps": "Inner steps a peer took over the run (its signed claim).",
            "rounds_averaged": "Outer rounds a peer averaged with others over the run (its signed claim).",
            "rounds_confirmed": "Of a peer's rounds averaged with others, those a partner's record confirms.",
            "modules_held": "Distinct modules a peer trained over the run (its signed claim).",
            "online_seconds": "Seconds a peer was online in the run, over all its starts (its signed claim).",
        }
        for key, doc in docs.items():
            g = GaugeMetricFamily(f"pathswarm_swarm_peer_contribution_{key}", doc, labels=["peer_id"])
            for r in rows:
                g.add_metric([r.peer_id], getattr(r, key))
            yield g
        yield GaugeMetricFamily(
            "pathswarm_swarm_contributors",
            "Peers with a verified contribution record in this run, departed ones included.",
            len(v.contributions),
        )
        yield GaugeMetricFamily(
            "pathswarm_swarm_contribution_series_omitted",
            "Contributors left without series of their own (over --max_peer_series).",
            len(v.contributions) - len(rows),
        )
        rejected = dict.fromkeys(("signed by another key", "signature does not match"), 0)
        yield self._per(
            "pathswarm_monitor_contributions_rejected",
            "Contribution records refused in the last poll (forged, tampered, another run), by reason.",
            "reason",
            {**rejected, **v.contributions_rejected},
        )

    @staticmethod
    def _per(name: str, doc: str, label: str, values: dict) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=[label])
        for key, value in sorted(values.items(), key=lambda kv: str(kv[0])):
            g.add_metric([str(key)], value)
        return g

    @staticmethod
    def _counter(name: str, doc: str, label: str, values: dict) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=[label])
        for key, value in sorted(values.items()):
            c.add_metric([str(key)[:32]], value)
        return c


def make_registry(collector: SwarmCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
