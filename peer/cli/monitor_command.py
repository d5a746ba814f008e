"""`pathswarm monitor`: watch a whole run from a client-mode DHT node (see `monitoring.swarm`)."""

from __future__ import annotations

import argparse
import threading

from monitoring.swarm import DEFAULT_HOST
from peer.cli.common import Handler, install_sigterm, setup_logging


def register(subparsers) -> dict[str, Handler]:
    p = subparsers.add_parser("monitor", help="watch a run: swarm metrics for Prometheus and a status page")
    p.add_argument("--initial_peers", nargs="+", required=True, help="multiaddrs of peers in the swarm")
    p.add_argument("--host_maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/0"], help="multiaddrs to listen on")
    p.add_argument("--identity_path", default=None, help="file with the monitor's private key")
    p.add_argument("--run", required=True, help="run NAME or NAME@HASH")
    p.add_argument(
        "--metrics_port", type=int, default=9101, help="serve Prometheus /metrics here (0: any free)"
    )
    p.add_argument("--http_port", type=int, default=None, help="serve the status page here (0: any free)")
    p.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="address the metrics and the page listen on (default: %(default)s, this machine only; "
        "0.0.0.0: every interface, e.g. inside a container or behind a reverse proxy)",
    )
    p.add_argument("--interval_seconds", type=float, default=10.0, help="seconds between polls of the DHT")
    p.add_argument(
        "--max_peer_series", type=int, default=100, help="peers that get Prometheus series of their own"
    )
    p.add_argument("--log_level", default="INFO")
    return {"monitor": cmd_monitor}


def cmd_monitor(args: argparse.Namespace) -> int:
    from monitoring.swarm.service import MonitorOptions, run_monitor

    options = MonitorOptions(
        run=args.run,
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        identity_path=args.identity_path,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        host=args.host,
        interval_seconds=args.interval_seconds,
        max_peer_series=args.max_peer_series,
    )
    options.check()  # bad flags fail before the DHT starts
    setup_logging(args.log_level)
    stop = threading.Event()
    install_sigterm(stop.set)
    run_monitor(options, stop)
    return 0
