"""`pathswarm health`: is the peer on this machine alive? For Docker's HEALTHCHECK and for volunteers.

It reads the peer's Prometheus endpoint (`--metrics_port`, or `PATHSWARM_METRICS_PORT` as the container
sets it) and exits 0 when the peer answers with its training counters, 1 otherwise, printing one line
either way: the steps, outer rounds and tokens it has done so far, or why it is not healthy.
"""

from __future__ import annotations

import argparse
import os
import re
import urllib.error
import urllib.request

from peer.cli.common import Handler

_SAMPLE = re.compile(r"^(pathswarm_[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$", re.M)


def register(subparsers) -> dict[str, Handler]:
    h = subparsers.add_parser("health", help="check that the local peer answers on its metrics port")
    h.add_argument("--metrics_port", type=int, default=None, help="default: $PATHSWARM_METRICS_PORT")
    h.add_argument("--metrics_host", default="127.0.0.1")
    h.add_argument("--timeout_seconds", type=float, default=5.0)
    return {"health": cmd_health}


def cmd_health(args: argparse.Namespace) -> int:
    port = args.metrics_port
    if port is None:
        raw = os.environ.get("PATHSWARM_METRICS_PORT", "")
        if not raw.isdigit():
            print("unhealthy: no --metrics_port given and PATHSWARM_METRICS_PORT is not set")
            return 1
        port = int(raw)
    url = f"http://{args.metrics_host}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout_seconds) as response:
            text = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        print(f"unhealthy: no peer answers on {url} ({reason})")
        return 1
    samples = {name: float(value) for name, value in _SAMPLE.findall(text)}
    if "pathswarm_inner_steps_total" not in samples:
        print(f"unhealthy: {url} answers but shows no pathswarm peer metrics")
        return 1
    print(
        f"healthy: {samples['pathswarm_inner_steps_total']:.0f} steps, "
        f"{samples.get('pathswarm_outer_rounds_total', 0):.0f} outer rounds, "
        f"{samples.get('pathswarm_tokens_total', 0):.0f} tokens"
    )
    return 0
