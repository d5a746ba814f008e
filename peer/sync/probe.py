"""Is a silent member still there? While a round waits for a member's part or report, it asks the
member every `PROBE_SECONDS` whether it answers at all (a standing query: one small frame and an
ACK). A peer killed mid-round sends nothing and says nothing, but its host refuses the connection at
once: it is not waited for up to the averaging or report timeout. A slow answer is no verdict (a busy
peer is not a gone one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from peer.sync import wire
from peer.sync.service import SyncService
from peer.sync.wire import Kind

PROBE_SECONDS = 2.0
PROBE_TIMEOUT_SECONDS = 5.0


async def probe_silent(
    service: SyncService,
    key: tuple[str, int, int],
    silent: Callable[[], list[str]],
    failed: dict[str, str],
    deadline: float,
) -> None:
    """Until `deadline` (the loop's clock), every PROBE_SECONDS asks each member `silent()` names (those
    still awaited) whether it answers; one whose host refuses us goes into `failed` as unreachable,
    and the round's slot is woken so that its wait looks again."""
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

    while loop.time() + PROBE_SECONDS < deadline:
        await asyncio.sleep(PROBE_SECONDS)
        await asyncio.gather(*(ask(m) for m in silent()))
