"""A module's state between holders: served, downloaded within caps, and confirmed by other holders.

A joiner (or a holder repairing a copy that drifted) downloads a module's global copy and outer
momentum — whole from one holder, or in ranges from several (`state_fetch`), each range naming the
state it belongs to — computes the state's digest itself, and asks the holders whether
their copy was that state at those fragment rounds: every holder remembers the digests of its last
`HISTORY_STATES` states. A state no other holder confirms is refused — whatever the donor claimed
about its rounds — so a poisoned donor cannot plant a copy, and a donor that sends slowly or too
much is cut off at a deadline and at the exact size the receiver's own model implies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

from dht.serve_limits import ServeLimits
from peer.sync import wire
from peer.sync.module_sync import state_digest
from peer.sync.service import SyncService
from peer.sync.wire import Ack, Kind

logger = logging.getLogger(__name__)

#: states of each module whose digests a holder remembers, to confirm them for others
HISTORY_STATES = 64

Snapshot = tuple[list[int], list[torch.Tensor]]  # fragment rounds; θ̄ per fragment then momentum


class StateHistory:
    """The (fragment rounds, fragment digests) of a module's recent states."""

    def __init__(self) -> None:
        self._states: dict[str, deque[tuple[tuple[int, ...], tuple[str, ...]]]] = {}

    def record(self, module: str, rounds: list[int], digests: list[str]) -> None:
        entries = self._states.setdefault(module, deque(maxlen=HISTORY_STATES))
        entry = (tuple(rounds), tuple(digests))
        if not entries or entries[-1] != entry:
            entries.append(entry)

    def lookup(self, module: str, rounds: list[int]) -> tuple[str, ...] | None:
        for r, d in reversed(self._states.get(module, ())):
            if r == tuple(rounds):
                return d
        return None


def digests_of(tensors: list[torch.Tensor]) -> list[str]:
    n = len(tensors) // 2
    return [state_digest(tensors[f], tensors[n + f]) for f in range(n)]


def tensor_frames(tensors: list[torch.Tensor]) -> list[bytes]:
    """One PAYLOAD frame per tensor, as little-endian float32."""
    return [
        wire.pack(Kind.PAYLOAD, t.detach().to(torch.float32).contiguous().numpy().tobytes()) for t in tensors
    ]


async def read_tensors(service: SyncService, reader, peer: str, numels: list[int]) -> list[torch.Tensor]:
    """Float32 tensors of exactly `numels` numbers from PAYLOAD frames, each capped before it is read."""
    tensors = []
    for n in numels:
        _, data = await wire.read_frame(reader, {Kind.PAYLOAD}, 4 * n)
        if len(data) != 4 * n:
            raise wire.WireError(f"{peer} sent {len(data)} bytes for {n} numbers")
        service.bytes_received += len(data) + 5
        tensors.append(torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32)))
    return tensors


def range_frames(tensors: list[torch.Tensor], start: int, stop: int):
    """PAYLOAD frames of the numbers [start, stop) of `tensors` laid end to end, as little-endian float32,
    at most `STATE_CHUNK_NUMBERS` per frame; made one at a time, so a big state is never copied whole."""
    offset = 0
    for t in tensors:
        flat = t.detach().reshape(-1)
        lo, hi = max(start, offset), min(stop, offset + flat.numel())
        for a in range(lo, hi, wire.STATE_CHUNK_NUMBERS):
            b = min(hi, a + wire.STATE_CHUNK_NUMBERS)
            piece = flat[a - offset : b - offset].to(torch.float32).contiguous().numpy()
            yield wire.pack(Kind.PAYLOAD, piece.astype("<f4", copy=False).tobytes())
        offset += flat.numel()


#: seconds a state served to a joiner stays available after the holder's own copy moved on, so that
#: the parts it still takes from us belong to the same state as those it took already
PIN_SECONDS = 120.0


async def _send_state(
    service: SyncService, writer, request: wire.StateRequest, rounds, tensors, stop: int
) -> None:
    """A state header, then numbers [start, stop) of the state's tensors as frames."""
    header = wire.StateHeader(
        run=service.run,
        module=request.module,
        fragment_rounds=rounds,
        numels=[t.numel() for t in tensors],
        start=request.start,
        stop=stop,
    )
    await wire.write(writer, wire.pack_header(Kind.STATE_HEADER, header))
    for frame in range_frames(tensors, request.start, stop):
        service.bytes_sent += len(frame)
        await wire.write(writer, frame)


def install_state_handlers(
    service: SyncService,
    snapshot: Callable[[str], Snapshot | None],
    history: StateHistory,
    limits: ServeLimits | None = None,
) -> None:
    """Lets other peers download our modules' states (whole, or a range of one) and confirm state
    digests against our history; `limits` bounds what they can make us upload (the defaults if None)."""
    limits = limits if limits is not None else ServeLimits()
    # module -> (rounds, tensors, expiry): the last state served; the tensors are never written into
    # (a round replaces them), so holding the references holds that state at no copy
    pinned: dict[str, tuple[list[int], list[torch.Tensor], float]] = {}

    def unpin(module: str) -> None:
        got = pinned.get(module)
        if got is not None and got[2] <= time.monotonic():
            del pinned[module]

    def state_for(request: wire.StateRequest) -> Snapshot | str:
        module, wanted = request.module, request.fragment_rounds
        got = snapshot(module)
        if got is None:
            return "not held"
        total = sum(t.numel() for t in got[1])
        whole = request.start == 0 and (request.stop is None or request.stop >= total)
        if wanted is None or got[0] == wanted:
            chosen = got
        elif module in pinned and pinned[module][0] == wanted:
            chosen = pinned[module][:2]
        else:
            return "moved on"
        if not whole:  # a whole state goes in one stream from one snapshot: nothing to hold for it
            pinned[module] = (list(chosen[0]), list(chosen[1]), time.monotonic() + PIN_SECONDS)
            asyncio.get_running_loop().call_later(PIN_SECONDS + 1, unpin, module)
        return chosen

    async def on_state_request(sender: str, body: bytes, reader, writer) -> None:
        request = wire.parse(wire.StateRequest, body)
        if request.run != service.run:
            got: Snapshot | str = "other run"
        elif not service.inbox.standing.takes_part(sender):
            got = "not admitted to this invite-only run"
        else:
            got = state_for(request)
        if isinstance(got, str):
            await wire.write(writer, wire.pack_header(Kind.ACK, Ack(ok=False, reason=got)))
            return
        rounds, tensors = got
        total = sum(t.numel() for t in tensors)
        stop = total if request.stop is None else min(request.stop, total)
        if request.start > stop:
            await wire.write(writer, wire.pack_header(Kind.ACK, Ack(ok=False, reason="bad range")))
            return
        standing = service.inbox.standing.admitted(sender)
        busy = limits.acquire(sender, 4 * (stop - request.start), standing)
        if busy is not None:
            await wire.write(writer, wire.pack_header(Kind.ACK, Ack(ok=False, reason=busy)))
            return
        try:
            await _send_state(service, writer, request, rounds, tensors, stop)
        finally:
            limits.release(sender, standing)

    async def on_confirm(sender: str, body: bytes, reader, writer) -> None:
        query = wire.parse(wire.Confirm, body)
        allowed = query.run == service.run and service.inbox.standing.takes_part(sender)
        known = history.lookup(query.module, query.fragment_rounds) if allowed else None
        current = snapshot(query.module) if allowed and known is None else None
        if known is None:
            # past those rounds without having held that state (it jumped over them, or forgot): it
            # will never know it, and the asker need not ask again
            past = (
                current is not None
                and len(current[0]) == len(query.fragment_rounds)
                and all(c >= q for c, q in zip(current[0], query.fragment_rounds, strict=True))
            )
            ack = Ack(ok=False, reason=PAST if past else "unknown")
        else:
            ack = Ack(
                ok=list(known) == query.digests, reason="" if list(known) == query.digests else "different"
            )
        await wire.write(writer, wire.pack_header(Kind.ACK, ack))

    service.extra_handlers[Kind.STATE_REQUEST] = on_state_request
    service.extra_handlers[Kind.CONFIRM] = on_confirm


#: the slowest donor a download waits for, bytes per second (2 Mbit/s): a state's deadline grows with
#: its size at this rate, so a big path is not cut off on a slow link and a stalled donor still is
MIN_DOWNLOAD_BYTES_PER_SECOND = 250_000


def download_deadline(timeout: float, numbers: int) -> float:
    return timeout + 4 * numbers / MIN_DOWNLOAD_BYTES_PER_SECOND


async def download_range(
    service: SyncService,
    peer: str,
    module: str,
    numels: list[int],
    start: int,
    stop: int,
    timeout: float,
    rounds: list[int] | None = None,
) -> tuple[list[int], np.ndarray]:
    """The numbers [start, stop) of a module's state from `peer` (of the state at `rounds`, if given),
    read within the sizes `numels` our own model implies: (the state's fragment rounds, float32s)."""

    async def go() -> tuple[list[int], np.ndarray]:
        request = wire.StateRequest(
            run=service.run, module=module, start=start, stop=stop, fragment_rounds=rounds
        )
        reader, writer = await service.open(peer, [wire.pack_header(Kind.STATE_REQUEST, request)], timeout)
        try:
            kind, body = await wire.read_frame(reader, {Kind.STATE_HEADER, Kind.ACK}, wire.MAX_HEADER_BYTES)
            if kind == Kind.ACK:
                raise wire.WireError(f"{peer} refused: {wire.parse(Ack, body).reason}")
            header = wire.parse(wire.StateHeader, body)
            if (
                header.module != module
                or header.numels != numels
                or len(header.fragment_rounds) * 2 != len(numels)
                or (header.start, header.stop) != (start, stop)
                or (rounds is not None and header.fragment_rounds != rounds)
            ):
                raise wire.WireError(f"{peer} offered another state or range ({header.numels[:4]}...)")
            out = np.empty(stop - start, dtype=np.float32)
            at = 0
            while at < len(out):
                cap = 4 * min(wire.STATE_CHUNK_NUMBERS, len(out) - at)
                _, data = await wire.read_frame(reader, {Kind.PAYLOAD}, cap)
                if len(data) % 4 or not data:
                    raise wire.WireError(f"{peer} sent a frame of {len(data)} bytes")
                service.bytes_received += len(data) + 5
                out[at : at + len(data) // 4] = np.frombuffer(data, dtype="<f4")
                at += len(data) // 4
            return list(header.fragment_rounds), out
        finally:
            writer.close()

    return await asyncio.wait_for(go(), download_deadline(timeout, stop - start))


def split_state(numbers: np.ndarray, numels: list[int]) -> list[torch.Tensor]:
    """The state's tensors, each with storage of its own (a checkpoint cannot hold views of one buffer)."""
    bounds = np.cumsum([0, *numels])
    return [torch.from_numpy(numbers[a:b].copy()) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


#: a confirmer's answer: it is past those rounds and never held that state (it cannot say, ever)
PAST = "unknown, past those rounds"


async def confirm_state(
    service: SyncService, peer: str, module: str, rounds: list[int], digests: list[str], timeout: float
) -> bool | str | None:
    """True if `peer` had this state, False if it had another at these rounds, None if it cannot say
    yet (it is behind them), "never" if it will never say (past them without that state, or gone)."""
    query = wire.Confirm(run=service.run, module=module, fragment_rounds=rounds, digests=digests)
    try:
        ack = await service.request(peer, [wire.pack_header(Kind.CONFIRM, query)], timeout)
    except Exception as e:  # gone, or too busy to answer within the timeout: not within this download
        logger.debug(f"confirmation from {peer} failed: {type(e).__name__}: {e}")
        return "never"
    if ack.ok:
        return True
    if ack.reason == "different":
        return False
    return "never" if ack.reason == PAST else None


#: times a download waits for other holders to reach the state it is asked to confirm
CONFIRM_ATTEMPTS = 4


async def confirmed(
    service: SyncService,
    module: str,
    rounds: list[int],
    digests: list[str],
    confirmers: list[str],
    timeout: float,
) -> bool:
    """True once at least one confirmer says "this was my state" and more say so than say "my state
    at those rounds differs" ("unknown" counts neither way; a tie is not a yes); holders a little
    behind are asked again a few times, and only they: once none of the confirmers could still come
    to know the state (each is past those rounds without it, or gone), the answer is no at once."""
    for attempt in range(CONFIRM_ATTEMPTS):
        answers = await asyncio.gather(
            *(confirm_state(service, c, module, rounds, digests, timeout) for c in confirmers)
        )
        yes, no = answers.count(True), answers.count(False)
        if yes >= 1 and yes > no:
            return True
        if no > yes or None not in answers:
            return False
        await asyncio.sleep(0.5 * (attempt + 1))
    return False
