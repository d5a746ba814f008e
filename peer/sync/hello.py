"""A mover's HELLO: "I hold these modules now; read my claim". The other holders of a path's modules
count a peer in their rounds once their claim view shows it ready there, and that view is renewed
every heartbeat; a peer that rotated would otherwise sit idle for two heartbeats before its first
sync (and its old groups' rounds wait for it meanwhile). After publishing its new claim it says HELLO
to the holders of its new path's modules and trains on (`Greeting`: its first sync there waits for
the answers); each reads the claims again from the DHT at once (the message is only a hint: the
claim it counts is the signed one in the DHT, never the message) and answers whether it now sees
the sender holding every module named.

What a stranger can make us do with HELLOs is bounded: one claim read per `min_interval_seconds`
however many arrive (`ClaimRefresh`), and HELLOs that arrive during a read share it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from dht.background_loop import wait_until
from peer.sync import wire
from peer.sync.inbox import Refused
from peer.sync.service import SyncService
from peer.sync.wire import Ack, Kind

logger = logging.getLogger(__name__)

#: the least time between two claim reads that HELLOs cause (a heartbeat's reads are not counted)
HELLO_READ_INTERVAL_SECONDS = 1.0
#: HELLOs waiting for a read at once; more are answered "busy" at once (the sender's heartbeat wait)
MAX_WAITING_HELLOS = 64


class ClaimRefresh:
    """Reads the claim view again for HELLOs, at most once per `min_interval_seconds` (on the sync
    service's loop: waiting HELLOs hold no thread)."""

    def __init__(self, read: Callable[[], object], min_interval_seconds: float = HELLO_READ_INTERVAL_SECONDS):
        """`read`: reads the run's claims from the DHT into the peer's claim view (blocking)."""
        self._read = read
        self.min_interval = min_interval_seconds
        self._lock: asyncio.Lock | None = None  # made on the loop that uses it
        self._started = -float("inf")  # when the last read began (monotonic)
        self.waiting = 0
        #: reads done for HELLOs (what a flood of them cost us)
        self.reads = 0

    async def after(self, since: float) -> None:
        """Returns once a read that began at or after `since` (monotonic) has finished."""
        self._lock = self._lock or asyncio.Lock()
        self.waiting += 1
        try:
            async with self._lock:
                if self._started >= since:  # began after the HELLO came: it saw the claim
                    return
                await asyncio.sleep(max(0.0, self._started + self.min_interval - time.monotonic()))
                self._started = time.monotonic()
                self.reads += 1
                await asyncio.get_running_loop().run_in_executor(None, self._read)
        finally:
            self.waiting -= 1


def install_hello_handler(service: SyncService, refresh: ClaimRefresh) -> None:
    """Answers HELLOs: reads the claims again, then ACKs whether the sender holds every module named."""

    async def on_hello(sender: str, body: bytes, reader, writer) -> None:
        came = time.monotonic()
        hello = wire.parse(wire.Hello, body)
        if hello.run != service.run:
            raise Refused("run", f"run {hello.run}, ours is {service.run}")
        modules = [m for m in hello.modules if m in service.inbox.fragment_sizes]
        if not modules:
            raise Refused("not_held", "we hold none of these modules")
        if refresh.waiting >= MAX_WAITING_HELLOS:
            ack = Ack(ok=False, reason="busy")
        else:
            await refresh.after(came)
            unseen = [m for m in modules if not service.inbox.is_holder(sender, m)]
            ack = Ack(ok=not unseen, reason=f"no claim of yours on {', '.join(unseen)}" if unseen else "")
            if not unseen:
                service.inbox.note_hello(sender, modules)
        await wire.write(writer, wire.pack_header(Kind.ACK, ack))

    service.extra_handlers[Kind.HELLO] = on_hello


class Greeting:
    """HELLOs on their way: sent from the sync service's loop as the mover goes on training, answered
    before its first sync on the modules it moved to (`wait`). Waiting for the answers before training
    cost a move 0.1-0.4 s (the holders' claim reads, one a second at most each): a tenth of the
    rotating peers' time outside inner steps in the goodput benchmark."""

    def __init__(
        self,
        service: SyncService,
        modules: list[str],
        peers: list[str],
        settle_until: float,
        stop: threading.Event,
    ):
        """Says HELLO to `peers` (holders of some of `modules`) now; `settle_until` (monotonic): when
        every holder's view shows our claim anyway (two of their heartbeats after our move)."""
        frames = [wire.pack_header(Kind.HELLO, wire.Hello(run=service.run, modules=modules))]
        timeout = max(0.0, settle_until - time.monotonic())
        self._answers = service.submit(service.ask_each(peers, frames, timeout))
        self.peers, self.settle_until, self._stop = set(peers), settle_until, stop
        self._seen: list[str] | None = None  # once `wait` returned

    def wait(self) -> list[str]:
        """Blocks until every peer saw our claim or, if one did not, until `settle_until` or a stop
        request; returns those that saw it (at once after the first time)."""
        if self._seen is not None:
            return self._seen
        # the answers' own timeout and a margin, cut short by a stop request
        wait_until(self._answers, max(self.settle_until, time.monotonic()) + 2.0, self._stop)
        try:
            acks = self._answers.result(timeout=0)
        except Exception as e:  # the loop is gone, the answers are late or we leave: views get time
            logger.debug(f"no answers to our HELLOs: {type(e).__name__}: {e}")
            acks = {}
        for peer, ack in acks.items():
            if ack is not None and not ack.ok:
                logger.debug(f"{peer} does not see our new claim yet: {ack.reason}")
        seen = [peer for peer, ack in acks.items() if ack is not None and ack.ok]
        if set(seen) != self.peers:
            self._stop.wait(max(0.0, self.settle_until - time.monotonic()))
        self._seen = seen
        return seen
