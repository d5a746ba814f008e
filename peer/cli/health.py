"""`pathswarm health`: is the peer on this machine alive, and is it contributing? For Docker's
HEALTHCHECK and for volunteers.

It reads the peer's Prometheus endpoint (`--metrics_port`, or `PATHSWARM_METRICS_PORT` as the container
sets it) and exits 0 when the peer answers with its training counters, 1 otherwise, printing one line
either way: its steps, its own outer rounds, the module syncs it averaged with other holders, the
tokens it trained, how long ago it last averaged with others, and plainly whether it is contributing
(it averaged with others in the last `CONTRIBUTING_SECONDS`) — or why it is not healthy. A second
line gives the peer's contribution over the whole run, across resumes (tokens, inner steps, rounds
averaged with others, modules held, hours online): what the monitor's status page shows at `?peer=ID`.
"""

from __future__ import annotations

import argparse
import os
import re
import time
import urllib.error
import urllib.request

from peer.cli.common import Handler

_SAMPLE = re.compile(r"^(pathswarm_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$", re.M)
#: a peer that averaged with other holders this recently is contributing
CONTRIBUTING_SECONDS = 600.0


def register(subparsers) -> dict[str, Handler]:
    h = subparsers.add_parser("health", help="check that the local peer answers on its metrics port")
    h.add_argument("--metrics_port", type=int, default=None, help="default: $PATHSWARM_METRICS_PORT")
    h.add_argument("--metrics_host", default="127.0.0.1", help="where the peer's /metrics listens")
    h.add_argument("--timeout_seconds", type=float, default=5.0, help="how long to wait for an answer")
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
    samples: dict[str, float] = {}
    averaged = 0.0
    for name, labels, value in _SAMPLE.findall(text):
        samples[name] = samples.get(name, 0.0) + float(value)  # the sum over a metric's labels
        if name == "pathswarm_outer_rounds_total" and 'outcome="averaged"' in labels:
            averaged = float(value)
    if "pathswarm_inner_steps_total" not in samples:
        print(f"unhealthy: {url} answers but shows no pathswarm peer metrics")
        return 1
    print(describe(samples, averaged, time.time()))
    line = contribution_line(samples)
    if line is not None:
        print(line)
    return 0


def describe(samples: dict[str, float], averaged: float, now: float) -> str:
    """The one line `health` prints for a peer that answers."""
    last = samples.get("pathswarm_last_averaged_timestamp_seconds", 0.0)
    ago = now - last if last > 0 else None
    contributing = ago is not None and ago <= CONTRIBUTING_SECONDS
    since = "never averaged with others yet" if ago is None else f"last averaged with others {ago:.0f} s ago"
    verdict = "contributing" if contributing else "NOT contributing (no round averaged with others lately)"
    return (
        f"healthy, {verdict}: {samples['pathswarm_inner_steps_total']:.0f} steps, "
        f"{samples.get('pathswarm_own_rounds', 0):.0f} own rounds, {averaged:.0f} module syncs averaged "
        f"with others, {samples.get('pathswarm_tokens_total', 0):.0f} tokens trained, {since}"
    )


def contribution_line(samples: dict[str, float]) -> str | None:
    """The peer's contribution over the run, from its `pathswarm_contribution_*` gauges (None: a peer
    too old to export them)."""
    if "pathswarm_contribution_tokens" not in samples:
        return None
    c = {k.removeprefix("pathswarm_contribution_"): v for k, v in samples.items() if "_contribution_" in k}
    return (
        f"contribution over the run: {c['tokens']:.0f} tokens trained, {c.get('inner_steps', 0):.0f} "
        f"inner steps, {c.get('rounds_averaged', 0):.0f} rounds averaged with others, "
        f"{c.get('modules_held', 0):.0f} modules held, {c.get('online_seconds', 0) / 3600:.2f} hours online "
        "(this peer's signed claim; the monitor's page at ?peer=ID shows what its partners confirm)"
    )
