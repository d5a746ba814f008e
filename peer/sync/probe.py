"""Is a silent member still there? While a round waits for a member's part or report, it asks the
member after `PROBE_FIRST_SECONDS`, then every `PROBE_SECONDS`, whether it answers at all (a standing
query: one small frame and an ACK). A peer killed mid-round sends nothing and says nothing, but its
host refuses the connection at once: it is not waited for up to the averaging or report timeout. A
slow answer is no verdict (a busy peer is not a gone one). A peer that answers it is starting (a
restart before its first step: `SyncService.training`) cannot send its part in time either: it is
left out at once too, and joins the next round (`StreamingOuter._join_the_group`). A stranger that
says so only leaves itself out.

While a round waits for reports, the question is the report itself (`request_report`): a member
whose part came but whose report did not may have signed it already and failed to push it (we were
down, or restarting, when it tried). Deciding without it, we would count parts its
report leaves out while it applies the set without them: the copies split. A member that answers it
is starting was restarted since it sent its part: its report died with its last life (a round is
signed once), and it applies nothing of the round (it sits it out), so it is not waited for
(`Starting`); its part still counts as the voters' reports agree.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from peer.sync import wire
from peer.sync.inbox import Refused
from peer.sync.service import SyncService
from peer.sync.wire import Ack, Kind

logger = logging.getLogger(__name__)

#: the first question, soon after the wait began: a member killed before the round began is found
#: within this (its host refuses the dial), instead of at the straggler bound (5 s or more)
PROBE_FIRST_SECONDS = 0.5
PROBE_SECONDS = 1.0
PROBE_TIMEOUT_SECONDS = 5.0
#: why a member that answered it is starting is left out (a kind of "unreachable": rounds treat it so)
STARTING_WHY = "unreachable (starting: not training yet)"


async def probe_silent(
    service: SyncService,
    key: tuple[str, int, int],
    silent: Callable[[], list[str]],
    failed: dict[str, str],
    deadline: float,
    reports: bool = False,
    starting_fails: bool = True,
) -> None:
    """Until `deadline` (the loop's clock), from PROBE_FIRST_SECONDS on, every PROBE_SECONDS asks each
    member `silent()` names (those still awaited) whether it answers (`reports`: for its report of the
    round, which goes into the slot once signed); one whose host refuses us goes into `failed` as
    unreachable, and the round's slot is woken so that its wait looks again. So does one that answers
    it is starting (`starting_fails`; else it is asked again: it will know more once it trains)."""
    loop = asyncio.get_running_loop()
    slot = service.inbox.slot(key)
    query = wire.StandingQuery(run=service.run, module=key[0], peer=service.peer_id)
    frames = [wire.pack_header(Kind.STANDING, query)]

    async def ask(member: str) -> None:
        try:
            if not reports:
                ack = await service.request(member, frames, PROBE_TIMEOUT_SECONDS)
                if starting_fails and not ack.ok and ack.reason == wire.STARTING:
                    raise Starting(member)
            elif (report := await request_report(service, key, member, PROBE_TIMEOUT_SECONDS)) is not None:
                service.inbox.add_report(member, report)  # checked as if pushed: signed by the member
        except Starting:  # its part cannot come in time; its report, if it signed one, died with it
            if member in silent():
                failed.setdefault(member, STARTING_WHY)
                slot.changed.set()
        except Exception as e:
            if isinstance(e, TimeoutError) or (reports and isinstance(e, (Refused, wire.WireError))):
                logger.debug(f"{key}: {member} is slow, or sent a report we refuse: {type(e).__name__}: {e}")
                return
            if member in silent():  # the dial failed or the stream was reset: nobody is there
                failed.setdefault(member, f"unreachable (stopped answering: {type(e).__name__})")
                slot.changed.set()

    # one question in flight per member: a slow answer (up to the probe timeout) holds up nobody
    # else's question
    asking: dict[str, asyncio.Task] = {}
    try:
        await asyncio.sleep(PROBE_FIRST_SECONDS)
        while loop.time() < deadline:
            for member in silent():
                if member not in asking or asking[member].done():
                    asking[member] = asyncio.create_task(ask(member))
            await asyncio.sleep(PROBE_SECONDS)
    finally:
        for task in asking.values():
            task.cancel()


async def wait_probing(
    service: SyncService,
    key: tuple[str, int, int],
    until: Callable,
    silent: Callable[[], list[str]],
    failed: dict[str, str],
    deadline: float,
    **probe,
) -> bool:
    """`service.inbox.wait(key, until, deadline)` while `probe_silent` asks the members `silent()`
    names (`probe`: its `reports` and `starting_fails`), so that a gone one ends the wait early."""
    asking = asyncio.create_task(probe_silent(service, key, silent, failed, deadline, **probe))
    try:
        return await service.inbox.wait(key, until, deadline)
    finally:
        asking.cancel()


class Starting(Exception):
    """A member asked answered it is starting (before its first inner step). Asked for its part, it
    cannot send one in time; asked for its report, it was restarted since it sent its part (it has
    run no round in this life) and its report will never come: waiting for it held every survivor of
    a kill up to 5 s, until the restarted member's first step sat the round out."""


async def request_report(service: SyncService, key: tuple[str, int, int], member: str, timeout: float):
    """`member`'s own signed report of round `key`, or None while it has signed none; raises if the
    member cannot be reached or answers outside the protocol, and `Starting` if it answers it is
    starting."""
    request = wire.ReportRequest(
        run=service.run, key=wire.RoundKey(module=key[0], fragment=key[1], round=key[2])
    )

    async def ask() -> wire.Report | None:
        reader, writer = await service.open(member, [wire.pack_header(Kind.REPORT_REQUEST, request)], timeout)
        try:
            try:
                _, body = await wire.read_frame(reader, {Kind.ACK}, wire.MAX_HEADER_BYTES)
            except (asyncio.IncompleteReadError, ConnectionError):
                return None  # it took the stream and closed it: there, but not answering this (an older peer)
            if not (ack := wire.parse(Ack, body)).ok:
                if ack.reason == wire.STARTING:
                    raise Starting(member)
                return None
            _, body = await wire.read_frame(reader, {Kind.REPORT}, wire.MAX_HEADER_BYTES)
            service.bytes_received += len(body) + 5
            report = wire.parse(wire.Report, body)
        finally:
            writer.close()
        if report.key != request.key:
            raise wire.WireError(f"{member} sent its report of another round")
        return report

    return await asyncio.wait_for(ask(), timeout)
