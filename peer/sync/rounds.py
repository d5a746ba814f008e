"""One sync round of one module fragment among its holders, without matchmaking.

The group is planned: every holder derives the members of (module, fragment, round) from the claim
view it already keeps, so a round starts the moment a member's outer gradient is ready. Then:

1. **gather** — the member sends its encoded Δ (with its standing: the creator's admission token, or
   none on probation) to every other member and collects theirs, until every member delivered, could
   not be reached, or `averaging_timeout` passed; a holder whose Δ comes later is sent ours too;
2. **report** — it signs and sends every member what it received (sender -> digest of weight,
   standing and payload) and the digest of its own copy of the fragment before the round;
3. **echo** — it relays every signed report it holds to every member that reported, so that all of
   them decide on the same reports, and a member that told members different things is caught by
   whoever holds both of its reports (it is left out and banned);
4. **decide** — `peer.sync.agreement`: voters are the admitted reporters; a sender counts when a
   strict majority of voters list the same digest for it; a member that lacks an agreed part fetches
   it from a voter that has it; every member computes the same robust aggregate of the agreed parts
   with the same deterministic code (`peer.sync.aggregate`), so the holders' copies stay
   bit-identical.

A member whose own Δ was left out (it was late) applies the others' aggregate all the same, which
keeps it in step. "You are behind" counts only when a strict majority of the admitted members say it
(one key answering "stale" to everything is just left out). The voters' copy digests tell a member
whose copy differs from a strict majority that it must repair it (`repair_from`); where no copy has a
strict majority (a healed partition, a split cut mid-round) every member merges the voters' copies
(`merge_with`, `peer.sync.merge`). What a member cannot know (a report that reached nobody in time)
is caught the next round by those digests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from peer.codecs.formats import Codec
from peer.faults import fault_point
from peer.sync import wire
from peer.sync.aggregate import AggregatorConfig
from peer.sync.agreement import LEFT, agreed_parts, combine, copies_verdict, fetch_part, lagging, past_round
from peer.sync.inbox import Delivery, Key, delivery_digest
from peer.sync.probe import wait_probing
from peer.sync.reports import report_digest, send_echo, sign_report
from peer.sync.sent_rounds import SentRounds
from peer.sync.service import SyncService
from peer.sync.sitting_out import VOID, SittingOut
from peer.sync.stragglers import StragglerBound
from peer.sync.wire import Kind

logger = logging.getLogger(__name__)

#: how often a member that is catching up is offered our outer gradient again
RETRY_SECONDS = 0.5
#: why a member is not waited for: our Δ did not reach it, it is already past this round, or it left
#: a member that said it sends nothing more for this round (`Kind.SIT_OUT`: it sent it already)
SAT_OUT = "sat out (it sent this round already)"
#: a member sitting out another round of ours that we are not past: it waits for us to be (Inbox.holds_up)
HELD = "held up (it sits out a round of ours not over yet)"
GONE = ("unreachable", "ahead", LEFT, SAT_OUT, HELD)


@dataclass
class RoundResult:
    """What one round produced for this member. `delta`: the group's aggregate (alone: our own Δ)."""

    #: "averaged" | "excluded" (our Δ was left out) | "alone" | "incomplete" (an agreed part could
    #: not be fetched: we applied the rest, the next round's digests repair us) | "behind" (others are
    #: past this round: nothing is applied, the state is fetched) | "failed"
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
    #: our copy differed from the voters' strict majority before the round: fetch the state of one of these
    repair_from: list[str] = field(default_factory=list)
    bad_parts: dict[str, int] = field(default_factory=dict)
    #: members that had already applied this round: we are behind them and must fetch their state
    ahead: list[str] = field(default_factory=list)
    #: the voters' copies differ with no strict majority: merge these (peer -> the digest of the copy
    #: it reported; ours among them if we vote) before applying the round
    merge_with: dict[str, str] = field(default_factory=dict)
    #: members with standing that refused this round as too far ahead of theirs, outnumbering those
    #: that took it: our rounds ran away from theirs (a healed partition, a stretch alone). Rounds
    #: like this in a row make us take their state (`PathSync`): the lone lineage yields, since the
    #: others can never confirm ours
    lagging: list[str] = field(default_factory=list)
    #: our Δ as our part carried it (a lossy codec's error feedback keeps the rest); None: none went out
    sent: torch.Tensor | None = None


@dataclass(frozen=True)
class RoundSettings:
    """Deadlines and the aggregator of a run's rounds (from `SyncConfig`)."""

    averaging_timeout_seconds: float
    report_timeout_seconds: float
    aggregator: AggregatorConfig


class RoundRunner:
    """Runs rounds on a `SyncService`'s loop for one peer."""

    def __init__(
        self, service: SyncService, codec: Codec, settings: RoundSettings, sent: SentRounds | None = None
    ):
        self.service = service
        self.codec = codec
        self.settings = settings
        #: the rounds we sent a part for, this life and (kept on disk) earlier ones
        self.sent = sent if sent is not None else SentRounds(None)
        self.me = service.peer_id
        wait = settings.averaging_timeout_seconds + settings.report_timeout_seconds
        self.sitting_out = SittingOut(service, self.sent, wait)
        self.stragglers = StragglerBound(self.sent.path.parent if self.sent.path else None, self.sent.run_id)
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
    ):
        """Starts a round in the background; returns a concurrent future of its `RoundResult`."""
        own = delta.detach().to(torch.float32).reshape(-1).clone()
        members = sorted(set(members) | {self.me})
        return self.service.submit(self._run(key, own, float(weight), members, state_digest))

    async def _run(self, key, own, weight, members, state_digest):
        started = time.monotonic()
        # this round's own bytes: rounds of a path's modules run at once on one service, so the
        # service's totals would count each other's traffic
        self._sent[key] = 0
        try:
            result = await self._round(key, own, weight, members, state_digest)
        except Exception as e:  # a round must never kill the peer: it goes on with its own Δ
            logger.exception(f"round {key} failed")
            result = RoundResult("failed", own, 1, detail=f"{type(e).__name__}: {e}")
        result.seconds = time.monotonic() - started
        result.bytes_sent = self._sent.pop(key, 0)
        deliveries = self.service.inbox.slot(key).deliveries
        result.bytes_received = sum(d.wire_bytes for s, d in deliveries.items() if s != self.me)
        return result

    async def _round(self, key, own, weight, members, state_digest):
        loop = asyncio.get_running_loop()
        inbox = self.service.inbox
        # a holder that already sent us its Δ for this round is a member, whatever our view said
        others = sorted({m for m in members if m != self.me} | set(inbox.slot(key).deliveries) - {self.me})
        if not others:
            inbox.slot(key).decided_with = frozenset([self.me])
            return RoundResult("alone", own, 1, detail="no other holder", members=[self.me])
        if self.sitting_out.sent_already(key):  # never a second report: peer/sync/sitting_out.py
            how, ahead = await self.sitting_out.sit(key, others)
            if how == "behind":
                return RoundResult("behind", own, 1, detail="sent already", ahead=ahead, members=[self.me])
            inbox.slot(key).decided_with = frozenset([self.me])
            if how == "void":  # every member sat it out: none applies a part, so the copies stay alike
                return RoundResult("excluded", torch.zeros_like(own), 1, detail=VOID, members=[self.me])
            return RoundResult("alone", own, 1, detail="sent already; nobody got past it", members=[self.me])
        token = inbox.standing.own_token
        # encoded (and read back, as the others will) off the training thread and the event loop
        payload = await loop.run_in_executor(None, self.codec.encode, own)
        decoded = await loop.run_in_executor(None, self.codec.decode, payload, own.numel())
        # on disk before the part leaves: a restart must never send and sign this round again
        await loop.run_in_executor(None, self.sent.record, *key)
        digest = delivery_digest(weight, token, payload)
        mine = Delivery(self.me, weight, digest, decoded, len(payload), token, payload)
        inbox.add_delivery(key, mine)
        failed: dict[str, str] = {}
        took: set[str] = set()  # members that accepted our Δ: they are at this round too
        sends = await self._gather(key, own, weight, payload, token, others, failed, took)
        slot = inbox.slot(key)
        logger.debug(f"{key}: gathered {sorted(slot.deliveries)} of {others}, failed {failed}")
        for m, why in slot.refused.items():
            failed.setdefault(m, f"its part was refused ({why})")
        received = {s: d.digest for s, d in slot.deliveries.items()}
        sends += await self._report(key, received, state_digest, token, others)
        # our sends go on until their own deadlines: a member that is late still needs our Δ and
        # report to agree with us (cancelling a report that crossed its twin loses it)
        self._keep(sends)
        result = await self._decide(key, own, members, state_digest, failed, took)
        result.sent = mine.delta
        slot.decided_with = frozenset([*others, self.me])
        return result

    async def _gather(self, key, own, weight, payload, token, others, failed, took) -> list[asyncio.Task]:
        """Sends our Δ to every other member and waits for theirs (or their absence)."""
        loop = asyncio.get_running_loop()
        inbox = self.service.inbox
        header = wire.DeltaHeader(
            run=self.service.run, key=wire.RoundKey(module=key[0], fragment=key[1], round=key[2]),
            weight=weight, codec=self.codec.spec.name, numel=own.numel(), payload_bytes=len(payload),
            admission=token,
        )  # fmt: skip
        frames = [wire.pack_header(Kind.DELTA, header), wire.pack(Kind.PAYLOAD, payload)]
        started = loop.time()
        deadline = started + self.settings.averaging_timeout_seconds
        # a member we left out as late came after all: we run ahead of a slower group, wait longer
        self.stragglers.check_ran_ahead(key, inbox.came_after.get(key[:2], {}))
        bound = self.stragglers.seconds()  # peer/sync/stragglers.py
        sends = [asyncio.create_task(self._send(m, frames, deadline, failed, key, took=took)) for m in others]
        round_failed, answered = failed, set()  # the call after the gather passes `failed` = {}

        def answer(slot, failed=failed, took=took) -> bool:
            # a holder that sent us its part gets ours: one we did not count (it began later) and one
            # our part did not reach (a restarted peer, still starting when we sent); each waits for it
            for s in [s for s in slot.deliveries if s != self.me and s not in answered]:
                if s not in others or round_failed.get(s, "").startswith("unreachable"):
                    answered.add(s)
                    if s in others:
                        failed.pop(s, None)  # recorded anew if it fails again
                    else:
                        others.append(s)
                    sends.append(asyncio.create_task(self._answer(s, frames, deadline, failed, key, took)))
            return inbox.current.get(key[:2], 0) > key[2]  # past the round here: its parts are refused

        def gathered(slot) -> bool:
            answer(slot)
            for m in others:
                # a member that said it stops holding the module (moving or leaving), or whose claim
                # went, will not send its own: waiting for it would hold the round, and our own
                # shutdown, until the averaging timeout
                if m not in slot.deliveries and m not in failed and inbox.gone(m, key[0]):
                    failed[m] = LEFT
                elif m not in slot.deliveries and m not in failed and m in slot.sat_out:
                    failed[m] = SAT_OUT
                elif m not in slot.deliveries and m not in failed and inbox.holds_up(m, key):
                    failed[m] = HELD  # its training waits for ours, which waits for this round
            # a member that refused our Δ (it banned us, or found it malformed) is still in the round
            # and sends its own: wait for it, or our report would leave it out while others keep it
            waiting = [
                m
                for m in others
                if not (m in slot.deliveries or m in slot.refused or failed.get(m, "").startswith(GONE))
            ]
            late = bound is not None and loop.time() - started > bound
            # a part whose header came is on its way (a slowed link), not held back: waited for until
            # the timeout, or the members it reached in time and those it did not would split
            for m in waiting if late else []:
                if m not in slot.incoming:
                    failed.setdefault(m, StragglerBound.why(bound))
            return not waiting or (late and not any(m in slot.incoming for m in waiting))

        slot = inbox.slot(key)

        def silent() -> list[str]:
            waited = set(slot.deliveries) | set(slot.refused) | set(failed)
            return [m for m in others if m not in waited]

        await wait_probing(self.service, key, gathered, silent, failed, deadline)
        # one whose part comes after our gather (it began later) counts us a member and waits for ours
        sends.append(asyncio.create_task(inbox.wait(key, lambda s: answer(s, {}, None), deadline)))
        if all(m in slot.deliveries for m in others):
            self.stragglers.record(loop.time() - started)
        elif bound is not None and (late := {m for m, w in failed.items() if w == StragglerBound.why(bound)}):
            self.stragglers.left_out(key, late)
        return sends

    async def _answer(self, member: str, frames, deadline: float, failed: dict, key: Key, took) -> None:
        """Our part to a holder whose part came after we sent ours, then our report if signed already:
        else it decides on its report alone and counts its part, which ours left out (copies split)."""
        await self._send(member, frames, deadline, failed, key, took=took)
        if (report := self.service.inbox.slot(key).reports.reports.get(self.me)) is not None:
            await self._send(member, [wire.pack_header(Kind.REPORT, report)], deadline, {}, key, report=True)

    async def _report(self, key, received, state_digest, token, others) -> list[asyncio.Task]:
        """Signs and sends our report, waits for the others', then names every report we hold to each
        member (an echo) and sends it those it lacks."""
        loop = asyncio.get_running_loop()
        inbox, service = self.service.inbox, self.service
        slot = inbox.slot(key)
        round_key = wire.RoundKey(module=key[0], fragment=key[1], round=key[2])
        report = wire.Report(
            run=service.run, key=round_key, received=received, state_digest=state_digest, admission=token
        )
        report = await loop.run_in_executor(None, sign_report, report, service.key, self.me)
        slot.reports.add(report)
        inbox.keep_own_report(key, report)  # for a member our push misses (`probe.request_report`)
        deadline = loop.time() + self.settings.report_timeout_seconds
        frames = [wire.pack_header(Kind.REPORT, report)]
        push = {m: self._send(m, frames, deadline, {}, key, report=True) for m in others}
        pushes = {m: asyncio.create_task(c) for m, c in push.items()}
        sends = list(pushes.values())
        reporters = [s for s in received if s != self.me]  # members alive enough to have sent us their Δ
        dead: dict[str, str] = {}  # a member killed after its part came: its host refuses our probe

        def silent() -> list[str]:
            # a member that sat the round out sent its part before (a restart ago) and reports no more
            return [
                r
                for r in reporters
                if r not in slot.reports.reports and r not in dead and r not in slot.sat_out
            ]

        await wait_probing(service, key, lambda slot: not silent(), silent, dead, deadline, reports=True)
        logger.debug(f"{key}: reports from {sorted(slot.reports.reports)} of {reporters}")
        # the echo: every report we hold (both of an equivocator's), by digest, to every member that
        # reported; its own report too: if it signed another for others, that is how it learns it was
        # caught and leaves itself out as well
        held = list(slot.reports.reports.values()) + [b for _, b in slot.reports.equivocators.values()]
        echo = wire.Echo(run=service.run, key=round_key, held=[(r.reporter, report_digest(r)) for r in held])
        targets = sorted(r for r in slot.reports.reports if r != self.me and r in received)
        echo_deadline = loop.time() + self.settings.report_timeout_seconds
        gone: dict[str, str] = {}  # killed after it reported: our echo to it or our probe finds so
        for m in targets:
            relay = send_echo(service, m, echo, held, echo_deadline, key, pushes.get(m), self._sent, gone)
            sends.append(asyncio.create_task(relay))
        # a member echoes only to those whose part it received (one whose report leaves ours out sends
        # us none); one found gone sends none either: waiting held every other holder the report timeout
        echoing = [m for m in targets if self.me in slot.reports.reports[m].received]

        def unechoed() -> list[str]:
            return [m for m in echoing if m not in slot.echoes and m not in gone]

        await wait_probing(service, key, lambda slot: not unechoed(), unechoed, gone, echo_deadline)
        return sends

    async def _send(
        self,
        member: str,
        frames,
        deadline: float,
        failed: dict,
        key: Key,
        report=False,
        took: set | None = None,
    ) -> None:
        """Delivers `frames` to `member` before `deadline`, again while it refuses as not yet ready for
        them; `report`: our report (if lost, it is asked for)."""
        loop = asyncio.get_running_loop()
        while True:
            remaining = deadline - loop.time()
            try:
                if report:
                    fault_point("sync.push_report")
                ack = await self.service.request(member, frames, max(0.1, remaining), self._sent, key)
            except Exception as e:  # unreachable, stalled, or gone: don't wait for it
                failed[member] = f"unreachable ({type(e).__name__})"
                self.service.inbox.unreachable(member)
                break
            # "duplicate": it holds our part (our first send's ACK was lost on our side), as "ok" says
            if ack.ok or (not report and ack.reason.startswith("duplicate")):
                if took is not None:
                    took.add(member)
                break
            if ack.reason.startswith("not_held"):  # it left the module, as its BYE (on its way) says
                failed[member] = LEFT  # its word about itself; waited for, it held a mover's partner 5 s
                break
            # "ahead": it is behind, catching up; "not_holder": its claim view lacks our claim (renewed
            # every heartbeat): both take our Δ in a moment. "stale": the round is over there (it is ahead)
            waiting = ack.reason.startswith(("ahead", "not_holder"))
            logger.debug(f"{key}: {member} refused our frames ({ack.reason}), retrying: {waiting}")
            if waiting and deadline - loop.time() > RETRY_SECONDS:
                await asyncio.sleep(RETRY_SECONDS)
                continue
            failed[member] = "ahead" if ack.reason.startswith("stale") else f"refused ({ack.reason})"
            break
        if not report:
            self.service.inbox.slot(key).changed.set()

    async def _decide(self, key, own, members, state_digest, failed, took) -> RoundResult:
        inbox = self.service.inbox
        standing = inbox.standing
        ahead = past_round(standing, failed, took)
        if ahead:  # others finished this round without us: catch up rather than go on alone
            detail = f"{len(ahead)} members are past this round"
            return RoundResult("behind", own, 1, members=[self.me], ahead=ahead, detail=detail)
        slot = inbox.slot(key)
        honest = slot.reports.honest()
        caught = set(slot.reports.equivocators)
        voters = standing.voters({r: rep.admission for r, rep in honest.items()})
        agreed = agreed_parts(slot, voters, caught)
        parts = {
            s: slot.deliveries[s]
            for s, d in agreed.items()
            if s in slot.deliveries and slot.deliveries[s].digest == d
        }
        for sender in sorted(set(agreed) - set(parts)):  # agreed, but we lack it or hold another copy
            holders = [v for v in voters if v != self.me and honest[v].received.get(sender) == agreed[sender]]
            wait = self.settings.report_timeout_seconds
            got = await fetch_part(self.service, key, sender, agreed[sender], holders, own.numel(), wait)
            if got is not None:
                parts[sender] = got
        dropped = self._dropped(key, members, parts, agreed, caught, failed, slot)
        if not parts:  # nothing the voters agree on: go on with our own
            detail, behind = "no part a majority of voters agreed on", lagging(standing, failed, took)
            return RoundResult("alone", own, 1, dropped=dropped, detail=detail, lagging=behind)
        aggregated, taken = await combine(parts, standing, self.settings.aggregator)
        inbox.keep_parts(key, parts)
        inbox.note_accepted(key[0], taken)  # what an authority asks when it weighs a key's probation
        repair, merge_with = copies_verdict(honest, voters, self.me, state_digest)
        unfetched = sorted(set(agreed) - set(parts))
        if unfetched:
            outcome, detail = (
                "incomplete",
                f"agreed parts of {', '.join(u[:12] for u in unfetched)} not fetched",
            )
        elif self.me not in parts:
            outcome, detail = "excluded", "our outer gradient did not reach a majority of the voters in time"
        elif len(parts) == 1:  # say why nobody else's part is in: the log line is all a user sees
            outcome = "alone"
            detail = "; ".join(f"{m[:12]}: {why}" for m, why in sorted(dropped.items())) or "no other part"
        else:
            outcome, detail = "averaged", ""
        if dropped:  # said by the caller (PathSync), which knows whether we are still joining
            logger.debug(f"{key}: left out of the average: {dropped}")
        return RoundResult(
            outcome, aggregated, len(parts), members=sorted(parts), dropped=dropped, repair_from=repair,
            merge_with=merge_with, detail=detail, lagging=lagging(standing, failed, took),
        )  # fmt: skip

    def _dropped(self, key, members, parts, agreed, caught, failed, slot) -> dict[str, str]:
        """Why each expected member's part is not in the aggregate."""
        dropped = {}
        for m in members:
            if m in parts:
                continue
            if m in caught:
                dropped[m] = "equivocated (sent members different reports)"
            elif m in agreed:
                dropped[m] = "agreed, but its part could not be fetched"
            elif m in slot.deliveries or any(m in r.received for r in slot.reports.reports.values()):
                dropped[m] = "disputed (no majority of voters received the same)"
            elif m in slot.sat_out:
                dropped[m] = SAT_OUT
            else:
                gone = self.service.inbox.gone(m, key[0])
                dropped[m] = LEFT if gone else failed.get(m, "missing")
        return dropped
