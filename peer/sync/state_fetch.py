"""Fetching a module's state for a joiner: in parts from several holders at once, then confirmed.

A joiner's download is the largest transfer a peer makes (θ̄ and momentum of every module of its
path: 8 bytes per parameter), and a volunteer's uplink is the narrow end of most home lines. So the
state is cut into pieces and every donor at the top round serves pieces in parallel, a faster donor
taking more of them (each pulls the next piece when one of its two in flight arrived); a donor that fails
or stalls hands its piece back to the others. A single donor sends its pieces one after another: no
stream has to outlast a donor's stream timeout, however big the state or slow the link. Every piece
names the state it belongs to by fragment rounds, and a donor whose own copy moves on during the
download keeps serving the state it started with (`state_transfer.PIN_SECONDS`), so the pieces add
up to one state.

Nothing a donor sends is believed: the assembled state's digest is confirmed by the holders as a
whole (`confirmed`), so one donor's bad piece spoils only that attempt. If the striped download
fails or is not confirmed, the state is taken from one donor after another, each state confirmed by
the others: that path finds an honest donor whatever the others do, striping only makes the common
case fast.

Who confirms is decided by standing (`peer.sync.standing`), never by a number of keys: confirmers
are the admitted holders among the donors (all of them only where none is admitted), never the
donor that sent the whole state itself; a state counts as confirmed when at least one of them says
"this was my state" and more say so than say "mine differs" — "unknown" is not a yes and a tie is
not a yes. Only where the state's sender is the sole voice with standing (the module's only admitted
holder, or a keeper when no holder is left) is it loaded unconfirmed: nobody could confirm it, and a
module whose only voice lies is lost to the run whatever the joiner does. The rounds the pieces must
share are fixed by the first piece from a donor with standing, so a stranger racing ahead with
made-up rounds cannot set them. `fetch_module_state` is the one entry point of joiners, repairs,
keepers and `run reroute`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import NamedTuple

import numpy as np
import torch

from peer.config import SyncConfig
from peer.sync.service import SyncService
from peer.sync.state_transfer import (
    CONFIRM_ATTEMPTS,
    confirmed,
    digests_of,
    download_deadline,
    download_range,
    split_state,
)

logger = logging.getLogger(__name__)

#: pieces per donor: enough that a fast donor can take over a slow one's share, and that the last
#: pieces (when some donors are done and idle) are short
PIECES_PER_DONOR = 8
#: pieces a donor sends at once: the next one's request and first bytes overlap the last one's end,
#: so a donor's uplink does not idle for a round trip between pieces
STREAMS_PER_DONOR = 2
#: numbers per piece, at least (1 MiB of float32: a piece's request costs one round trip) and at most
#: (16 MiB: a piece's stream must end within the donor's stream timeout even on a 2 Mbit/s uplink)
MIN_PIECE_NUMBERS = 1 << 18
MAX_PIECE_NUMBERS = 1 << 22
#: donors one striped download uses at most
MAX_STRIPED_DONORS = 8


class Fetched(NamedTuple):
    """A downloaded state: the donors whose bytes are in it, its rounds and tensors, and whether holders
    other than a single donor confirmed it."""

    donors: list[str]
    rounds: list[int]
    tensors: list[torch.Tensor]
    confirmed: bool


def fetch_budget_seconds(numels: list[int], donors: int, timeout: float, confirm_timeout: float) -> float:
    """How long `fetch_confirmed` may take at most: a striped attempt, then one whole download and
    its confirmation per donor."""
    per_try = download_deadline(timeout, sum(numels)) + CONFIRM_ATTEMPTS * (confirm_timeout + 2.0)
    return (donors + 1) * per_try + 30.0


def pieces(total: int, donors: int) -> list[tuple[int, int]]:
    size = min(MAX_PIECE_NUMBERS, max(MIN_PIECE_NUMBERS, math.ceil(total / (PIECES_PER_DONOR * donors))))
    return [(a, min(total, a + size)) for a in range(0, total, size)]


async def fetch_striped(
    service: SyncService, module: str, numels: list[int], donors: list[str], timeout: float
) -> tuple[list[str], list[int], np.ndarray] | None:
    """A state assembled from pieces served by `donors` in parallel, all of the same fragment rounds
    (those of the first piece to arrive from a donor with standing); None if some piece could not be
    had. Not yet confirmed."""
    total = sum(numels)
    # donors whose first piece fixes the rounds (any of them, where none has standing: the state is
    # confirmed or refused as a whole anyway)
    setters = set(service.inbox.standing.trusted(donors)) or set(donors)
    todo = pieces(total, len(donors))
    out = np.empty(total, dtype=np.float32)
    target: list[int] | None = None
    remaining = len(todo)
    contributors: list[str] = []
    # set when a piece is handed back or the last one is in: an idle worker waits for that, not on a
    # timer (a 50 ms poll made every one-piece download of a mover's module 25–40 ms longer, session 51)
    changed = asyncio.Event()

    def hand_back(piece: tuple[int, int]) -> None:
        todo.append(piece)
        changed.set()

    async def worker(donor: str) -> None:
        nonlocal target, remaining
        while remaining > 0:
            if not todo:
                changed.clear()
                await changed.wait()  # pieces in flight elsewhere may come back
                continue
            start, stop = todo.pop(0)
            try:
                rounds, numbers = await download_range(
                    service, donor, module, numels, start, stop, timeout, target
                )
            except Exception as e:
                hand_back((start, stop))
                logger.info(f"{module}: {donor} stopped serving pieces: {type(e).__name__}: {e}")
                return
            if target is None and donor not in setters:  # a stranger's rounds are not the target
                hand_back((start, stop))
                await asyncio.sleep(0.05)
                continue
            if target is None:
                target = rounds
            elif rounds != target:  # asked before the target was known, and at another state
                hand_back((start, stop))
                continue
            out[start:stop] = numbers
            remaining -= 1
            if remaining == 0:
                changed.set()
            if donor not in contributors:
                contributors.append(donor)

    await asyncio.gather(*(worker(d) for d in donors for _ in range(STREAMS_PER_DONOR)))
    if remaining > 0 or target is None:
        return None
    return contributors, target, out


async def fetch_confirmed(
    service: SyncService,
    module: str,
    numels: list[int],
    donors: list[str],
    timeout: float,
    confirm_timeout: float,
    holders: list[str] | None = None,
) -> Fetched | None:
    """A module's state that the holders with standing confirm: pieced from all donors at once when
    there are several, else (or if that fails) from one donor after another, each state confirmed by
    the others (or by `holders`, when the holders who may confirm are more than the donors). A sole
    voice with standing gives an unconfirmed state (`confirmed` False)."""
    standing = service.inbox.standing
    # never ourselves: a round's lists of members ahead can name our own key (a report of ours from
    # before a download), and a peer neither downloads from nor confirms its own state
    donors = [d for d in donors if d != service.peer_id]
    trusted = standing.trusted(sorted((set(donors) | set(holders or [])) - {service.peer_id}))
    if not trusted:  # nobody here could confirm a state, nor be its only voice
        logger.warning(f"{module}: none of its {len(donors)} donor(s) has standing in the run; not fetching")
        return None
    donors = sorted(donors, key=lambda d: d not in trusted)  # donors with standing first, in order
    attempts = ([donors[:MAX_STRIPED_DONORS]] if len(donors) > 1 else []) + [[d] for d in donors]
    for group in attempts:
        got = await fetch_striped(service, module, numels, group, timeout)
        if got is None:
            logger.warning(f"{module}: state download from {', '.join(group)} failed")
            continue
        contributors, rounds, numbers = got
        tensors = split_state(numbers, numels)
        # a state one donor sent whole is never confirmed by that donor; pieces of several donors are
        # confirmed by each (each holds the whole state it sent parts of)
        sole = contributors[0] if len(contributors) == 1 else None
        confirmers = [c for c in trusted if c != sole]
        if not confirmers:
            if sole in trusted:  # the only voice with standing: nobody could confirm it
                return Fetched(contributors, rounds, tensors, False)
            continue
        if await confirmed(service, module, rounds, digests_of(tensors), confirmers, confirm_timeout):
            return Fetched(contributors, rounds, tensors, True)
        logger.warning(
            f"{module}: no holder with standing confirms the state {', '.join(contributors)} sent; refused"
        )
        service.refused["unconfirmed"] += 1
    return None


def fetch_module_state(
    service: SyncService, module: str, numels: list[int], donors: list[str], sync: SyncConfig
) -> Fetched | None:
    """`fetch_confirmed` from a thread other than the service's loop, within its time budget: the one
    way joiners, repairs, keepers and `run reroute` take a module's state from its holders."""
    timeout, confirm = sync.averaging_timeout_seconds, sync.report_timeout_seconds
    coro = fetch_confirmed(service, module, numels, donors, timeout, confirm)
    return service.call(coro, fetch_budget_seconds(numels, len(donors), timeout, confirm))
