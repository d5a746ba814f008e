"""A mover's HELLO (peer/sync/hello.py): a holder reads the claims from the DHT at once and counts the
mover, instead of after its next heartbeat; the message itself proves nothing, and a flood of them
costs the holder one claim read per interval."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from monitoring.metrics import PeerMetrics
from peer.codecs.formats import make_codec
from peer.config import OuterOptimizerConfig, RunManifest, SyncConfig
from peer.model.grid import ModelConfig
from peer.model.transformer import PathModel
from peer.sync import wire
from peer.sync.aggregate import AggregatorConfig
from peer.sync.hello import ClaimRefresh, Greeting, install_hello_handler
from peer.sync.inbox import Inbox
from peer.sync.module_sync import ModuleSync
from peer.sync.outer import StreamingOuter
from peer.sync.rounds import RoundRunner, RoundSettings
from peer.sync.service import SyncService
from peer.sync.standing import Standing
from peer.sync.wire import Kind
from tests.sync_members import MODULE, RUN_ID, fp32_bytes

pytestmark = pytest.mark.swarm

NUMEL = 8
#: the DHT key standing in for the run's claims: subkey = a peer id holding MODULE
CLAIMS = "hello-test-claims"


class Holder:
    """A holder whose claim view is only renewed when read (no heartbeat in this test)."""

    def __init__(self, dht, min_interval_seconds: float = 1.0):
        self.dht = dht
        self.view: set[str] = set()
        inbox = Inbox(
            {MODULE: [NUMEL]}, make_codec("fp32"), lambda peer, module: peer in self.view, 32, 0.0,
            Standing(None, "open", lambda peer: ""),
        )  # fmt: skip
        self.service = SyncService(dht, RUN_ID, inbox, stream_timeout_seconds=30)
        self.refresh = ClaimRefresh(self.read, min_interval_seconds)
        install_hello_handler(self.service, self.refresh)

    def read(self) -> None:
        found = self.dht.get(CLAIMS, latest=True)
        self.view = set(found.value) if found is not None and isinstance(found.value, dict) else set()


def claim(dht, peer_id: str) -> None:
    assert dht.store(CLAIMS, MODULE, time.time() + 60, subkey=peer_id)


def offer_delta(sender: SyncService, to: str) -> wire.Ack:
    header = wire.DeltaHeader(
        run=RUN_ID[:16], key=wire.RoundKey(module=MODULE, fragment=0, round=0), weight=1.0, codec="fp32",
        numel=NUMEL, payload_bytes=4 * NUMEL, admission="",
    )  # fmt: skip
    payload = fp32_bytes(torch.zeros(NUMEL))
    frames = [wire.pack_header(Kind.DELTA, header), wire.pack(Kind.PAYLOAD, payload)]
    return sender.call(sender.request(to, frames, 10), timeout=20)


def mover_service(dht) -> SyncService:
    inbox = Inbox(
        {MODULE: [NUMEL]}, make_codec("fp32"), lambda p, m: True, 32, 0.0, Standing(None, "open", str)
    )
    return SyncService(dht, RUN_ID, inbox, stream_timeout_seconds=30)


@pytest.mark.timeout(60)
def test_a_holder_told_hello_reads_the_movers_new_claim_at_once_and_takes_its_outer_gradient(dht_factory):
    holder = Holder(dht_factory()[0])
    mover_dht = dht_factory()[0]
    mover = mover_service(mover_dht)
    try:
        ack = offer_delta(mover, holder.service.peer_id)
        assert not ack.ok and ack.reason.startswith("not_holder"), ack  # its view predates the move
        claim(mover_dht, mover.peer_id)
        started = time.monotonic()
        greeting = Greeting(mover, [MODULE], [holder.service.peer_id], started + 10, threading.Event())
        assert greeting.wait() == [holder.service.peer_id]
        assert time.monotonic() - started < 5.0  # one DHT read, not a heartbeat
        assert holder.refresh.reads == 1
        assert offer_delta(mover, holder.service.peer_id).ok
    finally:
        mover.shutdown()
        holder.service.shutdown()


@pytest.mark.timeout(60)
def test_a_hello_without_a_claim_in_the_dht_is_not_believed(dht_factory):
    holder = Holder(dht_factory()[0])
    stranger = mover_service(dht_factory()[0])
    try:
        started = time.monotonic()
        greeting = Greeting(stranger, [MODULE], [holder.service.peer_id], started + 3, threading.Event())
        assert greeting.wait() == []
        assert time.monotonic() - started >= 2.9  # unconfirmed: the holders' views are given their time
        read = holder.refresh._read
        holder.refresh._read = lambda: (time.sleep(3.0), read())  # an answer 3 s away
        stopped = threading.Event()
        stopped.set()  # a stop request (SIGTERM) waits for neither the answers nor the views
        started = time.monotonic()
        Greeting(stranger, [MODULE], [holder.service.peer_id], started + 10, stopped).wait()
        assert time.monotonic() - started < 1.0
        assert stranger.peer_id not in holder.view
        assert not offer_delta(stranger, holder.service.peer_id).ok
    finally:
        stranger.shutdown()
        holder.service.shutdown()


@pytest.mark.timeout(60)
def test_a_flood_of_hellos_costs_one_claim_read_per_interval(dht_factory):
    holder = Holder(dht_factory()[0], min_interval_seconds=1.0)
    flooder = mover_service(dht_factory()[0])
    frames = [wire.pack_header(Kind.HELLO, wire.Hello(run=RUN_ID[:16], modules=[MODULE]))]

    async def flood() -> list[wire.Ack]:
        async def one() -> wire.Ack:
            return await flooder.request(holder.service.peer_id, frames, 20)

        acks = []
        for _ in range(3):  # three waves, each answered by one read at most
            acks += await asyncio.gather(*(one() for _ in range(20)))
        return acks

    try:
        started = time.monotonic()
        acks = flooder.call(flood(), 60)
        seconds = time.monotonic() - started
        assert len(acks) == 60 and not any(a.ok for a in acks)
        # a read for the first HELLO, then at most one per interval for the rest
        assert 1 <= holder.refresh.reads <= 2 + seconds / holder.refresh.min_interval, (
            holder.refresh.reads,
            seconds,
        )
        assert holder.refresh.reads <= 4
    finally:
        flooder.shutdown()
        holder.service.shutdown()


@pytest.mark.timeout(60)
def test_a_mover_trains_on_while_its_hello_is_answered_and_its_first_sync_waits_for_the_answer(dht_factory):
    """Waiting for the answers before training cost a move 0.1-0.4 s (goodput rotation arm, session
    46); a sync started before a holder sees the mover's claim leaves the mover out of its round."""
    holder = Holder(dht_factory()[0])
    read = holder.refresh._read
    holder.refresh._read = lambda: (time.sleep(1.5), read())  # a holder's claim read that takes 1.5 s
    mover_dht = dht_factory()[0]
    mover = mover_service(mover_dht)
    h = 4
    cfg = ModelConfig(d_model=16, n_heads=2, d_ff=32, max_seq_len=9)
    manifest = RunManifest(
        name="t", model=cfg, seq_len=8, sync=SyncConfig(inner_steps=h, averaging_timeout_seconds=5)
    )
    ms = ModuleSync(cfg, MODULE, PathModel(cfg, (0, 0), seed=0).parts[MODULE], OuterOptimizerConfig(), 1)
    runner = RoundRunner(mover, make_codec("fp32"), RoundSettings(5.0, 5.0, AggregatorConfig(method="mean")))
    loop = StreamingOuter(
        {MODULE: ms}, manifest, mover.peer_id, PeerMetrics("t", mover.peer_id, "0", "t"), runner
    )
    loop.joining = False
    holders = {MODULE: [mover.peer_id, holder.service.peer_id]}
    try:
        claim(mover_dht, mover.peer_id)
        started = time.monotonic()
        greeting = Greeting(mover, [MODULE], [holder.service.peer_id], started + 20, threading.Event())
        for _ in range(h - 1):  # the steps before the first sync: trained on, not waited
            loop.tick(0, holders, greeting)
        assert time.monotonic() - started < 1.0 and not loop.pending
        loop.tick(0, holders, greeting)  # the due step: the round starts once the holder saw the claim
        assert 1.4 < time.monotonic() - started < 10.0 and len(loop.pending) == 1
        assert greeting.wait() == [holder.service.peer_id] and holder.view == {mover.peer_id}
    finally:
        mover.shutdown()
        holder.service.shutdown()
