"""Rounds this peer sent its part and report for already (`SittingOut`): it never signs a second
report for one (the others would catch it as an equivocator and ban it for ten minutes).

A round comes back after a restart (the previous life sent it, then was killed mid-round) or after a
download set the state back to it (the holders were still in it when we went on alone). The first
time, the peer sits it out: it tells the other members (`Kind.SIT_OUT`) that it sends nothing more
for the round, so they stop waiting for its part and report at once (it answers their probes: it is
silent, not gone), and it waits until they are past the round, then takes their state. If that state
is still at the round (nobody got past it) it goes on the second time, sending nothing: when every
other member sat the round out too (all had sent it before being killed, a double kill of a pair)
with no part at all, as each of them does, so that their copies stay alike; else alone with its own
Δ, and the next round's digests reconcile the copies.
"""

from __future__ import annotations

import asyncio
import logging

from peer.sync import wire
from peer.sync.inbox import Key
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
        return self.sent.sent_already(*key)

    async def sit(self, key: Key, others: list[str]) -> str:
        """ "behind" (we waited until the others were past the round: take their state), "alone" (we
        sat it out once already and nobody got past it: go on alone, sending nothing) or "void" (as
        "alone", but every other member sat it out too: none applies a part, the Δ is kept as unsent)."""
        self._notify(key, others)
        inbox = self.service.inbox
        sat = inbox.slot(key).sat_out
        if key in self._sat_out:
            if all(o in sat for o in others):
                logger.info(f"{key}: every member sat it out; nobody's part is applied, as at the others")
                return "void"
            logger.info(f"{key}: sat out once already and nobody got past it; going on alone")
            return "alone"
        self._sat_out.add(key)
        later = (key[0], key[1], key[2] + 1)

        def past_or_all_sitting(slot) -> bool:
            # a part of theirs for the next round came, or every other member sits this one out too
            # (all were killed around it): nobody will get past it
            return any(s != self.me for s in slot.deliveries) or all(o in sat for o in others)

        await inbox.wait(later, past_or_all_sitting, asyncio.get_running_loop().time() + self.wait_seconds)
        logger.info(f"{key}: we sent this round's part already; taking the holders' state instead")
        return "behind"

    def _notify(self, key: Key, others: list[str]) -> None:
        """Tells each other member, in the background, that we send nothing more for this round."""
        sit = wire.SitOut(
            run=self.service.run, key=wire.RoundKey(module=key[0], fragment=key[1], round=key[2])
        )
        frames = [wire.pack_header(Kind.SIT_OUT, sit)]
        # a member that does not take it is gone or past the round: it does not wait for us either way
        task = asyncio.create_task(self.service.ask_each(others, frames, self.wait_seconds))
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)
