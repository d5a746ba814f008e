"""Rounds this peer sent its part and report for already (`SittingOut`): it never signs a second
report for one (the others would catch it as an equivocator and ban it for ten minutes). Rounds whose
members left it out while it started (`SyncService.left_out`) are sat out the same way: joined, it
would decide on a set of parts and reports its members did not.

A round comes back after a restart (the previous life sent it, then was killed mid-round) or after a
download set the state back to it (the holders were still in it when we went on alone). The first
time, the peer sits it out: it tells the other members (`Kind.SIT_OUT`) that it sends nothing more
for the round, so they stop waiting for its part and report at once (it answers their probes: it is
silent, not gone), and it waits until they are past the round, then takes their state; a member
that applied the round already answers the notice so (`wire.PAST_ROUND`), which ends the wait at
once (its next part may be far off: held up by a round of another module that our training, held
at this round's end, holds up in turn). If that state
is still at the round (nobody got past it) it goes on the second time, sending nothing: when every
other member sat the round out too (all had sent it before being killed, a double kill of a pair)
with no part at all, as each of them does, so that their copies stay alike; else alone with its own
Δ, and the next round's digests reconcile the copies.

While it waits, it asks the members it waits for whether they answer at all (`probe_silent`): when
every one that is not sitting the round out too is gone (its host refuses us: killed and not back
yet), nobody can get past the round, so it goes on alone at once, as the second time would. The
wait was the averaging plus report timeouts, and its training waited with it at the round's end
while the other modules' groups waited for its next parts (churn at τ > 0, where most kills fall
between a part sent and the round applied: a restarted peer whose module partner was killed with
it sat 20 s, and the survivors left it out as late for 5 s in four rounds in a row). A gone member
that comes back sits the round out too and finds us past it: it takes our state. One that answers
it is starting is not gone: it may have applied the round before it was killed (we would split
from it), and once it trains it sends a part of the next round or sits the round out too. One that
sends a part of an earlier round (`SyncService.behind`: its checkpoint was older than ours) has not
applied this one and cannot get past it but by taking our state: it is not waited for either (a
churn run held a sitter 7.5 s so, and its fragment's other rounds, which waited on the partner's
training, and the survivors' on the sitter's, 5 s each).
"""

from __future__ import annotations

import asyncio
import logging

from peer.sync import wire
from peer.sync.inbox import Key
from peer.sync.probe import wait_probing
from peer.sync.sent_rounds import SentRounds
from peer.sync.service import SyncService
from peer.sync.wire import Kind

logger = logging.getLogger(__name__)

#: the detail of a round every member sat out the second time (the outcome "excluded", a zero Δ)
VOID = "sent already, as every member: nobody's part is applied"


class SittingOut:
    """Decides what a member does at a round it sent already, on the sync service's loop."""

    def __init__(self, service: SyncService, sent: SentRounds, wait_seconds: float):
        """`wait_seconds`: how long a sit-out waits at most for the others to get past the round (the
        round's averaging plus report timeouts)."""
        self.service = service
        self.sent = sent
        self.wait_seconds = wait_seconds
        self.me = service.peer_id
        #: rounds we sat out once in this life: the second time goes alone
        self._sat_out: set[Key] = set()
        self._notices: set[asyncio.Task] = set()  # notices still being delivered

    def sent_already(self, key: Key) -> bool:
        """Whether we sit round `key` out: we sent it already, or its members left us out of it while
        we were starting (`SyncService.left_out`: we send nothing for it, as if sent)."""
        return self.sent.sent_already(*key) or key in self.service.left_out

    def after_restart(self, key: Key) -> bool:
        """Whether we sit round `key` out (still, if its round has not ended) because an earlier life
        sent it: from any thread, as the outer loop asks whether a held round may go on by itself
        (`StreamingOuter._detach_sit_outs`). Not one that a download in this life set us back to: a
        mover's, whose partner trains on and waits for its next parts, which a detached module skips
        (the goodput rotation arm, session 51: its partner waited the straggler bound three rounds)."""
        return key in self._sat_out and self.sent.by_earlier_life(*key)

    async def sit(self, key: Key, others: list[str]) -> tuple[str, list[str]]:
        """("behind", whom to take the state from) (we waited until the others were past the round),
        "alone" (we sat it out once already and nobody got past it: go on alone, sending nothing) or
        "void" (as "alone", but every other member sat it out too: none applies a part, the Δ is kept
        as unsent), these two with nobody to take a state from."""
        later = (key[0], key[1], key[2] + 1)
        said_past: set[str] = set()  # members that answered our notice: they applied the round
        self._notify(key, others, said_past, later)
        inbox = self.service.inbox
        sat = inbox.slot(key).sat_out
        if key in self._sat_out:
            if all(o in sat for o in others):
                logger.info(f"{key}: every member sat it out; nobody's part is applied, as at the others")
                return "void", []
            logger.info(f"{key}: sat out once already and nobody got past it; going on alone")
            return "alone", []
        self._sat_out.add(key)
        gone: dict[str, str] = {}  # members whose host refuses us: killed, and not back yet

        def past(slot) -> bool:  # a part of theirs for the next round came, or one said it is past
            return bool(said_past) or any(s != self.me for s in slot.deliveries)

        def behind() -> set[str]:  # sent a part of an earlier round while we were at this one
            return self.service.behind_of(key)

        def awaited() -> list[str]:  # neither sitting it out too (all killed around it), gone nor behind
            return [o for o in others if o not in sat and o not in gone and o not in behind()]

        def settled(slot) -> bool:  # someone got past the round, or nobody is left to
            return past(slot) or not awaited()

        deadline = asyncio.get_running_loop().time() + self.wait_seconds
        # the probe wakes the slot we wait on when it finds a member gone; one that is starting is
        # not gone: it may be past the round (it applied it before it was killed), and would split
        # from a copy we took alone; once it trains, it sends a part of the next round or sits out
        await wait_probing(self.service, later, settled, awaited, gone, deadline, starting_fails=False)
        if (gone or behind()) and not past(inbox.slot(later)) and not awaited():
            # a member behind the round has not applied it (its state is older): it takes ours
            logger.info(
                f"{key}: we sent this round's part already; the others are gone or behind: going on alone"
            )
            return "alone", []
        logger.info(f"{key}: we sent this round's part already; taking the holders' state instead")
        # from those past the round; one sitting it out too is at the round, as we are: its state
        # would bring us back to it, and the second time we would go on alone while the others
        # applied their round (a churn run's trunk split when two restarted holders took each other's)
        past_it = [o for o in others if o in inbox.slot(later).deliveries or o in said_past]
        return "behind", past_it or [o for o in others if o not in sat] or others

    def _notify(self, key: Key, others: list[str], said_past: set[str], later: Key) -> None:
        """Tells each other member, in the background, that we send nothing more for this round; one
        that answers it applied the round already goes into `said_past`, and the wait (on the next
        round's slot) is woken. Its word only ends our wait early: we take its state as state transfer
        allows, as we would once its next part came (which it could send to the same end)."""
        sit = wire.SitOut(
            run=self.service.run, key=wire.RoundKey(module=key[0], fragment=key[1], round=key[2])
        )
        frames = [wire.pack_header(Kind.SIT_OUT, sit)]
        slot = self.service.inbox.slot(later)

        async def tell(member: str) -> None:
            try:
                ack = await self.service.request(member, frames, self.wait_seconds)
            except Exception as e:  # gone or slow: the probes see to that
                logger.debug(f"{key}: the sit-out notice to {member} failed: {type(e).__name__}: {e}")
                return
            if not ack.ok and ack.reason == wire.PAST_ROUND:
                said_past.add(member)
                slot.changed.set()

        # a member that does not take it is gone or past the round: it does not wait for us either way
        for member in others:
            task = asyncio.create_task(tell(member))
            self._notices.add(task)
            task.add_done_callback(self._notices.discard)
