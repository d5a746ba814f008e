"""Downloading a module's state among hostile donors: each donor is a real `SyncService` on its own DHT
node. A poisoned donor (a different state at the same rounds) is refused because other holders do
not confirm it; a slow-loris donor (a header, then a byte now and then) is cut off at the download
deadline; the joiner ends with an honest holder's exact state."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from peer.codecs.formats import make_codec
from peer.sync import wire
from peer.sync.inbox import Inbox
from peer.sync.service import SyncService
from peer.sync.state_transfer import StateHistory, digests_of, fetch_confirmed, install_state_handlers
from peer.sync.wire import Kind
from tests.sync_members import MODULE, RUN_ID

NUMELS = [1000, 1000]  # one fragment: θ̄, then its momentum
ROUNDS = [7]


def _service(dht_factory) -> SyncService:
    dht, _ = dht_factory()
    inbox = Inbox({MODULE: [NUMELS[0]]}, make_codec("fp32"), lambda peer, module: True, 8, 0.0)
    return SyncService(dht, RUN_ID, inbox, stream_timeout_seconds=30)


def _holder(dht_factory, tensors: list[torch.Tensor]) -> SyncService:
    service = _service(dht_factory)
    history = StateHistory()
    history.record(MODULE, ROUNDS, digests_of(tensors))
    install_state_handlers(service, lambda module: (ROUNDS, tensors) if module == MODULE else None, history)
    return service


def _slow_loris(dht_factory) -> SyncService:
    service = _service(dht_factory)

    async def dribble(sender, body, reader, writer):
        header = wire.StateHeader(run=RUN_ID, module=MODULE, fragment_rounds=ROUNDS, numels=NUMELS)
        payload = wire.pack(Kind.PAYLOAD, b"\0" * 4 * NUMELS[0])
        await wire.write(writer, wire.pack_header(Kind.STATE_HEADER, header))
        for i in range(len(payload)):  # one byte a second: never done
            await wire.write(writer, payload[i : i + 1])
            await asyncio.sleep(1.0)

    service.extra_handlers[Kind.STATE_REQUEST] = dribble
    return service


@pytest.mark.timeout(120)
def test_a_joiner_refuses_a_poisoned_donor_cuts_off_a_slow_one_and_takes_the_honest_state(dht_factory):
    gen = torch.Generator().manual_seed(0)
    honest = [torch.randn(n, generator=gen) for n in NUMELS]
    poisoned = [t.clone() for t in honest]
    poisoned[0][::10] += 100.0  # the same rounds, another state
    services = []
    try:
        slow = _slow_loris(dht_factory)
        bad = _holder(dht_factory, poisoned)
        good = [_holder(dht_factory, honest) for _ in range(3)]
        joiner = _service(dht_factory)
        services = [slow, bad, *good, joiner]
        donors = [s.peer_id for s in (slow, bad, *good)]
        started = time.monotonic()
        got = joiner.submit(
            fetch_confirmed(joiner, MODULE, NUMELS, donors, timeout=3.0, confirm_timeout=3.0)
        ).result(timeout=90)
        seconds = time.monotonic() - started
    finally:
        for s in services:
            s.shutdown()
    assert got is not None
    donor, rounds, tensors, confirmed = got
    assert donor == good[0].peer_id and confirmed and rounds == ROUNDS
    assert all(torch.equal(a, b) for a, b in zip(tensors, honest, strict=True))
    assert joiner.refused["unconfirmed"] == 1  # the poisoned state, refused after the download
    assert seconds < 30  # the slow donor cost one download deadline, not its whole dribble
