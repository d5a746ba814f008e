"""A module just downloaded to join (or rejoin) its holders, while their views of it settle.

The holders see a joiner's claim at different moments, so for a round or two its group can differ
between members: one averages with it, another without; a holder that does not see it yet decides
its round alone. `settle` keeps what is expected then (a dropped member, a repair) at INFO and
counts the settling down; `went_on_without_us` tells a joiner whose first rounds its holders
decided without it to take their copy rather than apply its own Δ beside theirs.
"""

from __future__ import annotations

import logging

from peer.sync.agreement import LEFT
from peer.sync.module_sync import ModuleSync
from peer.sync.rounds import RoundResult

#: rounds after a joiner's download in which a dropped member or a repair is expected, not a fault:
#: the holders see the joiner's claim at different moments, so its first round's group can differ
#: between members (one averages with it, another without), and the next round's digests repair it
SETTLING_ROUNDS = 3


def settle(ms: ModuleSync, result: RoundResult) -> int:
    """The log level of a round's dropped members and repair: INFO while the module is settling after
    a join (the group's views of its members still differ), WARNING for a copy that was in step and
    then drifted. A clean average ends the settling; each other round shortens it."""
    level = logging.INFO if ms.settling > 0 else logging.WARNING
    odd = result.dropped or result.repair_from or result.merge_with
    ms.settling = 0 if result.outcome == "averaged" and not odd else max(0, ms.settling - 1)
    return level


def went_on_without_us(ms: ModuleSync, result: RoundResult) -> list[str]:
    """Just after we joined a module, its other holders may decide a round before they see our claim
    (each alone): applying our own Δ would split our copy from theirs, so we take theirs instead."""
    if ms.settling == 0 or result.outcome != "alone":
        return []
    return sorted(m for m, why in result.dropped.items() if why != LEFT)
