"""Why a DHT node did not start, said as one line a volunteer can act on.

hivemind and its p2p daemon fail a join with messages written for their developers ("Daemon failed to
start: 2026/01/01 failed to connect to bootstrap peers", "Identity from `x` is already taken").
`explain_start_failure` turns each start-up failure a volunteer can hit into one sentence that says
what happened and what to do: which initial peers were tried and whether their TCP port answers, why
the daemon did not start (from the last line it wrote), that the identity is in use by a running
peer, or that this machine's clock is off.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Sequence

from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS

#: how long each initial peer's TCP port gets to answer when a join failed
PORT_PROBE_TIMEOUT_SECONDS = 2.0

_CLOCK_MISMATCH = re.compile(r"local time must be within .*local: ([0-9.]+), peer: ([0-9.]+)")
_GO_LOG_PREFIX = re.compile(r"^\d{4}/\d{2}/\d{2} \d{2}:\d{2}:\d{2}(\.\d+)? ")
_LISTEN_FAILURE = re.compile(r"listen (tcp[46]?|udp[46]?) ([^:]+|\[[^\]]+\]):(\d+): bind: ([^\]]+)")


def explain_start_failure(
    e: BaseException, initial_peers: Sequence[str], identity_file: str | None = None
) -> str:
    """One line: what went wrong when starting a DHT node, and what to do about it."""
    text = " ".join(str(e).split()) or repr(e)
    skew = _CLOCK_MISMATCH.search(text)
    if skew:
        # hivemind's DHT refuses a node whose clock is off the bootstrap peer's by more than
        # MAX_DHT_TIME_DISCREPANCY_SECONDS: the honest fix is the clock, not a looser check
        offset = float(skew.group(1)) - float(skew.group(2))
        return (
            f"could not start the DHT node: this machine's clock is {offset:+.1f} s off the "
            f"bootstrap peer's, and the DHT accepts at most {MAX_DHT_TIME_DISCREPANCY_SECONDS} s: "
            "synchronise the clock (e.g. `timedatectl set-ntp true`) and start again"
        )
    if "is already taken by another peer" in text:
        where = f" {identity_file}" if identity_file else ""
        return (
            f"identity{where} is already in use by a running peer: stop that peer first, or give this "
            "one its own --identity_path (a missing file is created)"
        )
    if "failed to connect to bootstrap peers" in text or "none of the initial_peers responded" in text:
        return no_initial_peer_answered(initial_peers)
    if "Daemon failed to start in" in text:
        return (
            f"the p2p daemon did not start in time ({text.split('Daemon failed to start in ')[-1]}): "
            "the machine may be overloaded; try again"
        )
    if "Daemon failed to start" in text or "p2pd" in text:
        return daemon_failure(text)
    hint = " (is the bootstrap peer running and reachable?)" if initial_peers else ""
    return f"could not start the DHT node: {text}{hint}"


def no_initial_peer_answered(initial_peers: Sequence[str]) -> str:
    tried = "; ".join(f"{m} ({probe_port(m)})" for m in initial_peers) or "none given"
    return (
        f"no initial peer answered (is the bootstrap peer running and reachable?): tried {tried}: "
        "check the --initial_peers addresses, and that their TCP port is open to this machine "
        "(firewall, port forwarding, `-p` of docker run)"
    )


def daemon_failure(text: str) -> str:
    """The daemon's own last line, made readable: JSON log lines give their message, Go's log prefix
    (a timestamp) goes, and a port that is taken says which flag to change."""
    why = text.split("Daemon failed to start:", 1)[-1].strip()
    try:
        record = json.loads(why)
        why = str(record.get("msg", why)) + (f": {record['error']}" if "error" in record else "")
    except (ValueError, AttributeError):
        pass
    why = _GO_LOG_PREFIX.sub("", why)
    listen = _LISTEN_FAILURE.search(why)
    if listen:
        _, host, port, reason = listen.groups()
        return (
            f"the p2p daemon did not start: it cannot listen on {host}:{port} ({reason.strip()}): "
            "choose a free port in --host_maddrs, or stop the program that holds it"
        )
    return f"the p2p daemon did not start: {why or 'it exited without saying why'}"


def probe_port(maddr: str, timeout_seconds: float = PORT_PROBE_TIMEOUT_SECONDS) -> str:
    """Whether the TCP port in a multiaddress accepts connections from here, in a few words."""
    try:
        parsed = Multiaddr(maddr)
        protocols = {p.name for p in parsed.protocols()}
        host = next(
            parsed.value_for_protocol(p) for p in ("ip4", "ip6", "dns4", "dns6", "dns") if p in protocols
        )
        port = int(parsed.value_for_protocol("tcp"))
    except Exception:
        return "not a TCP address, not probed"
    try:
        with socket.create_connection((host, port), timeout=timeout_seconds):
            return f"TCP port {port} is open, but no peer with that id answered: is the /p2p/ id right?"
    except ConnectionRefusedError:
        return f"connection to TCP port {port} refused: nothing listens there"
    except TimeoutError:
        return f"TCP port {port} did not answer in {timeout_seconds:g} s: closed by a firewall or NAT?"
    except OSError as e:
        return f"cannot reach {host}:{port}: {e.strerror or e}"
