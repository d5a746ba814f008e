"""Can other peers reach this one? A dial-back check at start-up, and the answer in one log line.

A peer behind a NAT can join (it dials out) but nobody can dial it, so it cannot serve its modules
to joiners. At start a peer asks one of its initial peers, over a handler of our own on hivemind's P2P
(`pathswarm_dialback`), to open a plain TCP connection to each address the peer listens on. A
connection from outside means "direct"; otherwise a `/p2p-circuit` address among the peer's own
means it is reachable through that relay (libp2p circuit relay v2, `--use_auto_relay`); otherwise it
is "unreachable" and the log says which port to open. The state goes into every claim
(`ClaimRecord.reachability`), so the monitor can count peers by it.

The helper dials at most `MAX_DIAL_ADDRESSES` addresses per request, each once, with a short
timeout, only TCP, and only on the host the asker's own connection comes from (its observed address):
it cannot be turned into a port scanner of another host.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import hivemind
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from dht.node import visible_maddrs
from dht.p2p_handler import P2PHandler

logger = logging.getLogger(__name__)

HANDLER = "pathswarm_dialback"
MAX_DIAL_ADDRESSES = 8
DIAL_TIMEOUT_SECONDS = 3.0
#: how long a peer with --use_auto_relay waits for a relay reservation before it says it has none
RELAY_WAIT_SECONDS = 30.0


@dataclass(frozen=True)
class Reachability:
    """One of "direct", "relay", "unreachable", "unknown", with the line that explains it."""

    state: str
    message: str


def tcp_endpoint(maddr: str) -> tuple[str, int] | None:
    try:
        m = Multiaddr(maddr)
        names = {p.name for p in m.protocols()}
        if "p2p-circuit" in names or "tcp" not in names:
            return None
        host = next(m.value_for_protocol(p) for p in ("ip4", "ip6", "dns4", "dns6", "dns") if p in names)
        return host, int(m.value_for_protocol("tcp"))
    except Exception:
        return None


def relay_of(maddr: str) -> str | None:
    """The relay's peer id in `/.../p2p/RELAY/p2p-circuit/...`, or None for a direct address."""
    parts = maddr.split("/")
    if "p2p-circuit" not in parts:
        return None
    i = parts.index("p2p-circuit")
    return parts[i - 1] if i >= 2 and parts[i - 2] == "p2p" else None


class DialBackService:
    """Serves dial-back requests and asks them, over a P2P replica on a background event loop."""

    def __init__(self, dht: hivemind.DHT):
        self._handler = P2PHandler(dht, HANDLER, self._serve, "dialback")

    async def _observed_hosts(self, peer: PeerID) -> set[str]:
        """The hosts our connections to `peer` come from (none through a relay: that is no host of its)."""
        infos = await self._handler.p2p.list_peers()
        addresses = [str(a) for info in infos if info.peer_id == peer for a in info.addrs]
        return {e[0] for a in addresses if (e := tcp_endpoint(a)) is not None}

    async def _serve(self, request: runtime_pb2.Tensor, context: P2PContext) -> runtime_pb2.Tensor:
        try:
            asked = [str(a) for a in json.loads(request.buffer.decode())][:MAX_DIAL_ADDRESSES]
        except (ValueError, TypeError, UnicodeDecodeError):
            asked = []
        hosts = await self._observed_hosts(context.remote_id) if asked else set()
        answered = []
        for maddr in asked:
            endpoint = tcp_endpoint(maddr)
            if endpoint is None or endpoint[0] not in hosts:
                logger.debug(
                    f"dial-back for {context.remote_id}: not dialing {maddr} (it connects from {hosts})"
                )
                continue
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(*endpoint), DIAL_TIMEOUT_SECONDS)
                writer.close()
                answered.append(maddr)
            except (TimeoutError, OSError):
                continue
        return runtime_pb2.Tensor(buffer=json.dumps(answered).encode())

    async def _ask(self, helper: PeerID, addresses: list[str]) -> list[str]:
        request = runtime_pb2.Tensor(buffer=json.dumps(addresses[:MAX_DIAL_ADDRESSES]).encode())
        reply = await self._handler.p2p.call_protobuf_handler(helper, HANDLER, request, runtime_pb2.Tensor)
        return [str(a) for a in json.loads(reply.buffer.decode())]

    def check(
        self, dht: hivemind.DHT, helpers: list[str], client_mode: bool, auto_relay: bool
    ) -> Reachability:
        """Asks the helpers in turn to dial this peer back; the first answer decides."""
        if client_mode:
            return Reachability("unreachable", "not reachable: --client_mode accepts no connections")
        own = visible_maddrs(dht)
        direct = [m for m in own if tcp_endpoint(m) is not None]
        me = str(dht.peer_id)
        answered = None
        for helper in [h for h in helpers if h != me]:
            try:
                answered = self._handler.call(
                    self._ask(PeerID.from_base58(helper), direct),
                    DIAL_TIMEOUT_SECONDS * MAX_DIAL_ADDRESSES + 5,
                )
                break
            except Exception as e:
                logger.info(f"dial-back check by {helper} failed: {type(e).__name__}: {e}")
        if answered:
            return Reachability("direct", f"reachable directly at {answered[0]}")
        deadline = time.monotonic() + (RELAY_WAIT_SECONDS if auto_relay else 0.0)
        while True:
            relays = [r for m in visible_maddrs(dht) if (r := relay_of(m))]
            if relays:
                return Reachability("relay", f"reachable through relay {relays[0]}")
            if time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        if answered is None:
            return Reachability(
                "unknown", "reachability unknown: no initial peer answered the dial-back check"
            )
        ports = ", ".join(sorted({str(e[1]) for m in direct if (e := tcp_endpoint(m))})) or "(--host_maddrs)"
        return Reachability(
            "unreachable",
            f"not reachable: open TCP port {ports} to this machine "
            "(and give your public address in --announce_maddrs) or use a relay (--use_auto_relay)",
        )

    def shutdown(self) -> None:
        self._handler.shutdown()


def helpers_from(initial_peers: list[str]) -> list[str]:
    """Peer ids named in --initial_peers, in order, without repeats."""
    out: list[str] = []
    for maddr in initial_peers:
        parts = maddr.split("/")
        if "p2p" in parts and parts.index("p2p") + 1 < len(parts):
            pid = parts[parts.index("p2p") + 1]
            if pid not in out:
                out.append(pid)
    return out
