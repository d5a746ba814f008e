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

The measured gathers are kept beside the rounds sent (`round_pace.json` in the checkpoint directory,
for an hour): a peer restarted with `--resume`, or moved to another path (a new runner), starts with
the pace it had measured instead of none. Without it a restarted peer's first round had no bound but
the timeout: a churn run's restarted peer sat 33 s in its first round while the others, rounds ahead,
left it out, and they waited for it as a straggler meanwhile. It is this peer's own measurement,
read back from its own disk; a file that is not one is ignored with a warning (it is only a pace).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections import deque
from pathlib import Path

logger = logging.getLogger(__name__)

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
#: the file of measured gathers, beside the rounds sent (`peer.sync.sent_rounds`)
FILE_NAME = "round_pace.json"
#: how long a kept pace is used after it was last measured (a day-old pace says little of today's links)
KEPT_SECONDS = 3600.0
#: a gather longer than this is not a pace (an averaging timeout is minutes at most)
MAX_GATHER_SECONDS = 3600.0


class StragglerBound:
    """The recent full rounds' gather times, and the wait they allow for a missing member."""

    def __init__(self, directory: str | os.PathLike | None = None, run_id: str = "") -> None:
        self._seconds: deque[float] = deque(maxlen=WINDOW)
        #: doubles each time a member left out as late came after all, 1 again after a full round
        self._backoff = 1.0
        #: recent rounds (module, fragment, round) that left members out as late, and whom
        self._left_out: dict[tuple[str, int, int], set[str]] = {}
        self.path = Path(directory) / FILE_NAME if directory is not None else None
        self.run_id = run_id
        if self.path is not None:
            self._seconds.extend(self._read())

    def _read(self) -> list[float]:
        """The gathers an earlier life (or runner) of this peer measured in this run, within the hour."""
        try:
            data = json.loads(self.path.read_bytes())
            kept, at = data["gather_seconds"], data["at"]
            ok = isinstance(data["run"], str) and isinstance(kept, list) and len(kept) <= WINDOW
            ok = ok and type(at) is float and math.isfinite(at)
            ok = ok and all(type(x) is float and 0 <= x <= MAX_GATHER_SECONDS for x in kept)
        except FileNotFoundError:
            return []
        except (ValueError, TypeError, KeyError):
            ok = False
        if not ok:
            logger.warning(f"{self.path} is not a record of round gathers; starting without a pace")
            return []
        fresh = data["run"] == self.run_id and 0 <= time.time() - at <= KEPT_SECONDS
        return kept if fresh else []

    def record(self, seconds: float) -> None:
        """A gather in which every member's part came took `seconds` (kept on disk for the next life)."""
        self._seconds.append(seconds)
        self._backoff = 1.0
        if self.path is None or not math.isfinite(seconds):
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:  # a hint for the next life: no fsync; a write that fails costs only the hint
            tmp.write_text(
                json.dumps({"run": self.run_id, "at": time.time(), "gather_seconds": list(self._seconds)})
            )
            os.replace(tmp, self.path)
        except OSError as e:
            logger.debug(f"could not keep the round pace in {self.path}: {e}")

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
