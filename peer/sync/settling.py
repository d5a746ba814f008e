"""A module's first rounds with company: just downloaded to join (or rejoin) its holders, or started
here while its other holders start too (a new swarm), while their views of each other settle.

The holders see a joiner's claim at different moments, so for a round or two its group can differ
between members: one averages with it, another without; a holder that does not see it yet decides
its round alone. Holders of a new swarm start from the same initial weights, but each takes its
first rounds alone until it sees the others' claims, so their copies differ when they first meet
and are merged. `settle` keeps what is expected then (a dropped member, a repair, a merge) at INFO
and counts both graces down; `went_on_without_us` tells a joiner whose first rounds its holders
decided without it to take their copy rather than apply its own Δ beside theirs. Only the log level
and wording depend on `forming`: no decision does.
"""

from __future__ import annotations

import logging

from peer.sync.agreement import LEFT
from peer.sync.module_sync import SETTLING_ROUNDS, ModuleSync
from peer.sync.rounds import RoundResult

__all__ = ["SETTLING_ROUNDS", "first_rounds", "merge_note", "repair_note", "settle", "went_on_without_us"]


def first_rounds(ms: ModuleSync) -> bool:
    """Whether the module is in its first rounds with its group here (joined, or a new swarm)."""
    return ms.settling > 0 or ms.forming > 0


def settle(ms: ModuleSync, result: RoundResult) -> int:
    """The log level of a round's dropped members and repair: INFO in the module's first rounds with
    company (the group's views of its members still differ), WARNING for a copy that was in step and
    then drifted. A clean average ends both graces; each other round shortens the settling after a
    download, and each round with other members expected shortens a fresh module's (rounds alone
    before anyone else holds it are no company)."""
    level = logging.INFO if first_rounds(ms) else logging.WARNING
    odd = result.dropped or result.repair_from or result.merge_with
    clean = result.outcome == "averaged" and not odd
    ms.settling = 0 if clean else max(0, ms.settling - 1)
    company = len(result.members) > 1 or bool(result.dropped)
    ms.forming = 0 if clean else max(0, ms.forming - 1) if company else ms.forming
    return level


def merge_note(ms: ModuleSync, fragment: int, copies: int, members: int) -> tuple[int, str]:
    """How a merge of copies that no majority held is logged. In the module's first rounds with its
    group it is how holders that each started alone meet: INFO, in plain words. After that, copies
    that had been in step split (a healed partition, or a fault): a maintainer must see it."""
    # the round whose reports showed it (not applied yet): one count per split in benchmarks.goodput
    head = (
        f"{ms.module_id} fragment {fragment} round {ms.fragment_rounds[fragment]}: merged the diverged "
        f"copies of {members} members"
    )
    if first_rounds(ms):
        return logging.INFO, (
            f"{head} ({copies} copies: its holders took their first rounds before they saw each other, "
            "as in a new swarm or just after a join; one copy from now on)"
        )
    return logging.WARNING, (
        f"{head}: {copies} copies that had been in step split and no majority holds one (a healed "
        "partition or a fault; see docs/sync-protocol.md)"
    )


def repair_note(ms: ModuleSync, fragment: int, level: int) -> str:
    """How a repair is logged, once the round whose reports showed our copy outside the group's
    majority was applied (`level` from `settle`: INFO just after a join, where it is expected)."""
    why = "just after joining, as expected" if level == logging.INFO else "it drifted"
    done = ms.fragment_rounds[fragment] - 1
    return (
        f"{ms.module_id} fragment {fragment} round {done}: our copy differs from the one the group keeps "
        f"({why}); repairing it"
    )


def went_on_without_us(ms: ModuleSync, result: RoundResult) -> list[str]:
    """Just after we joined a module, its other holders may decide a round before they see our claim
    (each alone): applying our own Δ would split our copy from theirs, so we take theirs instead."""
    if ms.settling == 0 or result.outcome != "alone":
        return []
    return sorted(m for m, why in result.dropped.items() if why != LEFT)
