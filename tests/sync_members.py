"""Members of a sync group for tests: each a real DHT node, `SyncService` and `RoundRunner`."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from peer.codecs.formats import make_codec
from peer.sync import wire
from peer.sync.aggregate import AggregatorConfig
from peer.sync.inbox import Inbox
from peer.sync.rounds import RoundRunner, RoundSettings
from peer.sync.service import SyncService
from peer.sync.wire import Kind

RUN_ID = "ab" * 32
MODULE = "l0m0"


@dataclass
class Member:
    service: SyncService
    runner: RoundRunner

    @property
    def peer_id(self) -> str:
        return self.service.peer_id


@contextmanager
def sync_group(
    dht_factory,
    n: int,
    numel: int,
    codec: str = "fp32",
    aggregator: str = "mean",
    averaging_timeout: float = 10.0,
    report_timeout: float = 2.0,
    max_delta_norm: float = 0.0,
    left: set[str] | None = None,
    fragments: int = 1,
):
    """n members holding one module of `fragments` fragments of `numel` numbers each; every member counts the
    others as holders (the claim view's answer) except the peer ids the test puts in `left` (their
    leaving claims)."""
    left = set() if left is None else left
    members: list[Member] = []
    try:
        for _ in range(n):
            dht, _ = dht_factory()
            c = make_codec(codec)
            inbox = Inbox(
                {MODULE: [numel] * fragments}, c, lambda peer, module: peer not in left, 32, max_delta_norm
            )
            service = SyncService(dht, RUN_ID, inbox, stream_timeout_seconds=30)
            settings = RoundSettings(averaging_timeout, report_timeout, AggregatorConfig(method=aggregator))
            members.append(Member(service, RoundRunner(service, c, settings)))
        yield members
    finally:
        for m in members:
            m.service.shutdown()


def run_round(members: list[Member], deltas, weights, round_index: int = 0, digest: str = "0" * 64):
    ids = [m.peer_id for m in members]
    futures = [
        m.runner.start((MODULE, 0, round_index), d, w, ids, digest)
        for m, d, w in zip(members, deltas, weights, strict=True)
    ]
    return [f.result(timeout=60) for f in futures]


def send_delta(
    sender: Member,
    to: Member,
    payload: bytes,
    numel: int,
    weight: float = 1.0,
    round_index: int = 0,
    payload_bytes: int | None = None,
    codec: str = "fp32",
):
    """Sends a crafted outer gradient (as a hostile or broken peer would) and returns the ACK."""
    header = wire.DeltaHeader(
        run=RUN_ID[:16], key=wire.RoundKey(module=MODULE, fragment=0, round=round_index), weight=weight,
        codec=codec, numel=numel, payload_bytes=len(payload) if payload_bytes is None else payload_bytes,
    )  # fmt: skip
    frames = [wire.pack_header(Kind.DELTA, header), wire.pack(Kind.PAYLOAD, payload)]
    return sender.service.call(sender.service.request(to.peer_id, frames, 10), timeout=20)


def fp32_bytes(x: torch.Tensor) -> bytes:
    return make_codec("fp32").encode(x)
