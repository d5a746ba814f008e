"""Averaging groups for a module held by many peers, rotated across rounds.

A module shared by many paths (the embedding and head are shared by all of them) has many holders;
one all-reduce over all of them pays for the swarm's slowest links every round. Instead, each
round splits the holders into subgroups of about `group_size` and averages inside each.

Layout (after Moshpit SGD, Ryabinin et al. 2021): holders are put in a *locality order*, a
nearest-neighbour chain over the measured links, so that neighbours in the order are well connected.
Position i in that order is written with d = ceil(log_g n) digits (g = group_size) in a mixed
radix whose first digit has base g; in round r the groups are the positions that agree on every
digit except digit r mod d.

Mixing argument. Digit 0 groups are runs of g consecutive holders in the chain: the well-connected
rounds. Digits 1..d-1 bridge those runs at growing distances. If n = g**d, averaging along every
digit once (d consecutive rounds) leaves every holder with the exact mean of all holders (the
same holds whenever n equals the product of the radices), since
averaging a d-dimensional grid along each axis in turn averages it entirely. Otherwise the union of
any d consecutive rounds' groups is still connected: from any position, setting its non-zero digits
to 0 one at a time only decreases it, so every step stays inside the swarm and ends at position 0.
So every holder's update reaches every other holder within d rounds of gossip (and the per-subgroup
copies of the module's global weights differ between those rounds: the drift check has to compare
holders of the same subgroup, not all holders).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from peer.scheduler.cost import Assignment
from peer.scheduler.snapshot import SwarmSnapshot


def locality_order(holders: list[str], snapshot: SwarmSnapshot, group_size: int) -> list[str]:
    """Nearest-neighbour chain from the lowest id: each next holder is the one with the cheapest
    link (alpha + (c / group_size) / beta) to the previous one; ties to the lower id."""
    idx = snapshot.index()
    ix = np.array([idx[p] for p in holders], dtype=np.int64)
    share = snapshot.grid.fragment_bytes / max(group_size, 1)
    with np.errstate(divide="ignore"):
        link = (
            snapshot.latency_seconds[np.ix_(ix, ix)]
            + share / snapshot.bandwidth_bytes_per_second[np.ix_(ix, ix)]
        )
    n = len(holders)
    free = np.ones(n, dtype=bool)
    order = [0]
    free[0] = False
    for _ in range(n - 1):
        cand = np.flatnonzero(free)
        nxt = int(cand[np.argmin(link[order[-1], cand])])
        order.append(nxt)
        free[nxt] = False
    return [holders[i] for i in order]


def rotation_period(n_holders: int, group_size: int) -> int:
    """d: the fewest digits of base `group_size` that number every holder; the rotation's period."""
    d, cap = 1, group_size
    while cap < n_holders:
        d += 1
        cap *= group_size
    return d


def grid_radices(n_holders: int, group_size: int) -> list[int]:
    """Radices of the d-digit grid: the first is `group_size` (full well-connected groups), the
    others as equal as possible with a product just covering n, so few grid cells stay empty."""
    d = rotation_period(n_holders, group_size)
    radices = [min(group_size, n_holders)] + [2] * (d - 1)
    while int(np.prod(radices)) < n_holders:
        k = 1 + int(np.argmin(radices[1:]))
        radices[k] += 1
    return radices


def averaging_groups(
    assignment: Assignment,
    round_index: int,
    snapshot: SwarmSnapshot,
    group_size: int,
    module_paths: Collection[int] | None = None,
) -> list[list[str]]:
    """Subgroups that average a module this round (see the module docstring).

    Holders are the assigned peers on `module_paths` (None: every path, as for the embedding and
    head) that the snapshot knows. Holders whose grid partners are all missing (the grid is not
    full) would sit alone: they are consecutive in the locality order, so they form groups of
    `group_size` among themselves, and a last lone one joins the group before it. Groups thus
    hold 2 to 2*group_size - 1 holders. Deterministic from (assignment, round, snapshot).
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2, got {group_size}")
    known = set(snapshot.peer_ids)
    holders = sorted(
        p
        for p, path in assignment.path_of_peer.items()
        if p in known and (module_paths is None or path in module_paths)
    )
    n = len(holders)
    if n <= group_size:
        return [holders] if holders else []
    order = locality_order(holders, snapshot, group_size)
    radices = grid_radices(n, group_size)
    digit = round_index % len(radices)
    place = int(np.prod(radices[:digit]))
    pos = np.arange(n)
    # Positions that agree on every digit but `digit` share a group.
    key = (pos // (place * radices[digit])) * place + pos % place
    groups, lone = [], []
    for k in np.unique(key):
        members = np.flatnonzero(key == k).tolist()
        (groups if len(members) > 1 else lone).append(members)
    lone = [m[0] for m in lone]
    for start in range(0, len(lone), group_size):
        chunk = lone[start : start + group_size]
        if len(chunk) == 1:
            groups[-1].extend(chunk)
        else:
            groups.append(chunk)
    return sorted(sorted(order[i] for i in g) for g in groups)
