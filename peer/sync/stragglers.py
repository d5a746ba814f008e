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


class StragglerBound:
    """The recent full rounds' gather times, and the wait they allow for a missing member."""

    def __init__(self) -> None:
        self._seconds: deque[float] = deque(maxlen=WINDOW)

    def record(self, seconds: float) -> None:
        """A gather in which every member's part came took `seconds`."""
        self._seconds.append(seconds)

    def seconds(self) -> float | None:
        """How long a missing member is waited for now (None: no bound yet but the timeout)."""
        if len(self._seconds) < MIN_ROUNDS:
            return None
        return max(MIN_SECONDS, MULTIPLE * statistics.median(self._seconds))

    @staticmethod
    def why(seconds: float) -> str:
        return f"late (its part missing after {seconds:.1f} s, {MULTIPLE:g}x the recent rounds' gathers)"
