"""The emulated WAN of benchmarks/wan/netlab.py: connectivity, the egress cap, counters, teardown.

Needs root and network namespaces; skipped (not failed) where they cannot be made.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from benchmarks.wan.netlab import NetLab, can_make_namespaces, lab_links, lab_namespaces

OK, WHY = can_make_namespaces()
pytestmark = [
    pytest.mark.swarm,
    pytest.mark.xdist_group("netns"),  # namespaces are host-wide: one test at a time
    pytest.mark.skipif(not OK, reason=f"cannot make network namespaces here: {WHY}"),
    pytest.mark.timeout(60),
]

CAP_MBIT = 8.0
PAYLOAD = 3_000_000  # 3 s at the cap: long enough that the token bucket's burst hardly counts

SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5001))
s.listen(1)
print("listening", flush=True)
c, _ = s.accept()
n = 0
while data := c.recv(1 << 16):
    n += len(data)
print("received", n, flush=True)
"""

CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5001), timeout=20)
chunk, left = b"x" * 65536, int(sys.argv[2])
started = time.monotonic()
while left > 0:
    s.sendall(chunk[:left])
    left -= len(chunk)
s.close()
print("seconds", time.monotonic() - started, flush=True)
"""


def _wait_for(path, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.1)
    raise AssertionError(f"{path.name} never said {text!r}: {path.read_text() if path.exists() else ''}")


def test_two_namespaces_capped_counted_and_torn_down(tmp_path):
    lab = NetLab(2, cap_mbit=CAP_MBIT)
    with lab:
        sender, receiver = lab.hosts
        assert sender.netns in lab_namespaces(lab.tag) and receiver.netns in lab_namespaces(lab.tag)
        # each namespace has its loopback up and only its own address on the lab's bridge
        assert "UP" in lab.ns(receiver, "ip", "-o", "link", "show", "lo").stdout
        assert receiver.ip in lab.ns(receiver, "ip", "-o", "-4", "addr", "show", "eth0").stdout
        assert "default" not in lab.ns(sender, "ip", "route").stdout

        server_log, client_log = tmp_path / "server.log", tmp_path / "client.log"
        server = lab.spawn(receiver, [sys.executable, "-c", SERVER, receiver.ip], server_log)
        _wait_for(server_log, "listening", 15)
        before = lab.counters()
        started = time.monotonic()
        client = lab.spawn(sender, [sys.executable, "-c", CLIENT, receiver.ip, str(PAYLOAD)], client_log)
        client.wait(timeout=30)
        server.wait(timeout=10)
        elapsed = time.monotonic() - started
        after = lab.counters()

        assert f"received {PAYLOAD}" in server_log.read_text()
        sent = after[0][0] - before[0][0]
        received = after[1][1] - before[1][1]
        # what the sender put on its veth is the payload plus TCP/IP headers, and the receiver got it
        assert PAYLOAD <= sent < PAYLOAD * 1.1
        assert PAYLOAD <= received < PAYLOAD * 1.1
        assert after[1][0] - before[1][0] < PAYLOAD * 0.1  # only ACKs flow back
        mbit = sent * 8 / elapsed / 1e6
        # the cap holds: never above it by more than the burst allows, and not far below it
        assert 0.6 * CAP_MBIT < mbit < 1.15 * CAP_MBIT, f"{mbit:.2f} Mbit/s at a cap of {CAP_MBIT}"

        lingering = lab.spawn(sender, [sys.executable, "-c", "import time; time.sleep(300)"])
    assert lingering.poll() is not None, "teardown must kill the processes the lab started"
    assert lab_namespaces(lab.tag) == [] and lab_links(lab.tag) == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert lab.hosts[0].netns not in listed


def test_teardown_on_exception():
    loss = 0.1 if shutil.which("iptables") else 0.0  # its rules torn down too where it can make them
    with pytest.raises(KeyboardInterrupt):
        with NetLab(2, cap_mbit=5, loss=loss) as lab:
            assert len(lab_namespaces(lab.tag)) == 2
            raise KeyboardInterrupt
    assert lab_namespaces(lab.tag) == [] and lab_links(lab.tag) == []
