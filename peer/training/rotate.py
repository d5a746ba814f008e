"""Whether a live peer rotates to another path (`RotationPolicy`): in a run that re-plans online, the
plan moves it when the move pays (peer/training/replan.py); otherwise, with fewer peers than paths,
every --rotate_every_rounds rounds the swarm's rotation (peer/swarm/rotation.py) may pick this peer to
move to the least-trained path nobody holds. It moves without restarting the process (`Peer._rotate`
does the move: it rebuilds the peer's own model, sync layer and data).
"""

from __future__ import annotations

import logging

from peer.model.grid import TRUNK, path_from_index, path_module_ids
from peer.swarm.claims import holders_by_module
from peer.swarm.membership import Membership
from peer.swarm.rotation import Rotation
from peer.training.replan import OnlineReplanner

logger = logging.getLogger(__name__)

#: rounds a move waits at most for the peers that just joined a module we would leave to average
#: with us (claims of keys that never take part must not pin a peer to its path)
MAX_DEFERRED_ROUNDS = 3


class RotationPolicy:
    """Decides at a round's end whether this peer moves, and whether a move is off after all."""

    def __init__(
        self, membership: Membership, metrics, fixed_path: bool, replanner: OnlineReplanner | None = None
    ):
        """`fixed_path`: the volunteer chose the path (--path); the peer never moves off it.
        `metrics`: where the online planner's decisions are exported (PeerMetrics, or None).
        `replanner`: the online planner (None: one on `membership` at the peer's heartbeat)."""
        self.membership = membership
        self.peer_id = membership.peer_id
        self.replanner = replanner if replanner is not None else OnlineReplanner(membership, metrics)
        self.fixed_path = fixed_path
        #: "no keeper took our modules" said once at WARNING: in a run without a keeper it holds every time
        self._warned_unkept = False
        #: rounds the current move has waited for a module's new holders (`_unmet`)
        self._deferred = 0
        #: module -> claimant -> the round at whose end we first saw it claim the module (None: our
        #: first look, which sees established holders, not joiners); only claimants in the current view
        self._first_seen: dict[str, dict[str, int | None]] = {}
        self._looked_at: dict | None = None  # the claim view `_first_seen` was last worked out from

    def decide(
        self, outer_round: int, in_flight: int, last_members: dict[str, frozenset[str]] | None = None
    ) -> Rotation | None:
        """Our move, if the swarm's rotation at the end of this round moves us (see
        peer/swarm/rotation.py; every peer computes it, only the mover acts), none of our syncs
        (`in_flight`) is still running (a move rebuilds the sync layer they would land in), and every
        peer that joined a module we would leave took part in our latest round of it (`last_members`:
        module -> the members of our latest round of it), or we waited `MAX_DEFERRED_ROUNDS` for it."""
        self._look(outer_round)
        try:
            rotation = self.replanner.decide(outer_round) if self.replanner.enabled else None
            if rotation is None:
                rotation = self.membership.rotation(outer_round, (last_members or {}).get(TRUNK))
        except Exception as e:  # reading the claims or planning must never stop the training
            logger.warning(f"could not decide on a rotation: {type(e).__name__}: {e}")
            return None
        if rotation is None or rotation.mover != self.peer_id:
            return None
        if self.fixed_path:
            # the volunteer chose this path: we stay, and the next decision picks another mover
            logger.info(f"rotation picked us to move to path {rotation.target}, but --path keeps us here")
            return None
        if in_flight:
            logger.info("syncs still in flight at the round's end: not rotating this time")
            self.replanner.retry()  # the plan's move is still due: decide again at the next round's end
            return None
        unmet = self._unmet(rotation, last_members or {}, outer_round)
        if unmet and self._deferred < MAX_DEFERRED_ROUNDS:
            self._deferred += 1
            logger.info(
                f"not rotating yet ({self._deferred} of {MAX_DEFERRED_ROUNDS} rounds): {', '.join(unmet)} "
                "just joined a module we would leave and has not averaged with us"
            )
            self.replanner.retry()
            return None
        self._deferred = 0
        return rotation

    def _look(self, outer_round: int) -> None:
        """Notes when each claimant of a module was first seen claiming it (`_first_seen`). The view
        changes once a heartbeat, and a round ends many times a heartbeat in fast runs: with the view
        we looked at last, nothing changes (a flooded view made this 1.5% of the training thread)."""
        view = self.membership.claims
        if view is self._looked_at:
            return
        self._looked_at = view
        claims = {p: c for p, c in view.items() if p != self.peer_id and not c.client_mode and not c.leaving}
        first, before = not self._first_seen, self._first_seen
        # not only ready holders: a joiner still downloading is the one that needs us
        self._first_seen = {
            mid: {p: None if first else before.get(mid, {}).get(p, outer_round) for p in peers}
            for mid, peers in holders_by_module(claims, ready_only=False).items()
        }

    def _unmet(
        self, rotation: Rotation, last_members: dict[str, frozenset[str]], outer_round: int
    ) -> list[str]:
        """Peers that began to claim a module we would leave in the last `MAX_DEFERRED_ROUNDS` rounds
        and were not in our latest round of it. A peer that moves onto a module as we move off it (a
        plan that swaps two peers) takes its state from the holders and needs one holder besides the
        donor to confirm it: if we leave first, a module of two holders has nobody to confirm, and the
        joiner goes on with a copy of its own (copies split, rounds wait for each other: the live
        re-plan test's stall) or starts the module anew (scheduler_live, session 27). Once it averaged
        with us it holds the group's copy. Holders we never average with directly (another subgroup
        of a module with many holders) are not joiners: they claimed it before."""
        cfg = self.membership.manifest.model
        keep = set(path_module_ids(cfg, path_from_index(cfg, rotation.target)))
        leaving = set(path_module_ids(cfg, path_from_index(cfg, rotation.source))) - keep
        unmet = {
            p
            for mid in leaving
            for p, since in self._first_seen.get(mid, {}).items()
            if since is not None and outer_round - since <= MAX_DEFERRED_ROUNDS
            if p not in last_members.get(mid, frozenset())
        }
        return sorted(unmet)

    def blocked(self, unkept: list[str]) -> bool:
        """Whether modules we are the last holder of and no keeper took (`unkept`) keep us here:
        leaving would lose their state."""
        if not unkept:
            return False
        level = logging.INFO if self._warned_unkept else logging.WARNING
        self._warned_unkept = True
        logger.log(
            level,
            f"not rotating: we are the last holder of {', '.join(unkept)} and no keeper took it "
            "(a keeper: pathswarm bootstrap --keep_state DIR)",
        )
        return True
