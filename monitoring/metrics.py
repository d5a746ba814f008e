"""Prometheus metrics of one peer, on its own registry, served over HTTP for scraping.

Each ``PeerMetrics`` owns a ``CollectorRegistry`` rather than using the process-global one, so tests (and
a process hosting several peers) can create as many as they like without name collisions. Values are in
base units (seconds, bytes, tokens); labels take only values from small fixed sets, and identity (run,
path, peer id) lives in the ``pathswarm_peer_info`` series rather than on every metric, so the number of
series stays bounded however long a peer runs.
"""

from __future__ import annotations

import importlib.metadata
import logging
import platform
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client import start_http_server as _start_http_server

OUTCOMES = ("averaged", "excluded", "alone", "incomplete", "behind", "failed")
BAD_PART_REASONS = ("shape", "dtype", "nonfinite", "norm", "weight", "unconfirmed", "equivocation")
# All-reduce rounds over volunteer links: tens of ms on a LAN up to the two-minute round deadline.
ALLREDUCE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
# Guard against a bug turning the module label into an unbounded one (grids have at most a few hundred).
MAX_MODULE_SERIES = 512

logger = logging.getLogger(__name__)


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class PeerMetrics:
    """The metrics a training peer exports; the trainer calls the ``observe_*``/``set_*`` methods."""

    def __init__(self, run: str, peer_id: str, path: str, version: str):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.tokens = Counter("pathswarm_tokens", "Training tokens processed by inner steps.", registry=r)
        self.inner_steps = Counter(
            "pathswarm_inner_steps", "Inner (local) optimizer steps taken.", registry=r
        )
        self.outer_rounds = Counter(
            "pathswarm_outer_rounds",
            "Module syncs by outcome: averaged with others, excluded (our outer gradient came too late, "
            "the group's average was applied), alone (no partners), behind (the others were past the "
            "round: their state was fetched), or failed.",
            ["outcome"],
            registry=r,
        )
        self.bytes_sent = Counter("pathswarm_bytes_sent", "Bytes sent to other peers.", registry=r)
        self.bytes_received = Counter(
            "pathswarm_bytes_received", "Bytes received from other peers.", registry=r
        )
        self.bad_parts = Counter(
            "pathswarm_bad_parts",
            "All-reduce parts rejected from other peers, by reason.",
            ["reason"],
            registry=r,
        )
        self.loss = Gauge("pathswarm_loss", "Training loss of the last inner step.", registry=r)
        self.outer_round = Gauge(
            "pathswarm_outer_round",
            "The swarm's outer round (the trunk's sync count) at this peer's last round (the log's round N).",
            registry=r,
        )
        self.own_rounds = Gauge(
            "pathswarm_own_rounds",
            "Outer rounds this peer completed, across resumes (what --max_rounds limits).",
            registry=r,
        )
        self.router_version = Gauge(
            "pathswarm_router_version",
            "The router version this peer routes its data with (0: the manifest's; `pathswarm run reroute`).",
            registry=r,
        )
        self.group_size = Gauge(
            "pathswarm_group_size", "Peers in the last outer round's group (1 when alone).", registry=r
        )
        self.tokens_per_second = Gauge(
            "pathswarm_tokens_per_second",
            "Recent inner-loop training throughput in tokens per second.",
            registry=r,
        )
        self.module_holders = Gauge(
            "pathswarm_module_holders",
            "Peers currently announcing each module in the DHT.",
            ["module"],
            registry=r,
        )
        self.modules_reset = Counter(
            "pathswarm_modules_reset",
            "Modules this peer had to start from initial weights although the run had progressed.",
            registry=r,
        )
        self.copies_merged_total = Counter(
            "pathswarm_copies_merged",
            "Module fragments whose group held diverged copies with no majority and merged them.",
            registry=r,
        )
        self.checkpoint_failures = Counter(
            "pathswarm_checkpoint_failures",
            "Checkpoints that could not be written (a full disk); training went on.",
            registry=r,
        )
        self.last_averaged = Gauge(
            "pathswarm_last_averaged_timestamp_seconds",
            "Unix time of this peer's last module sync averaged with other holders (0: none yet).",
            registry=r,
        )
        self.peers_seen = Gauge(
            "pathswarm_peers_seen", "Distinct live peers of this run seen in the DHT.", registry=r
        )
        self.allreduce_seconds = Histogram(
            "pathswarm_allreduce_seconds",
            "Wall time of outer-round all-reduces (rounds spent alone are not observed).",
            buckets=ALLREDUCE_BUCKETS,
            registry=r,
        )
        # the online planner's last decision (peer/training/replan.py): what the monitor shows of the plan
        self.plan_round_seconds = Gauge(
            "pathswarm_plan_round_seconds", "Round time the plan predicts, by assignment (current, planned).",
            ["assignment"], registry=r,
        )  # fmt: skip
        self.plan_gain_seconds = Gauge(
            "pathswarm_plan_gain_seconds", "Predicted saving of the last plan over the horizon.", registry=r
        )
        self.plan_move_cost_seconds = Gauge(
            "pathswarm_plan_move_cost_seconds", "Predicted cost of the last plan's moves.", registry=r
        )
        self.plan_moves = Counter("pathswarm_plan_moves", "Moves this peer made for the plan.", registry=r)
        self.build_info = Info("pathswarm_build", "Versions of pathswarm and its runtime.", registry=r)
        self.build_info.info(
            {"version": version, "python": platform.python_version(), "torch": _package_version("torch")}
        )
        self.peer_info = Info("pathswarm_peer", "Identity of this peer.", registry=r)
        self._identity = {"run": run, "path": path, "peer_id": peer_id}
        self.peer_info.info(self._identity)

        # Export every fixed label value from the start: rate() over a series that appears late misses
        # its first increment, and dashboards would show "no data" instead of zero.
        for outcome in OUTCOMES:
            self.outer_rounds.labels(outcome)
        for reason in BAD_PART_REASONS:
            self.bad_parts.labels(reason)
        for assignment in ("current", "planned"):
            self.plan_round_seconds.labels(assignment)

        self._modules: set[str] = set()
        self._lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None

    def observe_step(self, tokens: int, loss: float, tokens_per_second: float) -> None:
        """Record one inner step."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        self.tokens.inc(tokens)
        self.inner_steps.inc()
        self.loss.set(loss)
        self.tokens_per_second.set(tokens_per_second)

    def observe_round(
        self,
        outcome: str,
        seconds: float,
        group_size: int,
        bytes_sent: int,
        bytes_received: int,
        *,
        outer_round: int | None = None,
    ) -> None:
        """Record one module's sync; ``outer_round``, if given, is the swarm's round number (otherwise
        `set_rounds` sets it once per round: one round syncs every module of the path)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outer-round outcome {outcome!r}; expected one of {OUTCOMES}")
        if bytes_sent < 0 or bytes_received < 0:
            raise ValueError("byte counts must be >= 0")
        self.outer_rounds.labels(outcome).inc()
        if outcome == "averaged":
            self.last_averaged.set(time.time())
        if outcome != "alone":  # no all-reduce ran; its ~0 s would drag the latency quantiles down
            self.allreduce_seconds.observe(seconds)
        self.group_size.set(group_size)
        self.add_bytes(bytes_sent, bytes_received)
        if outer_round is not None:
            self.outer_round.set(outer_round)

    def set_rounds(self, swarm_round: int, own_rounds: int) -> None:
        """At a round's end: the swarm's round number and how many rounds this peer completed."""
        self.outer_round.set(swarm_round)
        self.own_rounds.set(own_rounds)

    def set_router_version(self, version: int) -> None:
        self.router_version.set(version)

    def add_bytes(self, sent: int, received: int) -> None:
        """Count traffic outside outer rounds (e.g. DHT, fetching modules from holders)."""
        self.bytes_sent.inc(sent)
        self.bytes_received.inc(received)

    def bad_part(self, reason: str) -> None:
        """Count one rejected all-reduce part."""
        if reason not in BAD_PART_REASONS:
            raise ValueError(f"unknown bad-part reason {reason!r}; expected one of {BAD_PART_REASONS}")
        self.bad_parts.labels(reason).inc()

    def follow_contribution(self, totals) -> None:
        """Gauges of this peer's contribution over the whole run (across resumes), read from
        `totals()` (`ContributionLedger.meta`) at every scrape: what `pathswarm health` prints."""
        names = {
            "tokens": "Training tokens this peer trained over the whole run (across resumes).",
            "inner_steps": "Inner steps this peer took over the whole run.",
            "rounds_averaged": "Outer rounds in which this peer averaged with other holders, over the run.",
            "modules_held": "Distinct modules this peer trained over the run.",
            "online_seconds": "Seconds this peer was online in the run, summed over its starts.",
        }
        for key, doc in names.items():
            gauge = Gauge(f"pathswarm_contribution_{key}", doc, registry=self.registry)
            gauge.set_function(lambda key=key: float(totals()[key]))

    def set_path(self, path: str) -> None:
        """The path label after the peer rotated to another path; the holders of modules it left
        are no longer ours to report."""
        self._identity = {**self._identity, "path": path}
        self.peer_info.info(self._identity)
        with self._lock:
            for module in self._modules:
                self.module_holders.remove(module)
            self._modules.clear()

    def set_holders(self, module: str, n: int) -> None:
        """Set how many peers hold ``module`` (e.g. "trunk", "L0M1")."""
        module = str(module)
        with self._lock:
            if module not in self._modules:
                if len(self._modules) >= MAX_MODULE_SERIES:
                    logger.warning(
                        "dropping holders of module %r: over %d module series", module, MAX_MODULE_SERIES
                    )
                    return
                self._modules.add(module)
        self.module_holders.labels(module).set(n)

    def module_reset(self) -> None:
        self.modules_reset.inc()

    def copies_merged(self) -> None:
        self.copies_merged_total.inc()

    def checkpoint_failed(self) -> None:
        self.checkpoint_failures.inc()

    def observe_plan(self, current: float, planned: float, gain: float, cost: float, moved: bool) -> None:
        self.plan_round_seconds.labels("current").set(current)
        self.plan_round_seconds.labels("planned").set(planned)
        self.plan_gain_seconds.set(gain)
        self.plan_move_cost_seconds.set(cost)
        if moved:
            self.plan_moves.inc()

    def set_peers_seen(self, n: int) -> None:
        self.peers_seen.set(n)

    def render(self) -> bytes:
        """The current metrics in the Prometheus text exposition format."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str) -> int:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; port 0 picks a free port. Returns it.
        No default host: the caller's setting (--metrics_host, loopback unless given) is the one."""
        with self._lock:
            if self._server is not None:
                raise RuntimeError(f"metrics already served on port {self._server.server_address[1]}")
            self._server, self._thread = _start_http_server(port, addr=host, registry=self.registry)
            return int(self._server.server_address[1])

    def shutdown(self) -> None:
        """Stop the HTTP server, if any; safe to call twice."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)
