"""What a round's members decide from the signed reports they hold: one agreed set of parts, the
aggregate of it, and whether their copy needs repairing or merging.

Every member runs `decide` on the same inputs — the union of signed reports after the echo, the
parts the reports agree on, the standing each sender's own header carried — so every member that
holds the same reports ends the round with the same bits:

* **voters** are the reporters with standing (`Standing.voters`: admitted keys; all reporters only
  where none is admitted), minus any caught equivocating;
* a sender's part counts when a strict majority of voters list the same digest for it
  (`reports.agreed_senders`): one report leaving it out vetoes nothing, and reports of keys on
  probation decide nothing;
* a member that lacks a part the voters agreed on fetches it from a voter that has it, checked
  against the agreed digest (`fetch_part`); one that cannot is `incomplete` and says so;
* the parts are combined by the run's robust aggregator, parts on probation weighed against the
  admitted ones (`peer.sync.aggregate`);
* the voters' copy digests say whether ours is outside a strict majority (repair from it) or whether
  no copy has one (merge the voters' copies).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import torch

from peer.sync import wire
from peer.sync.aggregate import AggregatorConfig, Contribution, aggregate_with_trust
from peer.sync.inbox import Delivery, Key, delivery_digest
from peer.sync.reports import agreed_senders, majority_state
from peer.sync.service import SyncService
from peer.sync.standing import Standing
from peer.sync.wire import Ack, Kind

logger = logging.getLogger(__name__)

#: a member that no longer claims the module (it left) while we waited for its Δ
LEFT = "left (its claim is gone)"


async def fetch_part(
    service: SyncService, key: Key, sender: str, digest: str, holders: list[str], numel: int, timeout: float
) -> Delivery | None:
    """`sender`'s part of round `key` with `digest`, from the first of `holders` that sends exactly
    it (header checked against our own fragment, payload capped, digest and contents checked)."""
    inbox = service.inbox
    request = wire.PartRequest(
        run=service.run, key=wire.RoundKey(module=key[0], fragment=key[1], round=key[2]), sender=sender,
        digest=digest,
    )  # fmt: skip

    async def one(holder: str) -> Delivery:
        reader, writer = await service.open(holder, [wire.pack_header(Kind.PART_REQUEST, request)], timeout)
        try:
            _, body = await wire.read_frame(reader, {Kind.ACK}, wire.MAX_HEADER_BYTES)
            ack = wire.parse(Ack, body)
            if not ack.ok:
                raise wire.WireError(f"{holder} refused: {ack.reason}")
            header = wire.parse(
                wire.DeltaHeader, (await wire.read_frame(reader, {Kind.DELTA}, wire.MAX_HEADER_BYTES))[1]
            )
            expected = inbox.codec.spec.wire_bytes(numel)
            if header.key != request.key or header.numel != numel or header.payload_bytes != expected:
                raise wire.WireError(f"{holder} sent another part than the one asked for")
            _, payload = await wire.read_frame(reader, {Kind.PAYLOAD}, expected)
        finally:
            writer.close()
        if len(payload) != expected or delivery_digest(header.weight, header.admission, payload) != digest:
            raise wire.WireError(f"{holder} sent a part whose digest is not the agreed one")
        service.bytes_received += len(payload)
        delta = await asyncio.get_running_loop().run_in_executor(None, inbox.decode, header, payload)
        return Delivery(sender, header.weight, digest, delta, len(payload), header.admission, payload)

    for holder in holders:
        try:
            return await asyncio.wait_for(one(holder), timeout)
        except Exception as e:  # refused, gone, slow or lying: try the next holder
            logger.debug(f"{key}: {sender}'s part not from {holder}: {type(e).__name__}: {e}")
    return None


def contributions_of(parts: dict[str, Delivery], standing) -> list[Contribution]:
    return [
        Contribution(s, d.delta.numpy(), d.weight, standing.admitted(s, d.admission))
        for s, d in sorted(parts.items())
    ]


async def combine(parts: dict[str, Delivery], standing, config: AggregatorConfig):
    """The robust aggregate of `parts` (float32 tensor), off the event loop (it costs CPU), and the
    senders whose part went in (a part on probation pointing away from the admitted result does not)."""
    contributions = contributions_of(parts, standing)
    loop = asyncio.get_running_loop()
    result, taken = await loop.run_in_executor(None, aggregate_with_trust, contributions, config)
    return torch.from_numpy(np.ascontiguousarray(result)), taken


def copies_verdict(
    reports, voters: list[str], me: str, state_digest: str
) -> tuple[list[str], dict[str, str]]:
    """(voters to repair our copy from, or []; voters' copy digests to merge, or {}): a strict
    majority of voters holding another copy than ours means repair; no copy with a majority, merge."""
    if not voters:
        return [], {}
    top = majority_state(reports, voters)
    if top is None:
        return [], {v: reports[v].state_digest for v in voters}
    if top != state_digest:
        return sorted(v for v in voters if reports[v].state_digest == top and v != me), {}
    return [], {}


def agreed_parts(slot, voters: list[str], excluded: set[str]) -> dict[str, str]:
    honest = slot.reports.honest()
    return agreed_senders(honest, voters, excluded)


#: how a member that refused our round as beyond its lookahead (it is far behind us) is recorded
FAR_BEHIND = "refused (ahead"


def _outnumber(standing: Standing, group: list[str], took: set[str]) -> list[str]:
    """`group` if more of its members have standing than those that took our Δ (at this round),
    else []: one key answering anything is not followed; members that did not answer decide nothing."""
    voters = set(standing.among([*group, *took]))
    return group if group and len(voters & set(group)) > len(voters & took) else []


def past_round(standing: Standing, failed: dict[str, str], took: set[str]) -> list[str]:
    """The members past this round (they answered "stale"), if they outnumber those at it."""
    return _outnumber(standing, sorted(m for m, why in failed.items() if why == "ahead"), took)


def lagging(standing: Standing, failed: dict[str, str], took: set[str]) -> list[str]:
    """Members far behind this round (it was past their lookahead), if they outnumber those at it."""
    return _outnumber(standing, sorted(m for m, why in failed.items() if why.startswith(FAR_BEHIND)), took)
