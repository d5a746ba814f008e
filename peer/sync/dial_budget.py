"""How many holders nobody has heard from a peer's rounds dial per second (`DialBudget`).

A claim costs a free key nothing, and a round that dials a claimant with no peer behind it waits for
the dial to fail (and spends the CPU of a failed dial) before it decides. The per-round sample of such
holders (`peer.sync.outer.MAX_UNPROVEN_MEMBERS`) bounds what one round pays; but rounds can come many
times a second (small modules, short H), and then a flood of claims made every round of every module
dial two keys that never answer: in the claims_scale benchmark's open run, 7 rounds a second per
module, ~10 failed dials a second per peer. The budget bounds it in time instead: per module, a token
bucket holding at most one round's sample, refilled at `rate` dials per second. A real newcomer is
heard from by its own part (it sends one to every member at once) and needs no dial to join; the
sample is only how claimants that never sent us anything get a try, and a second or two per try is
as good as a round.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: dials of holders never heard from, per module and second, that a peer's rounds make at most
UNPROVEN_DIALS_PER_SECOND = 1.0


class DialBudget:
    """Per module: how many unproven holders the next round may dial (`take`). The bucket starts full:
    a peer's first round tries its whole sample."""

    def __init__(self, rate: float = UNPROVEN_DIALS_PER_SECOND, clock: Callable[[], float] = time.monotonic):
        if rate <= 0:
            raise ValueError(f"unproven dials per second must be positive, got {rate}")
        self.rate = rate
        self.clock = clock
        #: module -> (tokens, at when they were counted); a module first seen has a full bucket
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, module: str, most: int, candidates: int) -> int:
        """How many of `candidates` unproven holders this round dials, its sample being at most `most`
        (the bucket's size); those are spent."""
        now = self.clock()
        tokens, at = self._buckets.get(module, (float(most), now))
        tokens = min(float(most), tokens + (now - at) * self.rate)
        dials = min(int(tokens), candidates)
        self._buckets[module] = (tokens - dials, now)
        return dials
