"""How long a round waits for a member whose part has not come (`StragglerBound`): what the recent
rounds measured, with the averaging timeout only as the ceiling.

A member that answers but does not send (it is catching up from rounds behind, sitting another
module's round out, or its machine stalls) used to hold every other member of the group for the
whole averaging timeout, round after round (a churn run's survivors waited 30 s three rounds in a row
for restarted peers still catching up). The gather phase of the rounds where every member's part came
gives the group's own pace, the wait for a member that is regularly slower included; a missing part
later than `MULTIPLE` times the median of those (and at least `MIN_SECONDS`) is left out as late.
That is safe for the copies: a late part that reaches the other members still counts when a majority
of the voters report it, and a member that lacks an agreed part fetches it; the late member itself
finds the round over and takes the group's state. Until `MIN_ROUNDS` full rounds were measured there
is no bound but the timeout.

The pace is the past: when the group's links slow down (the scheduler_live lab's regions changed), the
others take longer than it allows without being stuck, and a member that leaves them all out as late
runs ahead alone, round after round, at its own speed, never again in a round with them (a run's peer
went alone 11 rounds in a row). So when a member left out as late sends its part for that round after
all, once the round is over here (the inbox refused it as stale: `check_ran_ahead`),
the wait doubles (`cut_short`), up to the averaging timeout, until a round where every part came sets
the pace again: a slower group is caught up with. A member held up by a restart catches up by
fetching state and joins at the current round, so it does not slow the survivors: doubling on every
round that left someone out (tried first) cut the churn arm's tokens to half.
"""

from __future__ import annotations

import statistics
from collections import deque

#: a missing member is waited for at least this long, however fast the recent rounds were
MIN_SECONDS = 5.0
#: ... and this many times the median gather of the recent full rounds
MULTIPLE = 4.0
#: full rounds measured before the bound applies
MIN_ROUNDS = 3
#: recent full rounds remembered
WINDOW = 16
#: the most the wait grows after rounds cut short (5 s x 64: past any averaging timeout in use)
MAX_BACKOFF = 64.0
#: rounds that left a member out as late remembered, to see whether it came after all
LEFT_OUT_REMEMBERED = 8


class StragglerBound:
    """The recent full rounds' gather times, and the wait they allow for a missing member."""

    def __init__(self) -> None:
        self._seconds: deque[float] = deque(maxlen=WINDOW)
        #: doubles each time a member left out as late came after all, 1 again after a full round
        self._backoff = 1.0
        #: recent rounds (module, fragment, round) that left members out as late, and whom
        self._left_out: dict[tuple[str, int, int], set[str]] = {}

    def record(self, seconds: float) -> None:
        """A gather in which every member's part came took `seconds`."""
        self._seconds.append(seconds)
        self._backoff = 1.0

    def left_out(self, key: tuple[str, int, int], members: set[str]) -> None:
        """Round `key` left `members` out as late."""
        self._left_out[key] = members
        while len(self._left_out) > LEFT_OUT_REMEMBERED:
            self._left_out.pop(next(iter(self._left_out)))

    def check_ran_ahead(self, key: tuple[str, int, int], came_after: dict[str, int]) -> None:
        """`came_after`: the fragment's holders whose part came once that round was over here (the
        inbox's stale refusals, holder -> round). One we had left out as late came after all: we run
        ahead of a slower group, not past a stuck member, so the wait doubles (`cut_short`). A member
        restarted or catching up joins at the current round instead and does not slow us."""
        ran_ahead = False
        for past, late in list(self._left_out.items()):
            if past[:2] == key[:2] and any(came_after.get(m) == past[2] for m in late):
                ran_ahead = True
                del self._left_out[past]
        if ran_ahead:
            self.cut_short()

    def cut_short(self) -> None:
        """A round left a member out as late: the next waits twice as long (the caller's deadline,
        the averaging timeout, stays the ceiling; the factor stops growing past it)."""
        self._backoff = min(self._backoff * 2.0, MAX_BACKOFF)

    def seconds(self) -> float | None:
        """How long a missing member is waited for now (None: no bound yet but the timeout)."""
        if len(self._seconds) < MIN_ROUNDS:
            return None
        return max(MIN_SECONDS, MULTIPLE * statistics.median(self._seconds)) * self._backoff

    @staticmethod
    def why(seconds: float) -> str:
        return f"late (its part missing after {seconds:.1f} s, the wait the recent rounds allow)"
