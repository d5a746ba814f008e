"""Whether a live peer rotates to another path (`RotationPolicy`): in a run that re-plans online, the
plan moves it when the move pays (peer/training/replan.py); otherwise, with fewer peers than paths,
every --rotate_every_rounds rounds the swarm's rotation (peer/swarm/rotation.py) may pick this peer to
move to the least-trained path nobody holds. It moves without restarting the process (`Peer._rotate`
does the move: it rebuilds the peer's own model, sync layer and data).
"""

from __future__ import annotations

import logging

from peer.swarm.membership import Membership
from peer.swarm.rotation import Rotation
from peer.training.replan import OnlineReplanner

logger = logging.getLogger(__name__)


class RotationPolicy:
    """Decides at a round's end whether this peer moves, and whether a move is off after all."""

    def __init__(self, membership: Membership, metrics, fixed_path: bool):
        """`fixed_path`: the volunteer chose the path (--path); the peer never moves off it.
        `metrics`: where the online planner's decisions are exported (PeerMetrics, or None)."""
        self.membership = membership
        self.peer_id = membership.peer_id
        self.replanner = OnlineReplanner(membership, metrics)
        self.fixed_path = fixed_path
        #: "no keeper took our modules" said once at WARNING: in a run without a keeper it holds every time
        self._warned_unkept = False

    def decide(self, outer_round: int, in_flight: int) -> Rotation | None:
        """Our move, if the swarm's rotation at the end of this round moves us (see
        peer/swarm/rotation.py; every peer computes it, only the mover acts) and none of our syncs
        (`in_flight`) is still running: a move rebuilds the sync layer they would land in."""
        try:
            rotation = self.replanner.decide(outer_round) if self.replanner.enabled else None
            if rotation is None:
                rotation = self.membership.rotation(outer_round)
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
        return rotation

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
