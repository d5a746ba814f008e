"""Members of a sync group for tests: each a real DHT node, `SyncService` and `RoundRunner`."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from hivemind.utils.crypto import RSAPrivateKey

from peer.codecs.formats import make_codec
from peer.run.admission import AdmissionCheck, sign_admission
from peer.sync import wire
from peer.sync.aggregate import AggregatorConfig
from peer.sync.inbox import Inbox
from peer.sync.rounds import RoundRunner, RoundSettings
from peer.sync.sent_rounds import SentRounds
from peer.sync.service import SyncService
from peer.sync.standing import Standing
from peer.sync.wire import Kind

RUN_ID = "ab" * 32
MODULE = "l0m0"
#: the creator of the tests' run: it signs the admissions of the members a test admits
CREATOR = RSAPrivateKey()


@dataclass
class Member:
    service: SyncService
    runner: RoundRunner
    key: RSAPrivateKey
    dht: object = None
    group: GroupSettings | None = None

    @property
    def peer_id(self) -> str:
        return self.service.peer_id

    @property
    def token(self) -> str:
        return self.service.inbox.standing.own_token


@dataclass
class GroupSettings:
    """What every member of a test group shares (see `sync_group`)."""

    numel: int
    codec: str
    aggregator: str
    averaging_timeout: float
    report_timeout: float
    max_delta_norm: float
    left: set[str]
    fragments: int
    mode: str
    tokens: dict[str, str]  # the claim view's tokens
    also: tuple[str, ...] = ()  # modules held beside MODULE, of the same shape


def make_member(
    dht, key, group: GroupSettings, admitted: bool = False, sent: SentRounds | None = None
) -> Member:
    """One member on a started DHT node (`sent`: its record of rounds sent, as a restarted peer reads it)."""
    check = AdmissionCheck(RUN_ID, CREATOR.get_public_key().to_bytes())
    c = make_codec(group.codec)
    standing = Standing(check, group.mode, lambda peer: group.tokens.get(peer, ""))
    left = group.left
    inbox = Inbox(
        {m: [group.numel] * group.fragments for m in (MODULE, *group.also)}, c,
        lambda peer, module: peer not in left, 32, group.max_delta_norm, standing,
    )  # fmt: skip
    service = SyncService(dht, RUN_ID, inbox, stream_timeout_seconds=30, key=key)
    if admitted:
        standing.own_token = group.tokens[service.peer_id] = sign_admission(
            CREATOR, RUN_ID, service.peer_id, "invite"
        )
    settings = RoundSettings(
        group.averaging_timeout, group.report_timeout, AggregatorConfig(method=group.aggregator)
    )
    return Member(service, RoundRunner(service, c, settings, sent), key, dht, group)


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
    admitted: list[int] | None = None,
    mode: str = "open",
    identity_paths: dict[int, str] | None = None,
    sent: dict[int, SentRounds] | None = None,
    also: tuple[str, ...] = (),
):
    """n members holding one module (and those named in `also`) of `fragments` fragments of `numel`
    numbers each; every member counts the others as holders (the claim view's answer) except the peer ids
    the test puts in `left` (their leaving claims). The members whose indices are in `admitted` hold the
    creator's admission (the others are on probation: nobody is admitted unless the test says so). Member
    i's identity is kept in `identity_paths[i]` where given (so a test can restart it), and its record of
    rounds sent in `sent[i]`."""
    group = GroupSettings(
        numel, codec, aggregator, averaging_timeout, report_timeout, max_delta_norm,
        set() if left is None else left, fragments, mode, {}, also,
    )  # fmt: skip
    members: list[Member] = []
    try:
        for i in range(n):
            path = (identity_paths or {}).get(i)
            dht, key = dht_factory(identity_path=path) if path else dht_factory()
            admit = admitted is not None and i in admitted
            members.append(make_member(dht, key, group, admit, (sent or {}).get(i)))
        yield members
    finally:
        for m in members:
            m.service.shutdown()


def restart(dht_factory, members: list[Member], i: int, identity_path: str, sent: SentRounds | None = None):
    """Member i of a test group killed (its sync service and DHT node shut down) and, with `start`,
    started again later with the same key (kept at `identity_path`, as `sync_group` was told): the
    new member takes its place in `members`, so the group shuts it down at its end."""
    old = members[i]
    old.service.shutdown()
    old.dht.shutdown()

    def start() -> Member:
        dht, key = dht_factory(identity_path=identity_path)
        members[i] = make_member(dht, key, old.group, sent=sent)
        return members[i]

    return start


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
        admission=sender.token,
    )  # fmt: skip
    frames = [wire.pack_header(Kind.DELTA, header), wire.pack(Kind.PAYLOAD, payload)]
    return sender.service.call(sender.service.request(to.peer_id, frames, 10), timeout=20)


def send_report(sender: Member, to: Member, received: dict[str, str], state_digest: str = "0" * 64,
                round_index: int = 0):  # fmt: skip
    """Signs and sends a crafted report (as a hostile member would) and returns the ACK."""
    from peer.sync.reports import sign_report

    report = wire.Report(
        run=RUN_ID[:16], key=wire.RoundKey(module=MODULE, fragment=0, round=round_index), received=received,
        state_digest=state_digest, admission=sender.token,
    )  # fmt: skip
    frames = [wire.pack_header(Kind.REPORT, sign_report(report, sender.key, sender.peer_id))]
    return sender.service.call(sender.service.request(to.peer_id, frames, 10), timeout=20)


def fp32_bytes(x: torch.Tensor) -> bytes:
    return make_codec("fp32").encode(x)


def advance(loop, tokens_total: int, holders: dict, drain: bool = False) -> None:
    """One inner step of a `StreamingOuter` as `PathSync.after_step` drives it (or, with `drain`, the
    syncs still in flight), for loops whose rounds ask for no merge or download."""
    if not drain:
        loop.tick(tokens_total, holders)
    for pending in loop.drain() if drain else loop.due():
        for mid, result in loop.collect(pending).items():
            loop.apply(pending, mid, result)
