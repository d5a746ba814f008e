"""A module's state between holders: served, downloaded within caps, and confirmed by other holders.

A joiner (or a holder repairing a copy that drifted) downloads a module's global copy and outer
momentum from one holder, computes the state's digest itself, and asks *other* holders whether
their copy was that state at those fragment rounds: every holder remembers the digests of its last
`HISTORY_STATES` states. A state no other holder confirms is refused — whatever the donor claimed
about its rounds — so a poisoned donor cannot plant a copy, and a donor that sends slowly or too
much is cut off at a deadline and at the exact size the receiver's own model implies.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

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


def install_state_handlers(
    service: SyncService, snapshot: Callable[[str], Snapshot | None], history: StateHistory
) -> None:
    """Lets other peers download our modules' states and confirm state digests against our history."""

    async def on_state_request(sender: str, body: bytes, reader, writer) -> None:
        request = wire.parse(wire.StateRequest, body)
        got = snapshot(request.module) if request.run == service.run else None
        if got is None:
            await wire.write(writer, wire.pack_header(Kind.ACK, Ack(ok=False, reason="not held")))
            return
        rounds, tensors = got
        header = wire.StateHeader(
            run=service.run,
            module=request.module,
            fragment_rounds=rounds,
            numels=[t.numel() for t in tensors],
        )
        frames = [wire.pack_header(Kind.STATE_HEADER, header), *tensor_frames(tensors)]
        service.bytes_sent += sum(len(f) for f in frames)
        await wire.write(writer, *frames)

    async def on_confirm(sender: str, body: bytes, reader, writer) -> None:
        query = wire.parse(wire.Confirm, body)
        known = history.lookup(query.module, query.fragment_rounds) if query.run == service.run else None
        if known is None:
            ack = Ack(ok=False, reason="unknown")
        else:
            ack = Ack(
                ok=list(known) == query.digests, reason="" if list(known) == query.digests else "different"
            )
        await wire.write(writer, wire.pack_header(Kind.ACK, ack))

    service.extra_handlers[Kind.STATE_REQUEST] = on_state_request
    service.extra_handlers[Kind.CONFIRM] = on_confirm


async def download_state(
    service: SyncService, peer: str, module: str, numels: list[int], timeout: float
) -> Snapshot:
    """A module's state from `peer`, read within the sizes `numels` our own model implies."""

    async def go() -> Snapshot:
        frames = [wire.pack_header(Kind.STATE_REQUEST, wire.StateRequest(run=service.run, module=module))]
        reader, writer = await service.open(peer, frames, timeout)
        try:
            kind, body = await wire.read_frame(reader, {Kind.STATE_HEADER, Kind.ACK}, wire.MAX_HEADER_BYTES)
            if kind == Kind.ACK:
                raise wire.WireError(f"{peer} refused: {wire.parse(Ack, body).reason}")
            header = wire.parse(wire.StateHeader, body)
            if (
                header.module != module
                or header.numels != numels
                or len(header.fragment_rounds) * 2 != len(numels)
            ):
                raise wire.WireError(f"{peer} offered a state of another shape ({header.numels[:4]}...)")
            return list(header.fragment_rounds), await read_tensors(service, reader, peer, numels)
        finally:
            writer.close()

    return await asyncio.wait_for(go(), timeout)


async def confirm_state(
    service: SyncService, peer: str, module: str, rounds: list[int], digests: list[str], timeout: float
) -> bool | None:
    """True if `peer` had this state, False if it had another at these rounds, None if it cannot say."""
    query = wire.Confirm(run=service.run, module=module, fragment_rounds=rounds, digests=digests)
    try:
        ack = await service.request(peer, [wire.pack_header(Kind.CONFIRM, query)], timeout)
    except Exception as e:
        logger.debug(f"confirmation from {peer} failed: {type(e).__name__}: {e}")
        return None
    if ack.ok:
        return True
    return False if ack.reason == "different" else None


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
    """True once more confirmers say "this was my state" than "my state at those rounds differs";
    holders a little behind are asked again a few times."""
    for attempt in range(CONFIRM_ATTEMPTS):
        answers = await asyncio.gather(
            *(confirm_state(service, c, module, rounds, digests, timeout) for c in confirmers)
        )
        yes, no = answers.count(True), answers.count(False)
        if yes > no:
            return True
        if no > yes:
            return False
        await asyncio.sleep(0.5 * (attempt + 1))
    return False


async def fetch_confirmed(
    service: SyncService,
    module: str,
    numels: list[int],
    donors: list[str],
    timeout: float,
    confirm_timeout: float,
) -> tuple[str, list[int], list[torch.Tensor], bool] | None:
    """A module's state from the first donor that sends one that another holder confirms (or from a
    donor with nobody else to ask: `confirmed` is then False). Returns (donor, rounds, tensors,
    confirmed), or None."""
    for donor in donors:
        try:
            rounds, tensors = await download_state(service, donor, module, numels, timeout)
        except Exception as e:
            logger.warning(f"{module}: state download from {donor} failed: {type(e).__name__}: {e}")
            continue
        confirmers = [d for d in donors if d != donor]
        if not confirmers:
            return donor, rounds, tensors, False
        if await confirmed(service, module, rounds, digests_of(tensors), confirmers, confirm_timeout):
            return donor, rounds, tensors, True
        logger.warning(f"{module}: no other holder confirms the state {donor} sent; refused")
        service.refused["unconfirmed"] += 1
    return None
