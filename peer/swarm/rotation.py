"""Rotation: with fewer live peers than paths, which peer moves to which path at a round boundary.

Claims put each peer on the least-covered path when it joins, so with fewer peers than paths some
paths are never trained. Every `--rotate_every_rounds` rounds each peer evaluates `plan_rotation`
on its claim view: the swarm's inner steps per path (the sum of the claims' `path_steps`), and at
most one mover — a peer on a most-trained path — to the least-trained path nobody holds. Every peer
computes the same answer from the same view, and only the mover acts on it.

The counts are claims, not facts: a peer lying about its `path_steps` can at most attract rotation
to a path or repel it from one, which costs nothing worse than an imbalance of training time. They
never decide what is averaged or whose state is trusted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from dht.schema import MAX_PATH_STEPS_ENTRIES, ClaimRecord
from peer.model.grid import ModelConfig
from peer.seeding import stable_seed


@dataclass(frozen=True)
class Rotation:
    """One decision: `mover` leaves path `source` for `target`; `steps` is the swarm's steps per path."""

    mover: str
    source: int
    target: int
    steps: dict[int, int]


def swarm_path_steps(cfg: ModelConfig, claims: Mapping[str, ClaimRecord]) -> dict[int, int]:
    """Inner steps per path index (every path of the grid), summed over the claims' `path_steps`."""
    steps = dict.fromkeys(range(cfg.n_paths), 0)
    for claim in claims.values():
        for key, n in claim.path_steps.items():
            index = int(key)
            if index in steps:
                steps[index] += n
    return steps


def plan_rotation(
    cfg: ModelConfig,
    claims: Mapping[str, ClaimRecord],
    round_index: int,
    every_rounds: int,
    tolerance: int = 0,
) -> Rotation | None:
    """The rotation the swarm makes at the end of outer round `round_index`, or None.

    Nothing moves unless rotation is on (`every_rounds` > 0), the round is a multiple of it, live
    (non-client-mode) peers are fewer than paths and some path has no live holder. The target is the
    least-trained uncovered path; the candidates are the live peers whose path has the most steps,
    within `tolerance` (views a heartbeat apart then agree on them); the mover is the candidate with
    the highest stable_seed(peer id, round). A peer only moves to a path trained less than its own.
    """
    if every_rounds <= 0 or round_index <= 0 or round_index % every_rounds:
        return None
    live = {pid: c for pid, c in claims.items() if not c.client_mode and not c.leaving}
    if not live or len(live) >= cfg.n_paths:
        return None
    coverage = Counter(c.path for c in live.values())
    uncovered = [p for p in range(cfg.n_paths) if coverage[p] == 0]
    if not uncovered:
        return None
    steps = swarm_path_steps(cfg, {pid: c for pid, c in claims.items() if not c.leaving})
    target = min(uncovered, key=lambda p: (steps[p], stable_seed("rotation target", round_index, p)))
    top = max(steps.get(c.path, 0) for c in live.values())
    candidates = [pid for pid, c in live.items() if steps.get(c.path, 0) >= top - tolerance]
    mover = max(candidates, key=lambda pid: stable_seed(pid, round_index))
    source = live[mover].path
    if steps[target] >= steps.get(source, 0):
        return None
    return Rotation(mover, source, target, steps)


def claimed_path_steps(own: Mapping[int, int]) -> dict[str, int]:
    """What a claim says of our steps per path: the most trained paths, as many as a claim holds."""
    ranked = sorted(own.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_PATH_STEPS_ENTRIES]
    return {str(p): int(n) for p, n in ranked if n > 0}
