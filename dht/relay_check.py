"""Can this node relay a module's state for peers behind NAT? A self-test a bootstrap node runs at start.

Peers behind NAT (`--use_auto_relay`) reserve a slot on their initial peers and are reached through
them (libp2p circuit relay v2). hivemind 1.1.12's p2pd runs two relay handlers for the same protocol:
one it installs at start with go-libp2p's default limits (128 KiB and 2 minutes per relayed
connection, too little for one module's state), and its configured service (4 GiB, 30 minutes),
started when the node is known to be public. Which handler ends up serving is a race inside p2pd:
the configured one won 5 starts in 26 here (`python -m dht.relay_check --force_public --starts 10`);
without a forced public reachability it never does within a probe's time.

A p2pd on one Go thread (`GOMAXPROCS=1`) installs the configured handler last, so it wins: 40 starts
in 40 here (`... --one_thread`), 10 of them with both cores busy. A bootstrap node runs its daemon so
(`prefer_configured_relay`) and still checks its relay before it tells anyone its address: a helper
daemon with no listening address reserves a slot on it, a second helper dials the first through it
and fetches `PROBE_BYTES`, more than the default limit; the node restarts its daemon until the
configured handler serves (`start_relaying_dht`), and warns if it never does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import hivemind
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.multiaddr import Multiaddr

from dht.background_loop import BackgroundLoop
from dht.node import visible_maddrs  # also installs the static-relay p2pd flag

logger = logging.getLogger(__name__)

HANDLER = "pathswarm_relay_probe"
#: four times go-libp2p's default relay data limit (128 KiB per connection and direction)
PROBE_BYTES = 512 * 1024
RESERVATION_WAIT_SECONDS = 15.0
#: each start passes with odds of about 1/2 here (see the docstring), so 8 fail together ~0.4% of the time
MAX_STARTS = 8
#: runs of the probe before its verdict is "unchecked" (its helper daemons did not start: on a loaded
#: machine they can miss their bootstrap twice in a row), a second apart
PROBE_TRIES = 3


async def _serve(request: runtime_pb2.Tensor, context: P2PContext) -> runtime_pb2.Tensor:
    size = min(int(request.buffer.decode() or 0), PROBE_BYTES)
    return runtime_pb2.Tensor(buffer=b"\0" * size)


async def _fetch(client: P2P, target: P2P, size: int, timeout: float) -> int:
    request = runtime_pb2.Tensor(buffer=str(size).encode())
    call = client.call_protobuf_handler(target.peer_id, HANDLER, request, runtime_pb2.Tensor)
    return len((await asyncio.wait_for(call, timeout)).buffer)


class _CircuitAddress:
    """`/<relay transport>/p2p/<relay>/p2p-circuit` in the binary form p2pd parses.

    hivemind's multiaddr library writes a `/p2p/` component as CID bytes, which p2pd's decoder
    rejects ("length greater than remaining number of bytes"); go-multiaddr wants the multihash.
    """

    P2P_CODE, CIRCUIT_CODE = b"\xa5\x03", b"\xa2\x02"  # varints of 421 and 290

    def __init__(self, relay: str):
        transport, _, relay_id = relay.partition("/p2p/")
        multihash = PeerID.from_base58(relay_id).to_bytes()
        assert len(multihash) < 128  # one-byte varint length
        self._raw = Multiaddr(transport).to_bytes() + self.P2P_CODE + bytes([len(multihash)]) + multihash
        self._raw += self.CIRCUIT_CODE

    def to_bytes(self) -> bytes:
        return self._raw


async def _probe(relay: str) -> str:
    """ "relays" | "limited" (a small reply passes, a big one is cut) | "no relay" (nothing passes)."""
    # DHT clients: neither helper learns of the other through the DHT and dials it directly
    common = dict(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        nat_port_map=False,
        auto_nat=False,
        idle_timeout=60,
        dht_mode="client",
    )
    # behind: listens nowhere, so the only way to it is through the relay
    behind = await P2P.create(
        initial_peers=[relay],
        use_auto_relay=True,
        force_reachability="private",
        trusted_relays=[relay],
        **{**common, "host_maddrs": None},
        no_listen=True,
    )
    dialer = await P2P.create(initial_peers=[relay], **common)
    try:
        await behind.add_protobuf_handler(HANDLER, _serve, runtime_pb2.Tensor)
        circuit = _CircuitAddress(relay)
        deadline = time.monotonic() + RESERVATION_WAIT_SECONDS
        while True:  # the reservation takes a moment after start
            try:
                await dialer._client.connect(behind.peer_id, [circuit])
                if await _fetch(dialer, behind, 1024, 5.0) == 1024:
                    break
            except Exception as e:
                if time.monotonic() > deadline:
                    logger.debug(f"relay probe: {type(e).__name__}: {e}")
                    return "no relay"
                await asyncio.sleep(0.5)
        try:
            return "relays" if await _fetch(dialer, behind, PROBE_BYTES, 20.0) == PROBE_BYTES else "limited"
        except Exception as e:
            logger.debug(f"relay probe: {type(e).__name__}: {e}")
            return "limited"
    finally:
        for p2p in (dialer, behind):
            await p2p.shutdown()


def prefer_configured_relay() -> None:
    """p2pd daemons started from now on in this process run on one Go thread (unless the user
    chose GOMAXPROCS), which makes its configured relay service win the race above."""
    if not os.environ.get("GOMAXPROCS"):
        os.environ["GOMAXPROCS"] = "1"


def check_relay(dht: hivemind.DHT, tries: int = PROBE_TRIES) -> str:
    """Runs the probe through `dht`'s node; see `_probe` for the answers, and "unchecked (why)" when
    the probe itself could not run (its helper daemons did not start: a loaded machine), `tries`
    times: a failed self-test must not stop the node it tests."""
    own = [m for m in visible_maddrs(dht) if "p2p-circuit" not in m]
    # the helpers run on this machine: prefer loopback, then any address this node listens on
    own.sort(key=lambda m: not m.startswith("/ip4/127."))
    loop = BackgroundLoop("relay-probe")
    try:
        for attempt in range(1, tries + 1):
            try:
                return loop.call(_probe(own[0]), RESERVATION_WAIT_SECONDS + 60)
            except Exception as e:
                text = str(e).strip()
                why = f"{type(e).__name__}: {text.splitlines()[-1][:200]}" if text else type(e).__name__
                logger.debug(f"relay probe {attempt}/{tries} could not run: {why}")
                time.sleep(1.0)
        return f"unchecked ({why})"
    finally:
        loop.stop()


def start_relaying_dht(start: Callable[[], tuple], attempts: int = MAX_STARTS) -> tuple:
    """`start()` (a DHT start returning (dht, ...)) until the node relays module-sized transfers.

    Keeps the last start when no attempt passes, with a warning that says what it costs."""
    for attempt in range(1, attempts + 1):
        started = start()
        verdict = check_relay(started[0])
        if verdict == "relays":
            logger.info(f"relay for peers behind NAT: up (checked with {PROBE_BYTES // 1024} KiB)")
            return started
        if verdict == "no relay" or verdict.startswith("unchecked") or attempt == attempts:
            logger.warning(
                f"relay for peers behind NAT: {verdict} after {attempt} start(s); peers with "
                "--use_auto_relay that rely on this node may fail to download or average modules"
            )
            return started
        logger.info("relay started with go-libp2p's default limits (128 KiB per connection); restarting it")
        started[0].shutdown()
    raise AssertionError("unreachable")


def main() -> None:
    """Starts a bare node `n` times and prints how often its relay passed: the race's odds here."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=6)
    parser.add_argument("--force_public", action="store_true")
    parser.add_argument("--one_thread", action="store_true", help="as a bootstrap node runs p2pd")
    args = parser.parse_args()
    if args.one_thread:
        prefer_configured_relay()
    verdicts = []
    for _ in range(args.starts):
        kwargs = {"force_reachability": "public"} if args.force_public else {}
        dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, nat_port_map=False, **kwargs)
        try:
            verdicts.append(check_relay(dht))
        finally:
            dht.shutdown()
        print(verdicts[-1], flush=True)
    print({v: verdicts.count(v) for v in set(verdicts)})


if __name__ == "__main__":
    main()
