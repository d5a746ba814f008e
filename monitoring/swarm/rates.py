"""Throughput measured, not claimed: each peer's tokens/s from the change of its cumulative token
counter over the monitor's own clock.

A peer's claim carries the tokens it trained since it started (`tokens_total`) and the rate it says it
trains at; the rate is its word, and a stale one (held through a minute-long stall) or an inflated
one would be shown as fact. `MeasuredRates` keeps, per peer, the counter it read at each poll and the
monitor's time of that poll; a peer's rate is the counter's increase over the last interval, so a
stall shows as a drop at the next poll, and a counter that went down (the peer restarted without its
checkpoint) starts over. A counter that rises faster than `IMPLAUSIBLE_FACTOR` times the median
measured rate (with at least three peers measured) is flagged and left out of the swarm's total: the
counter is a claim too, and one peer must not outweigh the rest.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict

#: a measured rate this many times the median of the swarm's is flagged as implausible
IMPLAUSIBLE_FACTOR = 10.0
#: peers whose counters are remembered at most (a flood of keys cannot grow the monitor's memory)
MAX_REMEMBERED = 8192


class MeasuredRates:
    """Per-peer tokens/s from counters read at successive polls."""

    def __init__(self) -> None:
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()  # peer -> (monitor time, tokens)

    def update(self, now: float, counters: dict[str, int]) -> tuple[dict[str, float], set[str]]:
        """The measured rate of every peer in `counters` (0 for a peer seen for the first time) and
        the peers whose rate is implausible."""
        rates = {}
        for peer, tokens in counters.items():
            before = self._last.pop(peer, None)
            if before is None or tokens < before[1] or now <= before[0]:
                rates[peer] = 0.0
            else:
                rates[peer] = (tokens - before[1]) / (now - before[0])
            self._last[peer] = (now, tokens)
        while len(self._last) > MAX_REMEMBERED:
            self._last.popitem(last=False)
        for peer in [p for p in self._last if p not in counters]:
            del self._last[peer]  # gone from the claims: a return starts over
        measured = [r for r in rates.values() if r > 0]
        flagged: set[str] = set()
        if len(measured) >= 3:
            limit = IMPLAUSIBLE_FACTOR * statistics.median(measured)
            flagged = {p for p, r in rates.items() if r > limit}
        return rates, flagged
