"""Rotation of a live peer between paths (`Peer` inherits it): with fewer peers than paths, every
--rotate_every_rounds rounds the swarm's rotation (peer/swarm/rotation.py) may pick this peer to move to
the least-trained path nobody holds; it moves without restarting the process.
"""

from __future__ import annotations

import logging
import time

from peer.checkpoint import CheckpointError
from peer.model.grid import path_from_index, path_module_ids
from peer.swarm.rotation import Rotation

logger = logging.getLogger(__name__)


class PathRotation:
    """The rotation half of `Peer`: deciding at a round's end, and moving to another path."""

    #: "no keeper took our modules" said once at WARNING: in a run without a keeper it holds every time
    _warned_unkept: bool = False

    def _rotation_due(self) -> Rotation | None:
        """Our move, if the swarm's rotation at the end of this round moves us (see
        peer/swarm/rotation.py; every peer computes it, only the mover acts)."""
        if self._finishing():
            return None
        try:
            rotation = self.membership.rotation(self.outer_round)
        except Exception as e:  # reading the claims must never stop the training
            logger.warning(f"could not decide on a rotation: {type(e).__name__}: {e}")
            return None
        if rotation is None or rotation.mover != self.peer_id:
            return None
        if self.config.path is not None:
            # the volunteer chose this path: we stay, and the next decision picks another mover
            logger.info(f"rotation picked us to move to path {rotation.target}, but --path keeps us here")
            return None
        return rotation

    def _rotate(self, rotation: Rotation) -> None:
        """Moves this live peer to `rotation.target`: checkpoint, hand over the modules we were the
        last to hold, rebuild the path model, optimizer, sync layer and data, keeping the modules the
        two paths share, and download the others from their holders or keepers."""
        if self.sync.in_flight:
            logger.info("syncs still in flight at the round's end: not rotating this time")
            return
        cfg = self.manifest.model
        steps = ", ".join(f"{p}: {n}" for p, n in sorted(rotation.steps.items()))
        logger.info(f"rotating from path {rotation.source} to path {rotation.target} (path steps {steps})")
        if self._checkpointed_step != self.step:
            try:
                self.checkpoint()
            except CheckpointError as e:
                logger.error(f"checkpoint before rotating failed, rotating anyway: {e}")
        new_path = path_from_index(cfg, rotation.target)
        dropped = [mid for mid in self.model.module_ids if mid not in path_module_ids(cfg, new_path)]
        unkept = self._hand_over(self.membership.modules_only_we_hold(dropped))
        if unkept:
            level = logging.INFO if self._warned_unkept else logging.WARNING
            self._warned_unkept = True
            logger.log(
                level,
                f"not rotating: we are the last holder of {', '.join(unkept)} and no keeper took it "
                "(a keeper: pathswarm bootstrap --keep_state DIR)",
            )
            return
        old_model, old_sync = self.model, self.sync
        self.membership.move_to(new_path)
        moved_at = time.monotonic()
        self.path = new_path
        self._build_model(kept=old_model, kept_sync=old_sync)
        # the next sync's weight counts the tokens trained on this path, not those since the start
        self.sync.reset_tokens(self.tokens_total)
        self._join_path(old_sync.service)
        # The other holders accept our outer gradients once their claim views (renewed every
        # heartbeat) show our new claim: give them two heartbeats before our first sync on this path
        # (rounds usually take far longer; this matters to short rounds).
        self.stop_requested.wait(max(0.0, moved_at + 2 * self.config.heartbeat_seconds - time.monotonic()))
        self.membership.start_path()
        logger.info(f"training path {rotation.target} {self.path}: modules {self.model.module_ids}")
