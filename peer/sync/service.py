"""One peer's end of the sync protocol: a P2P stream handler and an event loop of its own.

`SyncService` runs an asyncio loop in a background thread of the peer's main process, on a replica
of the DHT's P2P daemon connection (no averager processes, no DHT matchmaking). Incoming streams
carry one request each (`peer.sync.wire`): an outer gradient for a round (into the `Inbox`), a
member's signed report of a round, the reports another member relays (an echo), a request for a
part the group agreed on or for our own report of a round, a request for a module's state, or a
confirmation query about a state digest (`peer.sync.state_transfer`). Every stream has a deadline,
so a peer that opens a stream and sends nothing (slow loris) only holds it for
`stream_timeout_seconds`. The rounds themselves are run by `peer.sync.rounds`, on this loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey

from dht.background_loop import BackgroundLoop
from peer.faults import fault_point
from peer.sync import wire
from peer.sync.inbox import Delivery, Inbox, Refused, delivery_digest
from peer.sync.refusal_log import RefusalLog
from peer.sync.reports import missing_reports, report_digest
from peer.sync.wire import Ack, Kind

logger = logging.getLogger(__name__)


class SyncService:
    """The P2P side of a peer's sync layer: receives what other holders send, sends ours."""

    def __init__(
        self,
        dht: hivemind.DHT,
        run_id: str,
        inbox: Inbox,
        stream_timeout_seconds: float = 60.0,
        handlers: dict[Kind, Callable] | None = None,
        key: RSAPrivateKey | None = None,
        starting: bool = False,
    ):
        """`key`: this peer's identity key (its peer id's), which signs its reports; `starting`: the
        peer is not training yet (`training`)."""
        self.run = run_id[:16]
        self.inbox = inbox
        self.key = key
        self.stream_timeout = stream_timeout_seconds
        self.extra_handlers = dict(handlers or {})
        #: refused messages by reason; read by the peer's metrics
        self.refused: Counter[str] = Counter()
        #: what is said of them: once a minute per reason (a stranger's requests cannot fill the log)
        self.refusal_log = RefusalLog()
        self.bytes_sent = 0
        self.bytes_received = 0
        self._closing = False  # set on shutdown: streams still arriving are closed unread
        #: set when the peer is told to leave (SIGTERM): nothing waits on a round's result any more
        self.leaving = threading.Event()
        #: unset while the peer starts (its state, its data) and set from its first inner step on:
        #: until then it answers the others' probes that it is starting, and their rounds leave it out
        #: at once (peer/sync/probe.py) instead of waiting the straggler bound (5 s or more) for a part
        #: it cannot send yet: a restarted peer's host answers seconds before its first step
        self.training = threading.Event()
        if not starting:
            self.training.set()
        #: rounds whose members asked us while we were starting, once their parts had come: they left
        #: us out of it (`left_out_starting`), so we do not join it at our first step (its members would
        #: decide on different sets: a churn run split a trunk round so) but sit it out
        self.left_out: set[tuple[str, int, int]] = set()
        #: per fragment, our round then and the holders that sent a part of an earlier one meanwhile:
        #: behind us, they take our state, and a sit-out of that round need not wait for them
        self.behind: dict[tuple[str, int], tuple[int, set[str]]] = {}
        self._background = BackgroundLoop("sync")
        self.loop = self._background.loop
        self.p2p = self.call(self._start(dht), timeout=30)
        self.peer_id = self.p2p.peer_id.to_base58()

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Runs a coroutine on the service's loop and waits for it (from another thread)."""
        return self._background.call(coro, timeout)

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return self._background.submit(coro)

    async def _start(self, dht: hivemind.DHT):
        p2p = await dht.replicate_p2p()
        await p2p.add_binary_stream_handler(wire.PROTOCOL, self._handle)
        return p2p

    def shutdown(self) -> None:
        async def cleanup():
            # the handler stays registered until the daemon's connection closes: a holder's stream
            # arriving after it was removed would make hivemind log an ERROR (DispatchFailure) in
            # every peer that leaves while others still sync; it is refused quietly instead
            self._closing = True
            await self.p2p.shutdown()

        self._background.stop(cleanup)

    # --- incoming ---------------------------------------------------------------------------------

    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = stream_info.peer_id.to_base58()  # authenticated by libp2p: the sender's own key
        if self._closing:
            writer.close()
            return
        try:
            await asyncio.wait_for(self._dispatch(sender, reader, writer), self.stream_timeout)
        except (wire.WireError, asyncio.IncompleteReadError, ConnectionError, TimeoutError) as e:
            self.refused["protocol"] += 1
            logger.debug(f"sync stream from {sender} dropped: {type(e).__name__}: {e}")
        finally:
            writer.close()

    async def _dispatch(self, sender: str, reader, writer) -> None:
        kinds = {
            Kind.DELTA, Kind.REPORT, Kind.ECHO, Kind.PART_REQUEST, Kind.REPORT_REQUEST, Kind.STANDING,
            Kind.BYE, Kind.SIT_OUT, *self.extra_handlers,
        }  # fmt: skip
        kind, body = await wire.read_frame(reader, kinds, wire.MAX_HEADER_BYTES)
        self.bytes_received += len(body) + 5
        try:
            if kind == Kind.DELTA:
                await self._on_delta(sender, wire.parse(wire.DeltaHeader, body), reader, writer)
            elif kind == Kind.REPORT:
                report = wire.parse(wire.Report, body)
                self._check_run(report.run)
                self.inbox.add_report(sender, report)
            elif kind == Kind.ECHO:
                await self._on_echo(sender, wire.parse(wire.Echo, body), reader, writer)
            elif kind == Kind.PART_REQUEST:
                await self._on_part_request(sender, wire.parse(wire.PartRequest, body), writer)
                return
            elif kind == Kind.REPORT_REQUEST:
                await self._on_report_request(sender, wire.parse(wire.ReportRequest, body), writer)
                return
            elif kind == Kind.BYE:
                bye = wire.parse(wire.Bye, body)
                self._check_run(bye.run)
                fault_point("sync.on_bye")  # a holder slow to answer (tests: a move does not wait for it)
                self.inbox.note_bye(sender, bye.modules)
            elif kind == Kind.SIT_OUT:
                sit = wire.parse(wire.SitOut, body)
                self._check_run(sit.run)
                k = sit.key
                if k.module in self.inbox.fragment_sizes and k.round < self.inbox.current.get(
                    (k.module, k.fragment), 0
                ):
                    # we applied it: the sitter takes our state now, not once our next part comes (which
                    # may wait on a round the sitter holds up: two restarted holders stalled so 10 s)
                    await self._ack(writer, Ack(ok=False, reason=wire.PAST_ROUND))
                    return
                self.inbox.note_sat_out(sender, self.inbox.check_key(sender, *k.as_tuple()))
            elif kind == Kind.STANDING:
                query = wire.parse(wire.StandingQuery, body)
                self._check_run(query.run)
                count = self.inbox.accepted.get(query.module, {}).get(query.peer, 0)
                ok = self.training.is_set()
                if not ok:
                    self.left_out_starting(sender, query.module)
                await self._ack(writer, Ack(ok=ok, reason=str(count) if ok else wire.STARTING))
                return
            else:
                await self.extra_handlers[kind](sender, body, reader, writer)
                return
        except Refused as e:
            self.refused[e.reason] += 1
            self.inbox.strike(sender, e.reason)
            if e.reason not in ("stale", "ahead", "banned"):
                self.refusal_log.refused(e.reason, kind.name.lower(), sender, e)
            await self._ack(writer, Ack(ok=False, reason=str(e)[:256]))
            return
        await self._ack(writer, Ack(ok=True))

    def left_out_starting(self, asker: str, module: str) -> None:
        """We answer `asker` that we are starting: its round of `module` leaves us out at once, and
        that round is one whose part of `asker`'s we hold (it sends its part, then asks those silent).
        At most two rounds a fragment: bounded by the modules we hold."""
        for f in range(len(self.inbox.fragment_sizes.get(module, []))):
            current = self.inbox.current.get((module, f), 0)
            for key in ((module, f, current), (module, f, current + 1)):
                if asker in self.inbox.senders(key):
                    self.left_out.add(key)

    def _check_run(self, run: str) -> None:
        if run != self.run:
            raise Refused("run", f"run {run}, ours is {self.run}")

    async def _on_echo(self, sender: str, echo: wire.Echo, reader, writer) -> None:
        """Takes in the reports `sender` holds for a round: asks for those named that we lack."""
        self._check_run(echo.run)
        key = self.inbox.check_key(sender, *echo.key.as_tuple())
        slot = self.inbox.slot(key)
        room = self.inbox.max_senders - len(slot.reports.reports)  # `_take_report` refuses beyond
        wanted = missing_reports(slot.reports, echo.held, lambda r: self.inbox.is_holder(r, key[0]), room)
        reports = []
        if wanted:
            frame = wire.pack_header(Kind.NEED, wire.Need(indices=wanted))
            self.bytes_sent += len(frame)
            await wire.write(writer, frame)
            for i in wanted:  # each frame capped before it is read
                _, body = await wire.read_frame(reader, {Kind.REPORT}, wire.MAX_HEADER_BYTES)
                self.bytes_received += len(body) + 5
                report = wire.parse(wire.Report, body)
                if (report.reporter, report_digest(report)) == echo.held[i]:  # else not what it named
                    reports.append(report)
        self.inbox.add_echo(sender, key, reports)

    async def _on_part_request(self, sender: str, request: wire.PartRequest, writer) -> None:
        """Sends a member the part of a round it missed, as its sender sent it to us."""
        self._check_run(request.run)
        key = request.key.as_tuple()
        self.inbox.check_asker(sender, key[0])
        got = self.inbox.part(key, request.sender, request.digest)
        if got is None:
            raise Refused("unknown", "no such part here")
        header = wire.DeltaHeader(
            run=self.run, key=request.key, weight=got.weight, codec=self.inbox.codec.spec.name,
            numel=got.delta.numel(), payload_bytes=len(got.payload), admission=got.admission,
        )  # fmt: skip
        frames = [wire.pack_header(Kind.ACK, Ack(ok=True)), wire.pack_header(Kind.DELTA, header)]
        frames.append(wire.pack(Kind.PAYLOAD, got.payload))
        self.bytes_sent += sum(len(f) for f in frames)
        await wire.write(writer, *frames)

    async def _on_report_request(self, sender: str, request: wire.ReportRequest, writer) -> None:
        """Sends a member our own signed report of a round (about a kilobyte), or says we have none
        yet: its copy of our push was lost, and without it it would count parts ours left out."""
        self._check_run(request.run)
        report = self.inbox.own_report(sender, request.key.as_tuple())
        if report is None:
            # starting (no round run in this life yet), we have none and never will: a report an
            # earlier life signed died with it, and a new life never signs a round it sent again
            await self._ack(writer, Ack(ok=False, reason="none" if self.training.is_set() else wire.STARTING))
            return
        frames = [wire.pack_header(Kind.ACK, Ack(ok=True)), wire.pack_header(Kind.REPORT, report)]
        self.bytes_sent += sum(len(f) for f in frames)
        await wire.write(writer, *frames)

    async def _on_delta(self, sender: str, header: wire.DeltaHeader, reader, writer) -> None:
        self._check_run(header.run)
        try:
            await self._take_delta(sender, header, reader, writer)
        except Refused as e:
            self.inbox.note_refused(sender, header, e.reason)
            if e.reason == "stale":
                self._note_behind(sender, header.key)
            raise

    def behind_of(self, key: tuple[str, int, int]) -> set[str]:
        """The holders that sent a part of an earlier round of the fragment while we were at `key`'s."""
        at, senders = self.behind.get(key[:2], (None, set()))
        return set(senders) if at == key[2] else set()

    def _note_behind(self, sender: str, key: wire.RoundKey) -> None:
        """`sender` (a holder: `check_key` refused strangers before "stale") sent a part of a round we
        are past (not one we decided without it): it is behind our current round of that fragment. At
        most `max_senders` holders a fragment."""
        fragment = (key.module, key.fragment)
        if key.round >= (current := self.inbox.current.get(fragment, 0)):
            return
        at, senders = self.behind.get(fragment, (current, set()))
        senders = senders if at == current else set()
        if len(senders) < self.inbox.max_senders:
            senders.add(sender)
        self.behind[fragment] = (current, senders)

    async def _take_delta(self, sender: str, header: wire.DeltaHeader, reader, writer) -> None:
        key = self.inbox.check_delta_header(sender, header)
        fault_point("sync.receive_delta")
        slot = self.inbox.slot(key)
        slot.incoming.add(sender)  # its part is on its way: the round waits for it past the pace
        try:
            await self._ack(writer, Ack(ok=True, reason="go"))  # only now may the payload come
            _, payload = await wire.read_frame(reader, {Kind.PAYLOAD}, header.payload_bytes)
            if len(payload) != header.payload_bytes:
                raise Refused("shape", f"payload of {len(payload)} bytes, header said {header.payload_bytes}")
            self.bytes_received += len(payload) + 5
            delta = await self.loop.run_in_executor(None, self.inbox.decode, header, payload)
            digest = delivery_digest(header.weight, header.admission, payload)
            delivery = Delivery(sender, header.weight, digest, delta, len(payload), header.admission, payload)
            self.inbox.add_delivery(key, delivery)
        finally:
            slot.incoming.discard(sender)
            slot.changed.set()

    async def _ack(self, writer, ack: Ack) -> None:
        frame = wire.pack_header(Kind.ACK, ack)
        self.bytes_sent += len(frame)
        try:
            await wire.write(writer, frame)
        except ConnectionError:
            pass

    # --- outgoing ---------------------------------------------------------------------------------

    async def request(
        self, peer: str, frames: list[bytes], timeout: float, tally: dict | None = None, key=None
    ) -> Ack:
        """Sends one request to `peer` and returns its final ACK; raises on any failure. A request of
        several frames is sent frame by frame, each only after the receiver said "go" to the one
        before: a refused header costs the sender no payload, and the receiver never closes a stream
        with data of ours still unread (which would reset it before our ACK arrives)."""

        async def go() -> Ack:
            _, reader, writer = await self.p2p.call_binary_stream_handler(
                PeerID.from_base58(peer), wire.PROTOCOL
            )
            try:
                for i, frame in enumerate(frames):
                    if i:
                        fault_point("sync.between_frames")
                    await wire.write(writer, frame)
                    self.bytes_sent += len(frame)
                    if tally is not None and key in tally:  # bytes of one round (peer.sync.rounds)
                        tally[key] += len(frame)
                    _, body = await wire.read_frame(reader, {Kind.ACK}, wire.MAX_HEADER_BYTES)
                    self.bytes_received += len(body) + 5
                    ack = wire.parse(Ack, body)
                    if not ack.ok or i == len(frames) - 1:
                        return ack
                raise wire.WireError("a request needs at least one frame")
            finally:
                writer.close()

        return await asyncio.wait_for(go(), timeout)

    async def ask_each(self, peers: list[str], frames: list[bytes], timeout: float) -> dict[str, Ack | None]:
        """Sends the same request to each of `peers` at once and waits, at most `timeout`, for their
        ACKs: None for a peer that could not be reached or did not answer in time (on the loop)."""

        async def one(peer: str) -> Ack | None:
            try:
                return await self.request(peer, frames, timeout)
            except Exception as e:
                logger.debug(f"request to {peer} failed: {type(e).__name__}: {e}")
                return None

        return dict(zip(peers, await asyncio.gather(*(one(p) for p in peers)), strict=True))

    def request_each(self, peers: list[str], frames: list[bytes], timeout: float) -> dict[str, Ack | None]:
        """`ask_each` from a thread other than the loop's (blocking)."""
        return self.call(self.ask_each(peers, frames, timeout), timeout + 2)

    async def echo(self, peer: str, echo: wire.Echo, held: list[wire.Report], timeout: float) -> int:
        """Names the reports we hold (`held`, in `echo.held`'s order) to `peer` and sends those it asks
        for; returns the bytes sent. Raises on any failure (unreachable, stalled, reset, malformed)."""

        async def go() -> int:
            header = wire.pack_header(Kind.ECHO, echo)
            reader, writer = await self.open(peer, [header], timeout)
            sent = len(header)
            try:
                kind, body = await wire.read_frame(reader, {Kind.ACK, Kind.NEED}, wire.MAX_HEADER_BYTES)
                self.bytes_received += len(body) + 5
                if kind == Kind.NEED:
                    need = wire.parse(wire.Need, body)
                    if need.indices[-1] >= len(held):
                        raise wire.WireError(f"asked for report {need.indices[-1]} of {len(held)}")
                    frames = [wire.pack_header(Kind.REPORT, held[i]) for i in need.indices]
                    await wire.write(writer, *frames)
                    self.bytes_sent += sum(len(f) for f in frames)
                    sent += sum(len(f) for f in frames)
                    _, body = await wire.read_frame(reader, {Kind.ACK}, wire.MAX_HEADER_BYTES)
                    self.bytes_received += len(body) + 5
                wire.parse(Ack, body)  # refused (a round over there) or taken: the same to the echoer
                return sent
            finally:
                writer.close()

        return await asyncio.wait_for(go(), timeout)

    async def open(self, peer: str, frames: list[bytes], timeout: float):
        """Opens a stream to `peer` and sends `frames`; the caller reads the answer and closes it."""
        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(PeerID.from_base58(peer), wire.PROTOCOL), timeout
        )
        await wire.write(writer, *frames)
        self.bytes_sent += sum(len(f) for f in frames)
        return reader, writer
