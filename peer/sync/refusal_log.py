"""How a peer says what it refused (`RefusalLog`): a line at WARNING per reason at most once a
minute, with the count of refusals held back since the last line. Any key may send a holder requests
it refuses (a part for a module it holds no claim on, a run it is not in), and each refusal was a
WARNING line: a stranger's flood filled the volunteer's log and disk at the rate it could open
streams. The counts per reason stay exact in the metrics (`SyncService.refused`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger("peer.sync.service")

#: seconds between two lines of one reason
INTERVAL_SECONDS = 60.0


class RefusalLog:
    """Logs refusals at WARNING, one line per reason per `interval_seconds` at most."""

    def __init__(
        self, interval_seconds: float = INTERVAL_SECONDS, clock: Callable[[], float] = time.monotonic
    ):
        self.interval_seconds = interval_seconds
        self.clock = clock
        #: reason -> (when its last line was written, refusals held back since)
        self._last: dict[str, tuple[float, int]] = {}

    def refused(self, reason: str, what: str, sender: str, error: Exception) -> None:
        """A refusal of `what` (the request's kind) from `sender` for `reason`."""
        now = self.clock()
        last = self._last.get(reason)
        if last is not None and now - last[0] < self.interval_seconds:
            self._last[reason] = (last[0], last[1] + 1)
            return
        held = f" ({last[1]} more refused for this reason since the last line)" if last and last[1] else ""
        self._last[reason] = (now, 0)
        logger.warning(f"refused a {what} from {sender}: {error}{held}")
