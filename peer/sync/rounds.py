"""One sync round of one module fragment among its holders, without matchmaking.

The group is planned: every holder derives the members of (module, fragment, round) from the claim
view it already keeps, so a round starts the moment a member's outer gradient is ready. Then:

1. **gather** — the member sends its encoded Δ to every other member and collects theirs, until every
   member delivered, could not be reached, or `averaging_timeout` passed;
2. **report** — it tells every member what it received (sender -> digest of weight and payload) and
   the digest of its own copy of the fragment before the round, and collects their reports for a
   short while;
3. **agree** — a sender counts only if every report received lists the same digest for it: a member
   whose Δ some did not get (it died mid-round, stalled, or was refused as malformed) is left out by
   all of them alike, and one that sent different bytes to different members is left out too;
4. **aggregate** — every member computes the run's robust aggregate of the agreed Δs with the same
   deterministic code (`peer.sync.aggregate`), so the holders' copies stay bit-identical.

A member whose own Δ was left out (it was late) applies the others' aggregate all the same, which
keeps it in step. The reports' copy digests tell a member whose copy differs from a strict majority
of the group that it must repair it (`repair_from`); where the copies differ and none has a strict
majority (a healed partition, a split cut mid-round), every member merges them all before applying
the round (`merge_with`, `peer.sync.merge`). What a member cannot know (whether a report it never
got would have changed its agreed set) is caught the next round by those digests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from peer.codecs.formats import Codec
from peer.sync import wire
from peer.sync.aggregate import AggregatorConfig, Contribution, aggregate
from peer.sync.inbox import Delivery, Key, delivery_digest
from peer.sync.service import SyncService
from peer.sync.wire import Kind

logger = logging.getLogger(__name__)

#: how often a member that is catching up is offered our outer gradient again
RETRY_SECONDS = 0.5


#: a member that no longer claims the module (it left) while we waited for its Δ
LEFT = "left (its claim is gone)"
#: why a member is not waited for: our Δ did not reach it, it is already past this round, or it left
GONE = ("unreachable", "ahead", LEFT)


@dataclass
class RoundResult:
    """What one round produced for this member. `delta` is the group's aggregate (or our own Δ when
    nobody else took part)."""

    #: "averaged" | "excluded" (our Δ was left out) | "alone" | "behind" (others are past this
    #: round: nothing is applied, the state is fetched) | "failed"
    outcome: str
    delta: torch.Tensor
    group_size: int
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    detail: str = ""
    #: members that took part (the agreed senders)
    members: list[str] = field(default_factory=list)
    #: expected members left out of the aggregate, with why ("missing", "unreachable", "disputed")
    dropped: dict[str, str] = field(default_factory=dict)
    #: our copy differed from a strict majority of the group before the round: download the state of
    #: one of these members (after it applied this round too)
    repair_from: list[str] = field(default_factory=list)
    bad_parts: dict[str, int] = field(default_factory=dict)
    #: members that had already applied this round: we are behind them and must fetch their state
    ahead: list[str] = field(default_factory=list)
    #: the copies differ with no strict majority: merge ours with these members' (peer -> the digest
    #: of the copy it reported) before applying the round
    merge_with: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundSettings:
    """Deadlines and the aggregator of a run's rounds (from `SyncConfig`)."""

    averaging_timeout_seconds: float
    report_timeout_seconds: float
    aggregator: AggregatorConfig


def _group_copy(digests: Counter, holders: int) -> str | None:
    """The copy a strict majority of the group holds, if any. Without one, no copy is picked: a rule
    over claimed digests could be gamed by a member that grinds a small one, and would throw the other
    camps' work away; the copies are merged instead."""
    top, count = digests.most_common(1)[0]
    return top if count * 2 > holders else None


class RoundRunner:
    """Runs rounds on a `SyncService`'s loop for one peer."""

    def __init__(self, service: SyncService, codec: Codec, settings: RoundSettings):
        self.service = service
        self.codec = codec
        self.settings = settings
        self.me = service.peer_id
        self._tasks: set[asyncio.Task] = set()  # sends still running after their round was decided
        #: bytes this peer sent for each round in flight (what its result reports)
        self._sent: dict[Key, int] = {}

    def _keep(self, tasks: list[asyncio.Task]) -> None:
        for task in tasks:
            if not task.done():
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def start(
        self,
        key: Key,
        delta: torch.Tensor,
        weight: float,
        members: list[str],
        state_digest: str,
        payload: bytes | None = None,
    ):
        """Starts a round in the background; returns a concurrent future of its `RoundResult`."""
        own = delta.detach().to(torch.float32).reshape(-1).clone()
        return self.service.submit(
            self._run(key, own, float(weight), sorted(set(members) | {self.me}), state_digest, payload)
        )

    async def _run(
        self,
        key: Key,
        own: torch.Tensor,
        weight: float,
        members: list[str],
        state_digest: str,
        payload: bytes | None = None,
    ):
        started = time.monotonic()
        # this round's own bytes: rounds of a path's modules run at once on one service, so the
        # service's totals would count each other's traffic
        self._sent[key] = 0
        try:
            result = await self._round(key, own, weight, members, state_digest, payload)
        except Exception as e:  # a round must never kill the peer: it goes on with its own Δ
            logger.exception(f"round {key} failed")
            result = RoundResult("failed", own, 1, detail=f"{type(e).__name__}: {e}")
        result.seconds = time.monotonic() - started
        result.bytes_sent = self._sent.pop(key, 0)
        deliveries = self.service.inbox.slot(key).deliveries
        result.bytes_received = sum(d.wire_bytes for s, d in deliveries.items() if s != self.me)
        return result

    async def _round(
        self,
        key: Key,
        own: torch.Tensor,
        weight: float,
        members: list[str],
        state_digest: str,
        payload: bytes | None,
    ):
        loop = asyncio.get_running_loop()
        inbox = self.service.inbox
        if payload is None:
            payload = await loop.run_in_executor(None, self.codec.encode, own)
        mine = Delivery(
            self.me,
            weight,
            delivery_digest(weight, payload),
            self.codec.decode(payload, own.numel()),
            len(payload),
        )
        inbox.add_delivery(key, mine)
        # a holder that already sent us its Δ for this round is a member, whatever our view said
        others = sorted({m for m in members if m != self.me} | set(inbox.slot(key).deliveries) - {self.me})
        if not others:
            return RoundResult("alone", own, 1, detail="no other holder", members=[self.me])
        header = wire.DeltaHeader(
            run=self.service.run, key=wire.RoundKey(module=key[0], fragment=key[1], round=key[2]),
            weight=weight, codec=self.codec.spec.name, numel=own.numel(), payload_bytes=len(payload),
        )  # fmt: skip
        frames = [wire.pack_header(Kind.DELTA, header), wire.pack(Kind.PAYLOAD, payload)]
        deadline = loop.time() + self.settings.averaging_timeout_seconds
        failed: dict[str, str] = {}
        sends = [asyncio.create_task(self._send(m, frames, deadline, failed, inbox, key)) for m in others]

        def gathered(slot) -> bool:
            for sender in slot.deliveries:
                if sender != self.me and sender not in others:  # joined while we gather: send it ours
                    others.append(sender)
                    sends.append(
                        asyncio.create_task(self._send(sender, frames, deadline, failed, inbox, key))
                    )
            for m in others:
                # a member whose claim went (it announced it is leaving, or its claim expired) after
                # it took our Δ will not send its own: waiting for it would hold the round, and our
                # own shutdown, until the averaging timeout
                if m not in slot.deliveries and m not in failed and not inbox.is_holder(m, key[0]):
                    failed[m] = LEFT
            # a member that refused our Δ (it banned us, or found it malformed) is still in the round
            # and sends its own: wait for it, or our report would leave it out while others keep it
            return all(
                m in slot.deliveries or m in slot.refused or failed.get(m, "").startswith(GONE)
                for m in others
            )

        await inbox.wait(key, gathered, deadline)
        slot = inbox.slot(key)
        logger.debug(f"{key}: gathered {sorted(slot.deliveries)} of {others}, failed {failed}")
        received = {s: d.digest for s, d in slot.deliveries.items()}
        for m, why in slot.refused.items():
            failed.setdefault(m, f"its part was refused ({why})")
        report = wire.Report(
            run=self.service.run, key=header.key, received=received, state_digest=state_digest
        )
        report_frames = [wire.pack_header(Kind.REPORT, report)]
        report_deadline = loop.time() + self.settings.report_timeout_seconds
        report_sends = [
            asyncio.create_task(self._send(m, report_frames, report_deadline, {}, None, key)) for m in others
        ]
        reporters = [s for s in received if s != self.me]
        await inbox.wait(key, lambda slot: all(r in slot.reports for r in reporters), report_deadline)
        logger.debug(f"{key}: reports from {sorted(slot.reports)} of {reporters}")
        # our sends go on until their own deadlines: a member that is late still needs our Δ and
        # report to agree with us (cancelling a report that crossed its twin loses it)
        self._keep(sends + report_sends)
        return await self._agree(
            key, own, members, received, dict(slot.reports), dict(slot.deliveries), state_digest, failed
        )

    async def _send(self, member: str, frames, deadline: float, failed: dict, inbox, key: Key) -> None:
        """Delivers `frames` to `member` before `deadline`. A member that refuses because the round is
        ahead of its own (it is behind us, fetching state) or because it does not know us as a holder
        yet is offered the frames again until the deadline. One that refuses because the round is
        over for it is ahead of us ("ahead")."""
        loop = asyncio.get_running_loop()
        while True:
            remaining = deadline - loop.time()
            try:
                ack = await self.service.request(member, frames, max(0.1, remaining), self._sent, key)
            except Exception as e:  # unreachable, stalled, or gone: don't wait for it
                failed[member] = f"unreachable ({type(e).__name__})"
                break
            if ack.ok:
                break
            # "ahead": the member is behind and catching up; "not_holder": its claim view has not seen
            # our claim yet (it refreshes every heartbeat): both will take our Δ in a moment
            waiting = ack.reason.startswith(("ahead", "not_holder"))
            if waiting and deadline - loop.time() > RETRY_SECONDS:
                await asyncio.sleep(RETRY_SECONDS)
                continue
            failed[member] = "ahead" if ack.reason.startswith("stale") else f"refused ({ack.reason})"
            break
        if inbox is not None:
            inbox.slot(key).changed.set()

    async def _agree(
        self, key, own, members, received, reports, deliveries, state_digest, failed
    ) -> RoundResult:
        ahead = sorted(m for m, why in failed.items() if why == "ahead")
        if ahead:  # others finished this round without us: catch up rather than go on alone
            detail = f"{len(ahead)} members are past this round"
            return RoundResult("behind", own, 1, members=[self.me], ahead=ahead, detail=detail)
        agreed = [
            s for s in sorted(received) if all(r.received.get(s) == received[s] for r in reports.values())
        ]
        dropped = {}
        for m in members:
            if m in agreed:
                continue
            if m not in received:
                # unreachable or missing because it has left since: say so (an expected absence)
                gone = not self.service.inbox.is_holder(m, key[0])
                dropped[m] = LEFT if gone else failed.get(m, "missing")
            else:
                dropped[m] = "disputed (not every member received the same)"
        if not agreed:  # every delivery disputed: nothing the group agrees on, go on with our own
            return RoundResult("alone", own, 1, dropped=dropped, detail="no delivery every member agreed on")
        contributions = [Contribution(s, deliveries[s].delta.numpy(), deliveries[s].weight) for s in agreed]
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(None, aggregate, contributions, self.settings.aggregator)
        aggregated = torch.from_numpy(np.ascontiguousarray(result))
        digests = Counter([state_digest] + [r.state_digest for r in reports.values()])
        holders = 1 + len(reports)
        repair = []
        top = _group_copy(digests, holders)
        if top is not None and top != state_digest:
            repair = sorted(p for p, r in reports.items() if r.state_digest == top)
        merge_with = {}
        if top is None:  # several copies, none held by a strict majority
            merge_with = {p: r.state_digest for p, r in reports.items()}
        if self.me not in agreed:
            outcome = "excluded"
        elif len(agreed) == 1:
            outcome = "alone"
        else:
            outcome = "averaged"
        if dropped:  # said by the caller (PathSync), which knows whether we are still joining
            logger.debug(f"{key}: left out of the average: {dropped}")
        late = "our outer gradient did not reach every member in time"
        return RoundResult(
            outcome, aggregated, len(agreed), members=agreed, dropped=dropped, repair_from=repair,
            merge_with=merge_with, detail=late if outcome == "excluded" else "",
        )  # fmt: skip
