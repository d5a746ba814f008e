"""The sync layer of one peer: everything that keeps the modules of its path equal to their holders'.

`PathSync` owns a `ModuleSync` (global copy, outer optimizers) and a `ModuleAverager` per module of
the path, the Streaming DiLoCo outer loop over them (`StreamingOuter`), catch-up from the holders
that are ahead, and the sync state a checkpoint keeps: every module's global copy and momentum, and
every fragment's round (fragments of a module sync at different steps, so a peer stopped mid-cycle
has fragments one round apart).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import hivemind
import torch

from monitoring.metrics import PeerMetrics
from peer.codecs.specs import codec_spec
from peer.config import RunManifest, SyncConfig
from peer.errors import SwarmError
from peer.model.grid import TRUNK, all_paths, path_module_ids
from peer.model.transformer import PathModel
from peer.seeding import stable_seed
from peer.sync.averager import ModuleAverager
from peer.sync.module_sync import ModuleSync, StateRejected
from peer.sync.outer import GroupOf, StreamingOuter

logger = logging.getLogger(__name__)

#: module id -> (peer id, module round) of the other holders a joiner may download it from
Donors = dict[str, list[tuple[str, int]]]


def check_codec_slot(sync: SyncConfig) -> None:
    """A run records the hivemind slot its codec occupied when it was created; peers of a version that
    puts the codec in another slot would misread each other's parts, so they refuse to join."""
    slot = codec_spec(sync.codec).hivemind_slot
    if sync.codec_slot != slot:
        raise SwarmError(
            f"the run sends codec {sync.codec} in hivemind slot {sync.codec_slot}, this version uses {slot}: "
            "upgrade pathswarm to the run's version"
        )


class PathSync:
    """A `ModuleSync` and an averager per module of one path, and the outer loop over them."""

    def __init__(
        self,
        manifest: RunManifest,
        model: PathModel,
        peer_id: str,
        metrics: PeerMetrics,
        group_of: GroupOf | None = None,
        round_of: Callable[[], int] | None = None,
    ):
        check_codec_slot(manifest.sync)
        self.manifest = manifest
        self.peer_id = peer_id
        self.metrics = metrics
        cfg = manifest.model
        paths_through = {
            mid: sum(mid in path_module_ids(cfg, p) for p in all_paths(cfg)) for mid in model.module_ids
        }
        self.syncs = {
            mid: ModuleSync(
                cfg, mid, model.parts[mid], manifest.outer, manifest.sync.fragments, paths_through[mid]
            )
            for mid in model.module_ids
        }
        self.outer = StreamingOuter(self.syncs, manifest, peer_id, metrics, group_of, round_of)

    @property
    def outer_round(self) -> int:
        """The trunk is on every path, so its round is the swarm's clock."""
        return self.syncs[TRUNK].outer_round

    def start_averagers(self, dht: hivemind.DHT, prefix_of: Callable[[str], str], client_mode: bool) -> None:
        sync = self.manifest.sync
        for mid, ms in self.syncs.items():
            ms.averager = ModuleAverager(
                max(ms.fragment_size(f) for f in range(ms.n_fragments)),
                dht,
                prefix=prefix_of(mid),
                codec=sync.codec,
                state_provider=lambda ms=ms: (ms.state_metadata(), ms.state_tensors()),
                checksum_seed=stable_seed(self.manifest.run_id, mid),
                max_part_norm=sync.max_delta_norm,
                state_numel=2 * ms.plan.numel,
                start=True,
                min_matchmaking_time=sync.matchmaking_time_seconds,
                request_timeout=min(3.0, sync.matchmaking_time_seconds / 2),
                target_group_size=None,
                client_mode=client_mode,
            )
            # Donors rank themselves differently per module, so a joiner's downloads spread out.
            ms.averager.state_sharing_priority = stable_seed(self.peer_id, mid) / 2**63

    def catch_up(self, donors: Donors, our_round: int) -> None:
        """Downloads the global copy of every module that other holders have advanced past `our_round`.
        Donors are the most advanced holders, ordered by a hash of (us, module, donor), so a joiner's
        modules come from different peers rather than all from one."""
        for mid, ms in self.syncs.items():
            candidates = donors.get(mid, [])
            best = max((r for _, r in candidates), default=0)
            if best == 0 or best <= our_round:
                continue  # nobody is ahead of us (round 0: everyone starts from the seeded init)
            ordered = sorted(
                (p for p, r in candidates if r == best),
                key=lambda d, mid=mid: stable_seed(self.peer_id, mid, d),
            )
            got = ms.averager.download_state(ordered, timeout=self.manifest.sync.averaging_timeout_seconds)
            if got is None:
                logger.warning(f"{mid}: no holder sent its state; starting from our own copy")
                continue
            donor, metadata, tensors = got
            try:
                ms.load_state(metadata, tensors)
            except StateRejected as e:
                logger.warning(f"refused a downloaded state from {donor}: {e}")
                self.metrics.bad_part("shape")
                continue
            logger.info(f"{mid}: downloaded the global copy (module round {ms.outer_round}) from {donor}")

    def fingerprints(self) -> dict[str, list[float]]:
        """Sum and L1 norm of each module's global copy: cheap, and enough to see holders disagree."""
        return {
            mid: [
                float(sum(g.sum() for g in ms.global_flats)),
                float(sum(g.abs().sum() for g in ms.global_flats)),
            ]
            for mid, ms in self.syncs.items()
        }

    # --- checkpoints ----------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for ms in self.syncs.values():
            out.update(ms.named_state())
        return out

    def fragment_rounds(self) -> dict[str, list[int]]:
        return {mid: list(ms.fragment_rounds) for mid, ms in self.syncs.items()}

    def restore(
        self,
        tensors: dict[str, torch.Tensor],
        fragment_rounds: dict[str, list[int]] | None,
        outer_round: int,
        tokens_total: int,
    ) -> None:
        """Loads the global copies and momenta of a checkpoint; a checkpoint without fragment rounds
        (written before they were kept) puts every fragment at `outer_round`."""
        rounds = fragment_rounds or {}
        for mid, ms in self.syncs.items():
            ms.load_named_state(tensors, rounds.get(mid, [outer_round] * ms.n_fragments))
        self.outer.reset_tokens(tokens_total)

    def shutdown(self) -> None:
        for ms in self.syncs.values():
            if ms.averager is not None:
                try:
                    ms.averager.shutdown()
                except Exception as e:
                    logger.debug(f"averager shutdown: {e}")
