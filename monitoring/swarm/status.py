"""The monitor's status page (`/`) and its JSON (`/api/status`), served from a daemon thread.

stdlib `http.server` only: the page is rendered server-side from the poller's latest view, so it
needs no framework, no CDN and no script to show the swarm.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from monitoring.swarm.page import render_page
from monitoring.swarm.poller import HistoryPoint
from monitoring.swarm.view import SwarmView

logger = logging.getLogger(__name__)


def status_dict(view: SwarmView | None, history: list[HistoryPoint]) -> dict:
    """What `/api/status` serves: the latest view, its derived lists and the history of headline numbers."""
    if view is None:
        return {"peers": None, "message": "waiting for the first poll of the DHT"}
    out = asdict(view)
    # JSON object keys are strings: paths become "0", "1", ...
    for key in ("path_holders", "loss_by_path", "grid"):
        out[key] = {str(k): v for k, v in out[key].items()}
    out["orphaned"], out["under_replicated"] = view.orphaned, view.under_replicated
    out["uncovered_paths"] = view.uncovered_paths
    if view.plan is not None:
        out["plan"]["predicted_over_measured"] = view.plan.predicted_over_measured
    out["updated"] = time.strftime(
        "%Y-%m-%d %H:%M:%S UTC", time.gmtime(history[-1].time if history else time.time())
    )
    out["history"] = [
        {**asdict(h), "loss_by_path": {str(k): v for k, v in h.loss_by_path.items()}} for h in history
    ]
    return out


def _handler(
    snapshot: Callable[[], tuple[SwarmView | None, list[HistoryPoint]]],
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        """GET / (the page, ?peer=ID highlights a peer) and GET /api/status (JSON)."""

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            url = urlparse(self.path)
            status = status_dict(*snapshot())
            if url.path == "/api/status":
                self._send(200, "application/json", json.dumps(status).encode())
            elif url.path in ("/", "/index.html"):
                mine = parse_qs(url.query).get("peer", [""])[0][:128]
                self._send(200, "text/html; charset=utf-8", render_page(status, mine).encode())
            else:
                self._send(404, "text/plain", b"not found\n")

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
            logger.debug("status page: " + format % args)

    return Handler


class StatusServer:
    """The page's HTTP server on `host:port` (port 0 picks a free one)."""

    def __init__(self, snapshot, host: str, port: int):
        self.server = ThreadingHTTPServer((host, port), _handler(snapshot))
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, name="status-page", daemon=True)

    def start(self) -> int:
        self._thread.start()
        return self.port

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)
