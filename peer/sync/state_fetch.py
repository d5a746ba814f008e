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
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import NamedTuple

import numpy as np
import torch

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
    (those of the first piece to arrive); None if some piece could not be had. Not yet confirmed."""
    total = sum(numels)
    todo = pieces(total, len(donors))
    out = np.empty(total, dtype=np.float32)
    target: list[int] | None = None
    remaining = len(todo)
    contributors: list[str] = []

    async def worker(donor: str) -> None:
        nonlocal target, remaining
        while remaining > 0:
            if not todo:
                await asyncio.sleep(0.05)  # pieces in flight elsewhere may come back
                continue
            start, stop = todo.pop(0)
            try:
                rounds, numbers = await download_range(
                    service, donor, module, numels, start, stop, timeout, target
                )
            except Exception as e:
                todo.append((start, stop))
                logger.info(f"{module}: {donor} stopped serving pieces: {type(e).__name__}: {e}")
                return
            if target is None:
                target = rounds
            elif rounds != target:  # asked before the target was known, and at another state
                todo.append((start, stop))
                continue
            out[start:stop] = numbers
            remaining -= 1
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
) -> Fetched | None:
    """A module's state that the holders confirm: pieced from all donors at once when there are
    several, else (or if that fails) from one donor after another, each state confirmed by the
    others. A single donor with nobody else to ask gives an unconfirmed state (`confirmed` False)."""
    attempts = ([donors[:MAX_STRIPED_DONORS]] if len(donors) > 1 else []) + [[d] for d in donors]
    for group in attempts:
        got = await fetch_striped(service, module, numels, group, timeout)
        if got is None:
            logger.warning(f"{module}: state download from {', '.join(group)} failed")
            continue
        contributors, rounds, numbers = got
        tensors = split_state(numbers, numels)
        # a pieced state is confirmed by all donors (each sent only part of it); one donor's by the others
        confirmers = donors if len(group) > 1 else [d for d in donors if d != group[0]]
        if not confirmers:
            return Fetched(contributors, rounds, tensors, False)
        if await confirmed(service, module, rounds, digests_of(tensors), confirmers, confirm_timeout):
            return Fetched(contributors, rounds, tensors, True)
        logger.warning(
            f"{module}: no other holder confirms the state {', '.join(contributors)} sent; refused"
        )
        service.refused["unconfirmed"] += 1
    return None
