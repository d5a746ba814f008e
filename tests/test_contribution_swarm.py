"""Contributions against a real swarm: two peers average a few rounds and leave, the monitor's
`/api/status` shows each one's signed totals equal to its last checkpoint, a peer resumed with
--resume goes on from its totals (its `pathswarm health` says so), the status page in headless
Chromium shows the numbers, and records forged or tampered by another key are never shown."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from dht.keys import contributions_key
from dht.node import start_dht
from dht.records import store_record
from dht.schema import ContributionRecord
from peer.checkpoint import load_latest_checkpoint
from peer.cli.local_swarm import LOOPBACK, LocalSwarm
from peer.run.contribution import sign_contribution
from tests.swarm_harness import RUN, peer_args, wait_for, write_manifest
from tests.test_monitor_swarm import chromium, chromium_run, free_port, get_json, peer_id_in_log

pytestmark = pytest.mark.swarm
#: set to a path to keep a copy of the page's screenshot (tests write only under tmp_path)
SCREENSHOT_COPY = os.environ.get("PATHSWARM_CONTRIBUTION_SCREENSHOT")
NUMBERS = ("tokens", "inner_steps", "rounds_averaged", "modules_held")
FORGED_TOKENS = 10**12


def checkpoint_totals(folder) -> dict:
    _, meta = load_latest_checkpoint(folder)
    totals = meta["contribution"]
    assert totals["tokens"] == meta["tokens_total"] and totals["inner_steps"] == meta["step"]
    return totals


def shown(page_url: str) -> dict[str, dict]:
    try:
        status = get_json(f"{page_url}/api/status")
    except OSError:
        return {}
    return {r["peer_id"]: r for r in status.get("contributions") or []}


def matches(page_url: str, peer_id: str, totals: dict) -> dict | None:
    """The monitor's row of `peer_id` if it shows the checkpoint's totals (time online: within 10 s,
    the checkpoint is written a moment before the last record)."""
    row = shown(page_url).get(peer_id)
    if row is None or any(row[k] != totals[k] for k in NUMBERS):
        return None
    return row if abs(row["online_seconds"] - totals["online_seconds"]) <= 10 else None


def health(port: int) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "peer", "health", "--metrics_port", str(port), "--timeout_seconds", "5"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out
    return out.stdout


def forge(initial_peers: list[str], run_id: str, victim: str) -> list:
    """Two keys of an attacker: one stores a record in `victim`'s name, the other its own record with
    the numbers raised after signing. Returns their DHT nodes (to shut down)."""
    key_name = contributions_key(RUN, run_id)
    nodes = []
    for forged in ("victim", "tampered"):
        dht, key = start_dht(initial_peers=initial_peers, host_maddrs=[LOOPBACK])
        nodes.append(dht)
        claimed = victim if forged == "victim" else str(dht.peer_id)
        record = sign_contribution(ContributionRecord(run_id=run_id, peer_id=claimed, tokens=5), key)
        record = record.model_copy(update={"tokens": FORGED_TOKENS, "rounds_averaged": 10**6})
        store_record(dht, key_name, key, record, 300)
    return nodes


def joined(swarm: LocalSwarm) -> list[str] | None:
    found = [peer_id_in_log(swarm, n) for n in "ab"]
    return found if all(found) else None


def monitor_args(swarm: LocalSwarm, run_id: str, ports: dict[str, int]) -> list[str]:
    return ["monitor", "--initial_peers", *swarm.initial_peers, "--host_maddrs", LOOPBACK,
            "--run", f"{RUN}@{run_id[:16]}", "--metrics_port", str(ports["monitor"]), "--host", "127.0.0.1",
            "--http_port", str(ports["page"]), "--interval_seconds", "1"]  # fmt: skip


def refused(page_url: str) -> dict | None:
    status = get_json(f"{page_url}/api/status")
    return status if status.get("contributions_rejected") else None


@pytest.mark.timeout(240)
def test_the_monitor_shows_each_volunteers_signed_totals_equal_to_its_checkpoint(tmp_path):
    manifest, run_id = write_manifest(tmp_path)
    ports = {name: free_port() for name in ("a", "page", "monitor")}
    page_url = f"http://127.0.0.1:{ports['page']}"
    # a keeps its key over its restart (as the container does, in /data): its totals stay its own
    a_args = peer_args(run_id, tmp_path / "a", "--path", "0", "--identity_path", str(tmp_path / "a.id"))
    rogues = []
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(manifest)])
        # a and b share trunk and l0m0: they average together for three rounds, then leave
        swarm.start_peer("a", [*a_args, "--max_rounds", "3", "--wait_for_peers", "2"])
        b_args = peer_args(
            run_id, tmp_path / "b", "--path", "1", "--max_rounds", "3", "--wait_for_peers", "2"
        )
        swarm.start_peer("b", b_args)
        swarm.spawn("monitor", monitor_args(swarm, run_id, ports))
        try:
            a, b = wait_for(lambda: joined(swarm), 90, "both peers to join", swarm)
            rogues = forge(swarm.initial_peers, run_id, victim=a)
            for name in "ab":
                assert swarm.wait(name, timeout=120) == 0, swarm.log_path(name).read_text()[-3000:]
            totals = {a: checkpoint_totals(tmp_path / "a"), b: checkpoint_totals(tmp_path / "b")}
            assert totals[a]["rounds_averaged"] >= 1 and totals[a]["averaged_with"].get(b, 0) >= 1, totals
            rows = {}
            for p, t in totals.items():
                rows[p] = wait_for(
                    lambda p=p, t=t: matches(page_url, p, t), 30, f"the monitor to show {p}", swarm
                )
            # a has left: its leaving claim may reach the monitor's view a refresh after its last
            # record, so the row is awaited offline rather than read at the first match
            rows[a] = wait_for(
                lambda: (r := matches(page_url, a, totals[a])) and not r["online"] and r,
                30,
                f"the monitor to show {a} offline",
                swarm,
            )
            # a's rounds with others are confirmed by b's own record, and b's by a's
            assert rows[a]["rounds_confirmed"] == min(
                totals[a]["rounds_averaged"], totals[b]["averaged_with"][a]
            )
            assert rows[b]["rounds_confirmed"] >= 1

            # the forged and the tampered records: refused, never anyone's contribution
            status = wait_for(
                lambda: refused(page_url), 30, "the monitor to refuse the tampered record", swarm
            )
            assert status["contributions_rejected"] == {"signature does not match": 1}, status
            assert {r["peer_id"] for r in status["contributions"]} == {a, b}
            assert all(r["tokens"] < FORGED_TOKENS for r in status["contributions"])

            # a resumes: its totals go on from its checkpoint's, and `pathswarm health` says so
            before = totals[a]
            metrics = ["--metrics_port", str(ports["a"]), "--metrics_host", "127.0.0.1"]
            swarm.start_peer("a2", [*a_args, "--resume", "--max_rounds", "100", *metrics])

            def resumed_health():
                try:
                    line = health(ports["a"]).splitlines()[1]
                except (AssertionError, IndexError):
                    return None
                tokens = int(re.search(r"(\d+) tokens trained", line).group(1))
                return line if tokens > before["tokens"] else None

            line = wait_for(resumed_health, 90, "the resumed peer to train past its checkpoint", swarm)
            rounds = int(re.search(r"(\d+) rounds averaged with others", line).group(1))
            assert rounds == before["rounds_averaged"], line  # alone since: nobody to average with
            swarm.kill("a2", signal.SIGTERM)
            assert swarm.wait("a2", timeout=60) == 0, swarm.log_path("a2").read_text()[-3000:]
            after = checkpoint_totals(tmp_path / "a")
            assert after["tokens"] > before["tokens"] and after["online_seconds"] >= before["online_seconds"]
            wait_for(lambda: matches(page_url, a, after), 30, "the monitor to show the resumed totals", swarm)

            if chromium is not None:  # the page in a real browser, as a volunteer opens it
                url = f"{page_url}/?peer={a[:12]}"
                dom = chromium_run("--dump-dom", url)
                cells = dict(re.findall(r'data-contribution="(\w+)" data-tokens="(\d+)"', dom))
                assert cells == {a: str(after["tokens"]), b: str(totals[b]["tokens"])}, cells
                assert f'id="my-contribution" data-peer="{a}"' in dom
                shot = tmp_path / "contribution.png"
                chromium_run(f"--screenshot={shot}", "--window-size=1280,1400", url)
                assert shot.stat().st_size > 10_000
                if SCREENSHOT_COPY:
                    shutil.copy(shot, SCREENSHOT_COPY)
        finally:
            for dht in rogues:
                dht.shutdown()
