"""`pathswarm monitor` end to end: join the DHT in client mode, find the run, poll, serve metrics and
the status page until SIGTERM."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from prometheus_client import start_http_server

from dht.keys import check_run_name
from dht.node import start_dht
from monitoring.swarm import DEFAULT_HOST
from monitoring.swarm.exporter import SwarmCollector, make_registry
from monitoring.swarm.poller import SwarmPoller, find_manifest
from monitoring.swarm.status import StatusServer
from peer.config import MIN_PIN_HEX
from peer.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class MonitorOptions:
    """The monitor's flags."""

    run: str
    initial_peers: list[str]
    host_maddrs: list[str]
    identity_path: str | None = None
    metrics_port: int | None = 9101
    http_port: int | None = None
    host: str = DEFAULT_HOST
    interval_seconds: float = 10.0
    max_peer_series: int = 100
    manifest_timeout_seconds: float = 30.0

    def check(self) -> tuple[str, str | None]:
        """The run name and pin, or ConfigError saying which flag is wrong."""
        name, _, pin = self.run.partition("@")
        try:
            check_run_name(name)
        except ValueError as e:
            raise ConfigError(f"--run: {e}") from e
        if pin and (len(pin) < MIN_PIN_HEX or any(c not in "0123456789abcdef" for c in pin)):
            raise ConfigError(f"--run: pin {pin!r} must be at least {MIN_PIN_HEX} lowercase hex digits")
        if not self.initial_peers:
            raise ConfigError("--initial_peers: the monitor joins an existing swarm; give a peer's address")
        if self.interval_seconds <= 0:
            raise ConfigError("--interval_seconds must be > 0")
        if self.max_peer_series < 0:
            raise ConfigError("--max_peer_series must be >= 0")
        for flag, port in (("--metrics_port", self.metrics_port), ("--http_port", self.http_port)):
            if port is not None and not 0 <= port < 65536:
                raise ConfigError(f"{flag} must be a TCP port (0-65535), got {port}")
        return name, pin or None


def run_monitor(options: MonitorOptions, stop: threading.Event) -> None:
    """Runs until `stop` is set; prints the ports it serves on (port 0 picks free ones)."""
    name, pin = options.check()
    dht, _key = start_dht(
        initial_peers=options.initial_peers,
        host_maddrs=options.host_maddrs,
        identity_path=options.identity_path,
        client_mode=True,
        run_name=name,
    )
    metrics_server = status = poller = None
    try:
        manifest, record = find_manifest(dht, name, pin, options.manifest_timeout_seconds)
        from peer.run.admission import run_validator

        dht.add_validators([run_validator(record, name)])
        logger.info(f"monitoring run {name}@{record.run_id[:16]}")
        collector = SwarmCollector(options.max_peer_series)
        poller = SwarmPoller(dht, manifest, record, collector, options.interval_seconds)
        poller.start()
        if options.metrics_port is not None:
            metrics_server, _ = start_http_server(
                options.metrics_port, options.host, make_registry(collector)
            )
            print(f"metrics on http://{options.host}:{metrics_server.server_address[1]}/metrics", flush=True)
        if options.http_port is not None:
            status = StatusServer(poller.snapshot, options.host, options.http_port)
            print(f"status page on http://{options.host}:{status.start()}/", flush=True)
        stop.wait()
    finally:
        if poller is not None:
            poller.stop()
        if status is not None:
            status.shutdown()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        dht.shutdown()
