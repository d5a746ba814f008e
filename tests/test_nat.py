"""Peers behind NAT: the start-up verdict on reachability, and joining and averaging through a relay.

Network namespaces: `pub` (the bootstrap node and a peer with an open port, 11.77.1.0/24), one or two
home networks `natA`, `natB` (10.77.2.0/24, 10.77.3.0/24), and `rtr` joining them, which masquerades
the home networks' traffic out of its `pub` side and forwards nothing else: no connection into a home
network, none between the two (as two volunteers behind two home routers). Needs root, iproute2 and
iptables.

The `pub` side has a globally routable-looking address on purpose: go-libp2p builds circuit addresses
only from a relay's public addresses, so a relay on 10.x could make nobody reachable. The namespaces
have no route to the outside, so nothing leaves this machine.
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

# network namespaces are host-wide: one test at a time makes them
pytestmark = [pytest.mark.swarm, pytest.mark.xdist_group("netns")]

REPO = Path(__file__).resolve().parent.parent
PUB_IP = "11.77.1.2"
#: fixed ports are safe: each namespace has its own port space
BOOTSTRAP_PORT, OUTSIDE_PORT = 31337, 31338


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
    """pub <-> rtr <-> home networks; rtr masquerades them and lets no connection into them."""

    def __init__(self, homes: int = 1):
        tag = secrets.token_hex(2)
        self.tag = tag
        self.pub, self.rtr = f"psn{tag}pub", f"psn{tag}rtr"
        self.homes = [f"psn{tag}nat{chr(ord('A') + i)}" for i in range(homes)]
        self.procs: list[subprocess.Popen] = []

    @property
    def nat(self) -> str:
        return self.homes[0]

    def _leg(self, ns: str, name: str, router_ip: str, far_ip: str) -> str:
        a, b = f"v{self.tag}{name}r", f"v{self.tag}{name}x"  # router end, far end
        sh("ip", "link", "add", a, "netns", self.rtr, "type", "veth", "peer", "name", b, "netns", ns)
        sh("ip", "-n", self.rtr, "addr", "add", f"{router_ip}/24", "dev", a)
        sh("ip", "-n", ns, "addr", "add", f"{far_ip}/24", "dev", b)
        sh("ip", "-n", self.rtr, "link", "set", a, "up")
        sh("ip", "-n", ns, "link", "set", b, "up")
        return a

    def __enter__(self) -> NatLab:
        try:
            for ns in (self.pub, self.rtr, *self.homes):
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
            out = self._leg(self.pub, "p", "11.77.1.1", PUB_IP)
            ipt = ["ip", "netns", "exec", self.rtr, "iptables"]
            sh("ip", "netns", "exec", self.rtr, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            sh(*ipt, "-P", "FORWARD", "DROP")
            sh(*ipt, "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            for i, ns in enumerate(self.homes):
                net = f"10.77.{2 + i}"
                leg = self._leg(ns, f"n{i}", f"{net}.1", f"{net}.2")
                sh("ip", "-n", ns, "route", "add", "default", "via", f"{net}.1")
                sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-s", f"{net}.0/24", "-o", out, "-j", "MASQUERADE")
                sh(*ipt, "-A", "FORWARD", "-i", leg, "-o", out, "-j", "ACCEPT")  # out to the world only
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def home_ip(self, ns: str) -> str:
        return f"10.77.{2 + self.homes.index(ns)}.2"

    def can_connect(self, ns: str, host: str, port: int) -> bool:
        """Whether a TCP connection from namespace `ns` to host:port opens (the lab's own check)."""
        code = (
            "import socket,sys\n"
            "try:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), 3).close()\n"
            "except OSError:\n sys.exit(1)"
        )
        probe = ["ip", "netns", "exec", ns, sys.executable, "-c", code, host, str(port)]
        return subprocess.run(probe, capture_output=True).returncode == 0

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
        for ns in (self.pub, self.rtr, *self.homes):
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


def _start_bootstrap(lab: NatLab, logs: Path, manifest: Path) -> str:
    lab.spawn(
        lab.pub,
        logs / "bootstrap.log",
        "bootstrap",
        "--host_maddrs",
        f"/ip4/{PUB_IP}/tcp/{BOOTSTRAP_PORT}",
        "--manifest_path",
        str(manifest),
    )
    return wait_log(logs / "bootstrap.log", r"--initial_peers (\S+)", 60, lab.procs).group(1)


def _peer_args(run_id: str, initial: str, ckpt: Path, *extra: str) -> list[str]:
    return [
        "peer",
        "--run",
        f"{RUN}@{run_id[:16]}",
        "--path",
        "0",
        "--torch_threads",
        "1",
        "--batch_size",
        "4",
        "--heartbeat_seconds",
        "1",
        "--initial_peers",
        initial,
        "--checkpoint_dir",
        str(ckpt),
        *extra,
    ]


@pytest.mark.timeout(300)
def test_reachability_check_tells_a_peer_behind_nat_from_one_outside(tmp_path):
    """The dial-back check: the peer outside is dialled back directly; the one behind the NAT is told
    that nobody can dial it, which port to open, and that a relay would do."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    manifest, run_id = write_manifest(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    with NatLab() as lab:
        initial = _start_bootstrap(lab, logs, manifest)
        lab.spawn(
            lab.pub,
            logs / "outside.log",
            *_peer_args(run_id, initial, tmp_path / "c1"),
            "--host_maddrs",
            f"/ip4/{PUB_IP}/tcp/{OUTSIDE_PORT}",
            "--max_steps",
            "5",
        )
        lab.spawn(
            lab.nat,
            logs / "behind.log",
            *_peer_args(run_id, initial, tmp_path / "c2"),
            "--host_maddrs",
            "/ip4/0.0.0.0/tcp/0",
            "--max_steps",
            "5",
        )
        wait_log(
            logs / "outside.log",
            rf"reachable directly at /ip4/{re.escape(PUB_IP)}/tcp/{OUTSIDE_PORT}/",
            120,
            lab.procs,
        )
        told = wait_log(
            logs / "behind.log", r"(reachable directly|not reachable: open TCP port (\d+))", 120, lab.procs
        )
        assert told.group(2), told.group(0)
        assert "--use_auto_relay" in (logs / "behind.log").read_text()


def _rounds(log: str) -> list[str]:
    return re.findall(r"round (\d+) step \d+ loss [\d.]+ (\{.*\})", log)


@pytest.mark.timeout(420)
def test_two_peers_behind_separate_nats_join_claim_and_average_through_the_bootstrap_relay(tmp_path):
    """Two volunteers, each behind its own NAT, with --use_auto_relay: each reserves a slot on the
    bootstrap node and says so; the second downloads the path's state from the first and the two
    average their modules, every byte between them through the relay (the lab lets neither reach the
    other any other way, which the test checks first), and end with identical global copies."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    manifest, run_id = write_manifest(tmp_path, inner_steps=10, grid=(1, 1))
    logs = tmp_path / "logs"
    logs.mkdir()
    with NatLab(homes=2) as lab:
        initial = _start_bootstrap(lab, logs, manifest)
        boot_id = helpers_from([initial])[0]
        listen = ("--use_auto_relay", "--host_maddrs", "/ip4/0.0.0.0/tcp/4001")
        a_args = _peer_args(run_id, initial, tmp_path / "ca", *listen, "--max_rounds", "1000")
        a = lab.spawn(lab.homes[0], logs / "a.log", *a_args)
        wait_log(logs / "a.log", rf"reachable through relay {boot_id}", 90, lab.procs)
        wait_log(logs / "a.log", r"round 2 step", 120, lab.procs)
        b_args = _peer_args(run_id, initial, tmp_path / "cb", *listen, "--max_rounds", "3")
        b = lab.spawn(lab.homes[1], logs / "b.log", *b_args)
        wait_log(logs / "b.log", rf"reachable through relay {boot_id}", 90, lab.procs)
        # no path between the homes but the relay: neither home address nor the router's public one
        # (where each home's masqueraded connections appear) accepts a connection from the other home
        a_ip = lab.home_ip(lab.homes[0])
        assert lab.can_connect(lab.homes[0], a_ip, 4001)  # a listens
        assert not lab.can_connect(lab.homes[1], a_ip, 4001)
        assert not lab.can_connect(lab.homes[1], "11.77.1.1", 4001)
        assert lab.can_connect(lab.homes[1], PUB_IP, BOOTSTRAP_PORT)  # out to the world: yes
        try:
            assert b.wait(timeout=240) == 0, (logs / "b.log").read_text()[-3000:]
        except subprocess.TimeoutExpired:
            wait_log(logs / "b.log", r"(?!)", 0, lab.procs)  # fails with every log's tail
        a.send_signal(signal.SIGTERM)
        assert a.wait(timeout=60) == 0, (logs / "a.log").read_text()[-3000:]
        a_log, b_log = (logs / "a.log").read_text(), (logs / "b.log").read_text()
        # the download (both modules' states, more than go-libp2p's default 128 KiB relay limit)
        # went through whole, and nothing in the join was worth a warning
        caught_up = re.findall(r"(\w+): caught up to module round [1-9]\d* from its holders", b_log)
        assert sorted(caught_up) == ["l0m0", "trunk"], b_log[-3000:]
        loud = [line for line in b_log.splitlines() if re.search(r" (WARN|WARNING|ERROR|CRITICAL) ", line)]
        assert not loud, "\n".join(loud)
        assert "relay for peers behind NAT: up" in (logs / "bootstrap.log").read_text()
        # a round both logged as averaged by two is one all-reduce between them, which ends with the
        # same bits on both members (tests/test_rounds.py)
        averaged_a = {r for r, outcomes in _rounds(a_log) if "averaged/2" in outcomes}
        averaged_b = {r for r, outcomes in _rounds(b_log) if "averaged/2" in outcomes}
        assert averaged_a & averaged_b, a_log[-2500:] + b_log[-2500:]
