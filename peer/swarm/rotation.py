"""Rotation: with fewer live peers than paths, which peer moves to which path at a round boundary.

Claims put each peer on the least-covered path when it joins, so with fewer peers than paths some
paths are never trained. Every `--rotate_every_rounds` rounds each peer evaluates `plan_rotation`
on its claim view: the swarm's inner steps per path (the sum of the claims' `path_steps`), and at
most one mover — a peer on a most-trained path — to the least-trained path nobody holds. Every peer
computes the same answer from the same view, and only the mover acts on it.

The counts are claims, not facts, so they are bounded before they steer: only the counts of
claims with standing count (`peer.swarm.claims.steering_claims`: admitted peers' where any is
admitted), each scaled down to what the run's age allows, H inner steps per outer round so far (a
peer trains one path at a time, one round of H steps after another; the round is the evaluating
peer's own, not a claim). Inside that bound an admitted liar can still attract rotation to a path or
repel it from one, or hold a move back by saying it trained the target path all along: an imbalance
of training time, never a say in what is averaged or whose state is trusted. Only confirmations (the
target's holders counting rounds they averaged with it) would bound it further. Who is on which path
is judged on the claims with standing and on those of peers that took part in our latest trunk
round (a peer on probation trains, and sends its parts, like any other): a key that only claims a
path holds none (`live_claims`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass

from dht.schema import MAX_PATH_STEPS_ENTRIES, ClaimRecord
from peer.model.grid import ModelConfig
from peer.seeding import stable_seed

logger = logging.getLogger(__name__)

Claims = dict[str, ClaimRecord]


def round_view(
    read: Callable[[], Claims],
    steering: Callable[[Claims], Claims],
    round_index: int,
    wait_seconds: float,
    stop: threading.Event,
    in_hand: Claims | None = None,
) -> tuple[Claims, Claims]:
    """The claim view to plan the rotation of `round_index` on (all claims, the steering ones), every
    claim's `path_steps` as of the end of round `round_index` - 1. Every peer must plan from the same
    counts; a peer whose round ended first and read at once planned on the others' counts of the round
    before and moved where they did not (two peers onto one path, a module left by both: the goodput
    rotation arm, sessions 29 and 45). A claim of round `round_index` - 1 gives those counts as it is,
    one of `round_index` gives them less its `round_steps` (what that round trained): both exact, so
    views in which a peer's announcement of the round had or had not arrived count alike (carrying a
    claim one round on by H steps was not: a round trained through is longer). Ready claims further
    behind are read again until they reach it, for at most `wait_seconds`: a claim that never catches
    up (a laggard, a liar with standing) holds the plan back that long, no more. `in_hand`: the view
    the heartbeat read last, planned on without a DHT read when no claim in it is behind (the read on
    the training thread was 1.8% of its time)."""
    until = time.monotonic() + wait_seconds
    while True:
        claims = _as_of(in_hand if in_hand is not None else read(), round_index)
        counted, in_hand = steering(claims), None
        behind = {p: c.outer_round for p, c in counted.items() if c.ready and c.outer_round < round_index - 1}
        if not behind or stop.is_set():
            return claims, counted
        if time.monotonic() > until:
            said = ", ".join(f"{p[:12]} at {r}" for p, r in sorted(behind.items()))
            logger.info(f"rotation of round {round_index} planned on claims of earlier rounds ({said})")
            return claims, counted
        stop.wait(0.05)


class RotationRead:
    """When the heartbeat reads the claims between its beats: in the round before a rotation round.

    The rotation of round r is planned on every claim of round r - 1 or later (`round_view`), and the
    heartbeat's view (one read a beat, a beat longer than a round in fast runs) had the others' claims
    of round r - 2 at almost every rotation round: the training thread read the DHT again at the
    round's end, 0.05–0.3 s in which no step ran (2–3% of the goodput rotation arm, session 51). So
    the heartbeat reads once more, `share` of a round after our round r - 1 ended: the others' claims
    of it are out by then (they end each round within a fraction of a round of us: the trunk's rounds
    hold every peer together), and our round r's end finds them in hand."""

    def __init__(self, every_rounds: int, share: float = 0.5):
        self.every_rounds, self.share = every_rounds, share
        self.due: float | None = None  # when the heartbeat reads (time.monotonic), None: no read due
        self._ended: float | None = None  # when our last round ended

    def round_ended(self, outer_round: int, possible: Callable[[], bool] = lambda: True) -> None:
        """Our round `outer_round` ended (now): a read is due if the next round is a rotation round and
        a rotation `possible()` (the view in hand has a path nobody holds: with one peer a path, none),
        asked only then (it looks at every claim in the view)."""
        now, ended = time.monotonic(), self._ended
        self._ended = now
        rotating = self.every_rounds > 0 and (outer_round + 1) % self.every_rounds == 0
        if rotating and ended is not None and possible():
            self.due = now + self.share * (now - ended)

    def until(self, next_beat: float) -> float:
        """When the heartbeat wakes next without being woken: its beat, or a read due before it."""
        return next_beat if self.due is None else min(next_beat, self.due)

    def take(self) -> bool:
        """Whether the read is due now (the heartbeat then makes it); a beat's own read takes it too."""
        if self.due is None or time.monotonic() < self.due:
            return False
        self.due = None
        return True


def _as_of(claims: Claims, round_index: int) -> Claims:
    """`claims` with the path steps of each one of round `round_index` or later less those of its own
    round: as of the round before (exact for a claim of `round_index`). A claim of the round on a path
    it trained no step of in that round was made by a peer that moved at the round's end: it is read on
    the path it trained. A peer that read the mover's new claim before planning saw the mover's old
    path uncovered and moved there too, a second move in one round (the goodput rotation arm, session
    51: two moves of 0.2 s each, then a round waiting for the new holders' hellos)."""
    out = dict(claims)
    for pid, c in claims.items():
        if c.outer_round >= round_index and c.round_steps:
            steps = {k: n - c.round_steps.get(k, 0) for k, n in c.path_steps.items()}
            update: dict = {"path_steps": {k: n for k, n in steps.items() if n > 0}}
            if str(c.path) not in c.round_steps:
                update["path"] = int(max(c.round_steps, key=lambda k: (c.round_steps[k], k)))
            out[pid] = c.model_copy(update=update)
    return out


@dataclass(frozen=True)
class Rotation:
    """One decision: `mover` leaves path `source` for `target`; `steps` is the swarm's steps per path."""

    mover: str
    source: int
    target: int
    steps: dict[int, int]


def swarm_path_steps(
    cfg: ModelConfig, claims: Mapping[str, ClaimRecord], max_steps: int | None = None
) -> dict[int, int]:
    """Inner steps per path index (every path of the grid), summed over the claims' `path_steps`, each
    claim's scaled down to at most `max_steps` in all (None: as claimed)."""
    steps = dict.fromkeys(range(cfg.n_paths), 0)
    for claim in claims.values():
        total = sum(claim.path_steps.values())
        scale = 1.0 if max_steps is None or total <= max_steps else max_steps / total
        for key, n in claim.path_steps.items():
            index = int(key)
            if index in steps:
                steps[index] += int(n * scale)
    return steps


def live_claims(
    claims: Mapping[str, ClaimRecord], counted: set[str] | None = None, took_part: Set[str] | None = None
) -> dict[str, ClaimRecord]:
    """The claims that say who trains which path: not in client mode, not leaving, and, given the
    agreed senders of our latest trunk round (`took_part`), only those with standing (`counted`) or
    whose peer is among the senders. A claim costs a key nothing, a part in every round of the trunk
    costs a trunk fragment's bytes: keys that claimed every uncovered path, or more paths' worth of
    claims than there are paths, held rotation back for as long as they kept claiming."""
    return {
        pid: c
        for pid, c in claims.items()
        if not c.client_mode and not c.leaving
        if took_part is None or counted is None or pid in counted or pid in took_part
    }


def plan_rotation(
    cfg: ModelConfig,
    claims: Mapping[str, ClaimRecord],
    round_index: int,
    every_rounds: int,
    tolerance: int = 0,
    steps_per_round: int | None = None,
    counted: set[str] | None = None,
    took_part: Set[str] | None = None,
) -> Rotation | None:
    """The rotation the swarm makes at the end of outer round `round_index`, or None.

    Nothing moves unless rotation is on (`every_rounds` > 0), the round is a multiple of it, live
    (non-client-mode) peers are fewer than paths and some path has no live holder. The target is the
    least-trained uncovered path; the candidates are the live peers whose path has the most steps,
    within `tolerance` (views a heartbeat apart then agree on them); the mover is the candidate with
    the highest stable_seed(peer id, round). A peer only moves to a path trained less than its own.
    `steps_per_round` (H): a claim counts at most H × (round_index + 1) steps (None: no bound);
    `counted`: the peers whose step counts count (None: all). Who is live and on which path: every
    claim with standing, and those of peers on probation that took part in our latest trunk round
    (`took_part`, see `live_claims`; None: every claim).
    """
    if every_rounds <= 0 or round_index <= 0 or round_index % every_rounds:
        return None
    live = live_claims(claims, counted, took_part)
    if not live or len(live) >= cfg.n_paths:
        return None
    coverage = Counter(c.path for c in live.values())
    uncovered = [p for p in range(cfg.n_paths) if coverage[p] == 0]
    if not uncovered:
        return None
    max_steps = None if steps_per_round is None else steps_per_round * (round_index + 1)
    counting = {pid: c for pid, c in claims.items() if not c.leaving and (counted is None or pid in counted)}
    steps = swarm_path_steps(cfg, counting, max_steps)
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
