"""Is a silent member still there? While a round waits for a member's part or report, it asks the
member after `PROBE_FIRST_SECONDS`, then every `PROBE_SECONDS`, whether it answers at all (a standing
query: one small frame and an ACK). A peer killed mid-round sends nothing and says nothing, but its
host refuses the connection at once: it is not waited for up to the averaging or report timeout. A
slow answer is no verdict (a busy peer is not a gone one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from peer.sync import wire
from peer.sync.service import SyncService
from peer.sync.wire import Kind

#: the first question, soon after the wait began: a member killed before the round began is found
#: within this (its host refuses the dial), instead of at the straggler bound (5 s or more)
PROBE_FIRST_SECONDS = 0.5
PROBE_SECONDS = 1.0
PROBE_TIMEOUT_SECONDS = 5.0


async def probe_silent(
    service: SyncService,
    key: tuple[str, int, int],
    silent: Callable[[], list[str]],
    failed: dict[str, str],
    deadline: float,
) -> None:
    """Until `deadline` (the loop's clock), from PROBE_FIRST_SECONDS on, every PROBE_SECONDS asks each
    member `silent()` names (those still awaited) whether it answers; one whose host refuses us goes
    into `failed` as unreachable, and the round's slot is woken so that its wait looks again."""
    loop = asyncio.get_running_loop()
    slot = service.inbox.slot(key)
    query = wire.StandingQuery(run=service.run, module=key[0], peer=service.peer_id)
    frames = [wire.pack_header(Kind.STANDING, query)]

    async def ask(member: str) -> None:
        try:
            await service.request(member, frames, PROBE_TIMEOUT_SECONDS)
        except TimeoutError:
            return
        except Exception as e:  # the dial failed or the stream was reset: nobody is there
            if member in silent():
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
