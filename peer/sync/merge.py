"""Copies of a fragment that diverged with no majority among them, merged into one.

A round's reports carry each member's digest of its copy before the round (`peer.sync.rounds`). A
copy outside a strict majority is repaired from the majority; but a partition cut in the middle of a
round, or a healed split, can leave a group where no copy has a majority — two halves, or every
member on its own copy. Picking one of them by some rule would throw away the other members' work,
and any rule over claimed digests can be gamed by a member that grinds its digest. Instead every
member downloads the copy each other member *reported* (checked against that digest, so nobody can
substitute another) and combines all of them with `aggregate.combine_copies` (a robust mean),
before the round's aggregate is applied. Members that saw the same reports and got the same copies
end with the same bits; any that did not are caught again by the next round's digests.

Each member keeps the copy it reported until a while after the round (`ReportedCopies`), since
others download it after the round ended for them — and the one before it: a member whose rounds run
a round behind ours (a half of a healed partition, a peer that just joined) asks for our copy of a
round we already left, and without it the merge is one-sided (we take its copy, it keeps its own).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import numpy as np
import torch

from dht.serve_limits import ServeLimits
from peer.sync import wire
from peer.sync.aggregate import combine_copies
from peer.sync.module_sync import state_digest
from peer.sync.service import SyncService
from peer.sync.state_transfer import read_tensors, tensor_frames
from peer.sync.wire import Ack, Kind

logger = logging.getLogger(__name__)

Copy = tuple[torch.Tensor, torch.Tensor]  # a fragment's θ̄ and outer momentum
#: a copy with a value beyond this is no model's state (the bound `ModuleSync.load_state` applies)
MAX_STATE_ABS = 1e6
#: reported copies kept per (module, fragment): our latest round's and the one before it
KEPT_ROUNDS = 2


class ReportedCopies:
    """The copies of each (module, fragment) this peer reported in its last `KEPT_ROUNDS` rounds, for
    a while."""

    def __init__(self, keep_seconds: float):
        self.keep_seconds = keep_seconds
        self._lock = threading.Lock()
        self._copies: dict[tuple[str, int], list[tuple[str, Copy, float]]] = {}

    def remember(self, module: str, fragment: int, digest: str, copy: Copy) -> None:
        # references, not clones: a round replaces θ̄ and momentum with new tensors, never writes them
        with self._lock:
            kept = [c for c in self._copies.get((module, fragment), []) if c[0] != digest]
            self._copies[(module, fragment)] = [*kept, (digest, copy, time.monotonic())][-KEPT_ROUNDS:]

    def find(self, module: str, fragment: int, digest: str) -> Copy | None:
        with self._lock:
            kept = list(self._copies.get((module, fragment), []))
        now = time.monotonic()
        return next((c for d, c, t in kept if d == digest and now - t <= self.keep_seconds), None)

    def forget_old(self) -> None:
        """Drops copies past their time (they would hold a module's worth of memory otherwise)."""
        now = time.monotonic()
        with self._lock:
            for key, kept in list(self._copies.items()):
                if not (fresh := [c for c in kept if now - c[2] <= self.keep_seconds]):
                    del self._copies[key]
                else:
                    self._copies[key] = fresh


def install_copy_handler(
    service: SyncService, copies: ReportedCopies, limits: ServeLimits | None = None
) -> None:
    """Lets the members of a round download the copies we reported (for a merge), within `limits`."""
    limits = limits if limits is not None else ServeLimits()

    async def on_copy_request(sender: str, body: bytes, reader, writer) -> None:
        request = wire.parse(wire.CopyRequest, body)
        allowed = request.run == service.run and service.inbox.standing.takes_part(sender)
        got = copies.find(request.module, request.fragment, request.digest) if allowed else None
        if got is None:
            await wire.write(writer, wire.pack_header(Kind.ACK, Ack(ok=False, reason="not kept")))
            return
        standing = service.inbox.standing.admitted(sender)
        busy = limits.acquire(sender, sum(4 * t.numel() for t in got), standing)
        if busy is not None:
            await wire.write(writer, wire.pack_header(Kind.ACK, Ack(ok=False, reason=busy)))
            return
        try:
            frames = [wire.pack_header(Kind.ACK, Ack(ok=True)), *tensor_frames(list(got))]
            service.bytes_sent += sum(len(f) for f in frames)
            await wire.write(writer, *frames)
        finally:
            limits.release(sender, standing)

    service.extra_handlers[Kind.COPY_REQUEST] = on_copy_request


async def download_copy(
    service: SyncService, peer: str, module: str, fragment: int, digest: str, numel: int, timeout: float
) -> Copy:
    """The copy `peer` reported for a round, read within the size our own fragment implies and checked
    against the digest it reported; raises on anything else."""

    async def go() -> Copy:
        request = wire.CopyRequest(run=service.run, module=module, fragment=fragment, digest=digest)
        reader, writer = await service.open(peer, [wire.pack_header(Kind.COPY_REQUEST, request)], timeout)
        try:
            ack = wire.parse(Ack, (await wire.read_frame(reader, {Kind.ACK}, wire.MAX_HEADER_BYTES))[1])
            if not ack.ok:
                raise wire.WireError(f"{peer} refused: {ack.reason}")
            theta, momentum = await read_tensors(service, reader, peer, [numel, numel])
        finally:
            writer.close()
        if state_digest(theta, momentum) != digest:
            raise wire.WireError(f"{peer} sent a copy other than the one it reported")
        return theta, momentum

    return await asyncio.wait_for(go(), timeout)


async def merged_copy(
    service: SyncService,
    module: str,
    fragment: int,
    own: Copy,
    own_digest: str,
    reported: dict[str, str],
    timeout: float,
) -> tuple[Copy, list[str]]:
    """Combines the copies in `reported` (peer -> digest: the round's voters, us among them when we
    vote): each distinct copy is downloaded once (from the first of its holders, by peer id, that
    sends it; ours is not downloaded) and counts once per member that reported it. A copy no holder
    sends is left out; so is one with values a state may not have (`MAX_STATE_ABS`). Returns the
    merged (θ̄, momentum) and the peers whose copies went in."""
    numel = own[0].numel()
    camps: dict[str, list[str]] = {}
    for peer in sorted(reported):
        camps.setdefault(reported[peer], []).append(peer)

    async def one(digest: str, holders: list[str]) -> Copy | None:
        if digest == own_digest:
            return own
        for peer in holders:
            if peer == service.peer_id:
                continue
            try:
                copy = await download_copy(service, peer, module, fragment, digest, numel, timeout)
            except Exception as e:
                logger.warning(f"{module} fragment {fragment}: no copy from {peer}: {type(e).__name__}: {e}")
                continue
            if not all(bool(t.abs().max() <= MAX_STATE_ABS) for t in copy):
                logger.warning(f"{module} fragment {fragment}: {peer}'s copy holds values past 1e6")
                return None
            return copy
        return None

    digests = sorted(camps)
    got = await asyncio.gather(*(one(d, camps[d]) for d in digests))
    copies: dict[str, Copy] = {}
    for digest, copy in zip(digests, got, strict=True):
        if copy is not None:
            copies.update({p: copy for p in camps[digest]})
    if not copies:
        return own, []

    def combine() -> Copy:
        parts = []
        for i in range(2):
            arrays = [(p, c[i].detach().to(torch.float32).reshape(-1).numpy()) for p, c in copies.items()]
            parts.append(torch.from_numpy(np.ascontiguousarray(combine_copies(arrays))).view_as(own[i]))
        return parts[0], parts[1]

    merged = await asyncio.get_running_loop().run_in_executor(None, combine)
    return merged, sorted(copies)
