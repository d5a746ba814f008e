"""The monitor against a real local swarm: a real Prometheus (Debian's package) scrapes the monitor and
the peers, every dashboard panel's expression and every alert's series return data, the
orphaned-module alert fires once the last holder of a module leaves, and the status page, loaded in
headless Chromium, shows the swarm's peers and module holders."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from peer.cli.local_swarm import LOOPBACK, LocalSwarm
from tests.swarm_harness import RUN, peer_args, wait_for, write_manifest

REPO = Path(__file__).resolve().parent.parent
PROM_DIR = REPO / "monitoring" / "prometheus"
DASHBOARDS = REPO / "monitoring" / "grafana" / "dashboards"
#: the status page's screenshot stays in the test's tmp_path; set this to a path to get a copy of it
#: (docs/images/monitor.png is made so: PATHSWARM_MONITOR_SCREENSHOT=$PWD/docs/images/monitor.png)
SCREENSHOT_COPY = os.environ.get("PATHSWARM_MONITOR_SCREENSHOT")
#: Grafana template variables, replaced by "any value" so a panel's query can run in Prometheus
VARIABLES = {"$peer_id": ".+", "$instance": ".+"}

prometheus = shutil.which("prometheus")
chromium = shutil.which("chromium")
pytestmark = [
    pytest.mark.swarm,
    pytest.mark.skipif(prometheus is None, reason="prometheus not installed (Debian package `prometheus`)"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def query(prom: str, expr: str) -> list:
    answer = get_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def panel_expressions() -> dict[str, str]:
    out = {}
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in VARIABLES.items():
                    expr = expr.replace(var, value)
                out[f"{path.stem}: {panel['title']} [{target['refId']}]"] = expr
    return out


def alert_rules() -> dict[str, str]:
    groups = yaml.safe_load((PROM_DIR / "rules.yml").read_text())["groups"]
    return {r["alert"]: r["expr"] for g in groups for r in g["rules"] if "alert" in r}


def fast_rules(folder: Path) -> Path:
    """The rules with every `for:` shortened to 3 s, so alerts fire within the test."""
    text = re.sub(r"for: \w+", "for: 3s", (PROM_DIR / "rules.yml").read_text())
    path = folder / "rules.yml"
    path.write_text(text)
    return path


def start_prometheus(folder: Path, targets: dict[str, list[str]]) -> tuple[subprocess.Popen, str]:
    """A real Prometheus scraping `targets`, returned once it answers `/-/ready`, with its URL.

    Its port is picked free before it starts, so another process (a parallel test's daemon dialling
    out from that port) can take it in between: Prometheus then exits, and it is started again on
    another port rather than every query after meeting a closed port."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(fast_rules(folder))],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": t}]} for job, t in targets.items()
        ],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    for attempt in range(3):
        port = free_port()
        log_path = folder / f"prometheus-{attempt}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [prometheus, f"--config.file={folder / 'prometheus.yml'}",
                 f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as r:
                    if r.status == 200:
                        return proc, url
            except OSError:
                pass  # not listening yet, or still starting (503)
            time.sleep(0.3)
        proc.kill()
        proc.wait(timeout=20)
    raise AssertionError(f"prometheus did not become ready in 3 tries:\n{log_path.read_text()[-2000:]}")


def peer_id_in_log(swarm: LocalSwarm, name: str) -> str | None:
    found = re.search(r"joined run \S+ \(created by key \w+\) as (\w+)", swarm.log_path(name).read_text())
    return found.group(1) if found else None


def l1m1_orphaned(prom_url: str) -> list:
    alerts = get_json(f"{prom_url}/api/v1/alerts")["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == "PathswarmModuleOrphaned"
            and a["labels"].get("module") == "l1m1" and a["state"] == "firing"]  # fmt: skip


def chromium_run(*args: str) -> str:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=True).stdout


@pytest.mark.timeout(420)
def test_prometheus_and_status_page_see_the_swarm_and_an_orphaned_module(tmp_path):
    manifest, run_id = write_manifest(tmp_path)
    ports = {name: free_port() for name in ("a", "b", "monitor", "page")}
    prom_url = ""
    page_url = f"http://127.0.0.1:{ports['page']}"
    prom = None
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(manifest)])
        # a trains path 0 (trunk l0m0 l1m0), b path 1 (trunk l0m0 l1m1): b is l1m1's only holder
        for name, path in (("a", "0"), ("b", "1")):
            metrics = ["--metrics_port", str(ports[name]), "--metrics_host", "127.0.0.1"]
            swarm.start_peer(
                name, peer_args(run_id, tmp_path / name, "--path", path, "--max_rounds", "1000", *metrics)
            )
        monitor = ["--run", f"{RUN}@{run_id[:16]}", "--metrics_port", str(ports["monitor"]), "--host",
                   "127.0.0.1", "--http_port", str(ports["page"]), "--interval_seconds", "1"]  # fmt: skip
        swarm.spawn(
            "monitor",
            ["monitor", "--initial_peers", *swarm.initial_peers, "--host_maddrs", LOOPBACK, *monitor],
        )
        try:
            prom, prom_url = start_prometheus(tmp_path, {
                "monitor": [f"127.0.0.1:{ports['monitor']}"],
                "peers": [f"127.0.0.1:{ports['a']}", f"127.0.0.1:{ports['b']}"],
            })  # fmt: skip

            def joined():
                found = [peer_id_in_log(swarm, n) for n in "ab"]
                return found if all(found) else None

            ids = wait_for(joined, 120, "both peers to join", swarm)

            def both_training():
                try:
                    status = get_json(f"{page_url}/api/status")
                except OSError:
                    return False
                training = sorted(p["peer_id"] for p in status["peers"] or [] if p["state"] == "training")
                return training if len(training) == 2 else None

            assert wait_for(both_training, 120, "the monitor to see both peers training", swarm) == sorted(
                ids
            )

            # every panel's query returns data once the peers have synced a few rounds
            panels = panel_expressions()
            missing: dict[str, str] = dict(panels)
            deadline = time.monotonic() + 150
            while missing and time.monotonic() < deadline:
                missing = {k: e for k, e in missing.items() if not query(prom_url, e)}
                time.sleep(2)
            assert not missing, f"panels without data: {missing}\n" + swarm.log_path("a").read_text()[-2000:]
            # the plan's predicted round beside the one measured over the monitor's clock
            plan = get_json(f"{page_url}/api/status")["plan"]
            assert plan["peers"] == 2 and plan["current_round_seconds"] > 0, plan
            wait_for(lambda: query(prom_url, 'pathswarm_swarm_round_seconds{kind="measured"}'), 60,
                     "the monitor to measure the peers' round time", swarm)  # fmt: skip

            # every alert expression is valid, and every series it reads is there
            rules = alert_rules()
            for name, expr in rules.items():
                query(prom_url, expr)
                for metric in set(re.findall(r"pathswarm_\w+", expr)):
                    assert query(prom_url, metric), f"{name}: no series {metric}"
            assert not l1m1_orphaned(prom_url), "l1m1 still has its holder"

            scrape = query(prom_url, 'scrape_duration_seconds{job="monitor"}')
            poll = query(prom_url, "pathswarm_monitor_poll_duration_seconds")
            figures = {"panels_checked": len(panels), "alerts_checked": len(rules),
                       "monitor_scrape_seconds": float(scrape[0]["value"][1]),
                       "monitor_poll_seconds": float(poll[0]["value"][1])}  # fmt: skip

            # the status page in a real browser: the peers and module holders of this swarm
            if chromium is not None:
                dom = chromium_run("--dump-dom", page_url + "/")
                shown = set(re.findall(r'<tr data-peer="(\w+)"', dom))
                assert shown == set(ids), (shown, ids)
                holders = dict(re.findall(r'data-module="(\w+)" data-holders="(\d+)"', dom))
                assert holders == {"trunk": "2", "l0m0": "2", "l1m0": "1", "l1m1": "1", "l0m1": "0"}, holders
                assert f'<span id="run">{RUN}</span>' in dom and "<svg" in dom
                assert 'id="plan"' in dom and "round now (cost model)" in dom
                shot = tmp_path / "monitor.png"
                chromium_run(
                    f"--screenshot={shot}", "--window-size=1280,960", f"{page_url}/?peer={ids[0][:12]}"
                )
                assert shot.stat().st_size > 10_000
                if SCREENSHOT_COPY:  # only where the developer asks: tests write under tmp_path
                    shutil.copy(shot, SCREENSHOT_COPY)

            # the last holder of l1m1 leaves: the orphaned-module alert for l1m1 fires
            swarm.kill("b", signal.SIGTERM)
            wait_for(lambda: l1m1_orphaned(prom_url), 90, "PathswarmModuleOrphaned for l1m1 to fire", swarm)
            figures["orphan_alert_fired"] = True
            print("monitor test figures: " + json.dumps(figures))
            (tmp_path / "figures.json").write_text(json.dumps(figures))
        finally:
            if prom is not None:
                prom.terminate()
                try:
                    prom.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    prom.kill()
