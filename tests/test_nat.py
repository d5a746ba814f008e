"""A peer behind a NAT learns at start that nobody can dial it, and which port to open.

Three network namespaces: `pub` (bootstrap and one peer, 10.77.1.0/24), `nat` (the volunteer,
10.77.2.0/24) and `rtr` between them, which masquerades `nat`'s traffic and drops every connection
that starts from `pub` (no inbound path, as behind a home router). Needs root, iproute2 and iptables.

Not shown yet: the NAT'd peer with --use_auto_relay getting a relay reservation on the bootstrap node
and averaging through it. In this lab no `/p2p-circuit` address appeared within 30 s of start
(hivemind 1.1.12's p2pd, forceReachabilityPrivate, the bootstrap peer as the default trusted relay).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer.swarm.reachability import helpers_from, relay_of, tcp_endpoint
from tests.swarm_harness import RUN, write_manifest

REPO = Path(__file__).resolve().parent.parent


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True)
    assert not check or proc.returncode == 0, f"{' '.join(args)}: {proc.stderr}"
    return proc


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian packages iproute2, iptables)"
    return None


class NatLab:
    """pub <-> rtr <-> nat; rtr masquerades nat and refuses connections into it."""

    def __init__(self):
        tag = secrets.token_hex(2)
        self.pub, self.rtr, self.nat = (f"psn{tag}{x}" for x in ("pub", "rtr", "nat"))
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> NatLab:
        try:
            for ns in (self.pub, self.rtr, self.nat):
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            t = self.rtr[3:7]
            for side, ns, net in (("p", self.pub, "1"), ("n", self.nat, "2")):
                a, b = f"v{t}{side}r", f"v{t}{side}x"  # router end, far end
                sh("ip", "link", "add", a, "netns", self.rtr, "type", "veth", "peer", "name", b, "netns", ns)
                sh("ip", "-n", self.rtr, "addr", "add", f"10.77.{net}.1/24", "dev", a)
                sh("ip", "-n", ns, "addr", "add", f"10.77.{net}.2/24", "dev", b)
                sh("ip", "-n", self.rtr, "link", "set", a, "up")
                sh("ip", "-n", ns, "link", "set", b, "up")
            sh("ip", "-n", self.nat, "route", "add", "default", "via", "10.77.2.1")
            sh("ip", "netns", "exec", self.rtr, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            ipt = ["ip", "netns", "exec", self.rtr, "iptables"]
            sh(
                *ipt,
                "-t",
                "nat",
                "-A",
                "POSTROUTING",
                "-s",
                "10.77.2.0/24",
                "-o",
                f"v{t}pr",
                "-j",
                "MASQUERADE",
            )
            sh(*ipt, "-A", "FORWARD", "-i", f"v{t}pr", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
               "-j", "ACCEPT")  # fmt: skip
            sh(*ipt, "-A", "FORWARD", "-i", f"v{t}pr", "-j", "DROP")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def spawn(self, ns: str, log: Path, *args: str) -> subprocess.Popen:
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "peer", *args],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for ns in (self.pub, self.rtr, self.nat):
            sh("ip", "netns", "delete", ns, check=False)  # deletes its veths too


def wait_log(path: Path, pattern: str, timeout: float, procs: list[subprocess.Popen]) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text())
        if found:
            return found
        time.sleep(0.5)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(path.parent.glob("*.log")))
    raise AssertionError(f"timed out waiting for {pattern!r} in {path.name}\n{logs}")


def test_relay_addresses_are_recognised():
    circuit = "/ip4/10.77.1.2/tcp/4001/p2p/QmRelay/p2p-circuit/p2p/QmMe"
    assert relay_of(circuit) == "QmRelay" and relay_of("/ip4/1.2.3.4/tcp/1") is None
    assert tcp_endpoint(circuit) is None and tcp_endpoint("/ip4/1.2.3.4/tcp/7") == ("1.2.3.4", 7)
    assert helpers_from(["/ip4/1.2.3.4/tcp/7/p2p/QmA", "/ip6/::1/tcp/7/p2p/QmA"]) == ["QmA"]


@pytest.mark.timeout(300)
def test_reachability_check_tells_a_peer_behind_nat_from_one_outside(tmp_path):
    """The dial-back check: the peer outside is dialled back directly; the one behind the NAT is told
    that nobody can dial it and which port to open. (Joining and averaging through a relay is not
    shown yet: see the module's docstring.)"""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    manifest, run_id = write_manifest(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    peer = ["peer", "--run", f"{RUN}@{run_id[:16]}", "--path", "0", "--torch_threads", "1",
            "--batch_size", "4", "--heartbeat_seconds", "1"]  # fmt: skip
    with NatLab() as lab:
        lab.spawn(lab.pub, logs / "bootstrap.log", "bootstrap", "--host_maddrs", "/ip4/10.77.1.2/tcp/0",
                  "--manifest_path", str(manifest))  # fmt: skip
        initial = wait_log(logs / "bootstrap.log", r"--initial_peers (\S+)", 60, lab.procs).group(1)
        lab.spawn(lab.pub, logs / "outside.log", *peer, "--initial_peers", initial, "--host_maddrs",
                  "/ip4/10.77.1.2/tcp/0", "--max_steps", "5")  # fmt: skip
        lab.spawn(lab.nat, logs / "behind.log", *peer, "--initial_peers", initial, "--host_maddrs",
                  "/ip4/0.0.0.0/tcp/0", "--max_steps", "5")  # fmt: skip
        wait_log(logs / "outside.log", r"reachable directly at /ip4/10\.77\.1\.2/", 120, lab.procs)
        told = wait_log(logs / "behind.log", r"(reachable directly|not reachable: open TCP port (\d+))", 120,
                        lab.procs)  # fmt: skip
        assert told.group(2), told.group(0)
        assert "--use_auto_relay" in (logs / "behind.log").read_text()
