"""One training peer: its lifecycle and its training loop.

`Peer.start()` joins the DHT, verifies the run manifest, claims a path (`Membership`), builds the
path model and its sync layer (`PathSync`), restores a checkpoint or catches up with the holders
that are ahead, and starts the heartbeat. `Peer.run()` is the inner loop, with fragment syncs and
outer steps at Streaming DiLoCo's offsets; with fewer peers than paths, a peer rotates to the
least-trained path every --rotate_every_rounds rounds (`Peer._rotate`). `Peer.close()` checkpoints,
announces that the peer is leaving and shuts everything down; it is safe to call at any point.

`Peer` holds its parts and calls them; none calls back: `Membership` (claim, views, heartbeat),
`PathSync` (the sync layer), `RouterFollower` (the route its data is read with; a newer router version
that is due), `RotationPolicy` (whether it moves at a round's end; the move is `Peer`'s: it rebuilds
its model, sync layer and data), `PeerCheckpoints`, `ServeLimits` (what others make it upload) and
`ContributionLedger` (its totals over the run).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import torch

from dht.schema import ManifestRecord
from dht.serve_limits import ServeLimits
from monitoring.metrics import PeerMetrics
from peer import __version__
from peer.artifacts.transfer import ArtifactService
from peer.checkpoint import CheckpointError
from peer.config import PeerConfig, RunManifest
from peer.faults import fault_point
from peer.model.base import ModuleStates, base_modules
from peer.model.grid import parse_path, path_from_index, path_index, path_module_ids
from peer.model.transformer import PathModel
from peer.run.admission import run_validator
from peer.run.rebuild import check_tokenizer
from peer.swarm.admission import obtain_admission
from peer.swarm.authority import AdmissionAuthority, serve_if_creator
from peer.swarm.membership import Membership
from peer.swarm.progress import Progress
from peer.swarm.reachability import DialBackService, Reachability, helpers_from
from peer.swarm.rotation import Rotation
from peer.sync.path_sync import PathSync
from peer.sync.pending import FragmentDone
from peer.sync.service import SyncService
from peer.training.checkpoints import Counters, PeerCheckpoints
from peer.training.contribution import ContributionLedger
from peer.training.history import RoundHistory, Throughput, first_step_note
from peer.training.inner import autocast_for, device_of, inner_step, make_inner_optimizer, tokens_in
from peer.training.joining import join_run, obtain_artifacts, start_node
from peer.training.path_data import PathData
from peer.training.rotate import RotationPolicy
from peer.training.router_switch import RouterFollower
from peer.training.startup_checks import check_data, check_memory

logger = logging.getLogger(__name__)


class Peer:
    """A volunteer's peer: joins a run, trains one path and keeps its modules in sync."""

    def __init__(self, config: PeerConfig):
        self.config = config
        self.stop_requested = threading.Event()
        self.checkpoints = PeerCheckpoints(config)
        self.serve_limits = ServeLimits(config.serve_limits())  # states, copies and artifacts, together
        # made by start(), in this order; close() shuts down whatever start() got to
        self.device: torch.device | None = None
        self.dht, self.key, self.peer_id = None, None, ""
        self.dialback: DialBackService | None = None
        self.reachability: Reachability | None = None
        self.manifest: RunManifest | None = None
        self.record: ManifestRecord | None = None
        self.run_id = ""
        self._data_root: Path | None = None
        self.artifacts: ArtifactService | None = None
        self.base: ModuleStates | None = None
        self.tokenizer = None
        self.data: PathData | None = None
        self.membership: Membership | None = None
        self.metrics: PeerMetrics | None = None
        self.router: RouterFollower | None = None
        self.rotation_policy: RotationPolicy | None = None
        #: the run's authority, when this peer is its creator's (it admits volunteers)
        self.authority: AdmissionAuthority | None = None
        # the path trained now and what trains it: rebuilt by a rotation
        self.path: tuple[int, ...] | None = None
        self.model: PathModel | None = None
        self.inner: torch.optim.Optimizer | None = None
        self.sync: PathSync | None = None
        self.batches: Iterator[torch.Tensor] | None = None
        self.step = self.tokens_total = self.outer_round = 0
        # a join's cost as a volunteer sees it: from the process's start (imports included) to training
        self.process_started = psutil.Process().create_time()
        self.last_loss = float("nan")
        self.throughput = Throughput()
        self.history = RoundHistory()
        self.contribution = ContributionLedger(lambda: (self.step, self.tokens_total, self.path_steps))
        #: path index -> steps trained on it (several once it rotated): now, at the last round end, in it
        self.path_steps, self.round_path_steps, self.round_steps = {}, {}, {}
        #: the move decided at a round's end, made in the loop once that step's syncs are handled
        self._rotation: Rotation | None = None
        self._closed = False

    # --- start-up -------------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.device = device_of(cfg.device)
        self.checkpoints.lock()  # before anything joins: a second peer here stops at once
        self.dht, self.key = start_node(cfg)
        self.peer_id = str(self.dht.peer_id)
        self.dialback = DialBackService(self.dht)
        self.reachability = self.dialback.check(
            self.dht, helpers_from(cfg.initial_peers), cfg.client_mode, cfg.use_auto_relay
        )
        logger.info(self.reachability.message)
        self.manifest, self.record = join_run(self.dht, self.key, cfg, self.peer_id)
        self.run_id = self.record.run_id
        self.dht.add_validators([run_validator(self.record, cfg.run_name)])
        check_memory(self.manifest, cfg, self.device)
        self._data_root = check_data(self.manifest, cfg)
        found = obtain_artifacts(self.dht, self.key, cfg, self.manifest, self.run_id, self.serve_limits)
        self.artifacts, self.base = found
        self.tokenizer = check_tokenizer(self.manifest, self._artifact_folders())
        self.data = PathData(
            self.manifest, self.tokenizer, cfg.batch_size, self._data_root, self.peer_id, cfg.checkpoint_dir,
            prefetch=cfg.prefetch_batches, artifact_folders=self._artifact_folders(),
        )  # fmt: skip
        admission = obtain_admission(self.dht, cfg, self.manifest, self.record, self.peer_id)
        self.membership = Membership(
            self.dht, self.key, cfg, self.manifest, self.record, self._progress, self.device, admission
        )
        self.membership.reachability = self.reachability.state
        self.membership.artifacts = self.artifacts
        self.membership.contribution = self.contribution.publisher(self.manifest, self.run_id, self.peer_id)
        if self.stop_requested.is_set():
            self.membership.request_stop()
        self.membership.read_claims()
        self.membership.probe(cycle=0)
        resumed = self.checkpoints.load(self.run_id) if cfg.resume else None
        fixed = parse_path(self.manifest.model, cfg.path) if cfg.path is not None else None
        if resumed is not None:
            fixed = tuple(resumed[1]["path"])
        self.path = self.membership.claim_path(fixed)
        index = path_index(self.manifest.model, self.path)
        logger.info(
            f"training path {index} {self.path}: modules {path_module_ids(self.manifest.model, self.path)}"
        )
        self.metrics = PeerMetrics(cfg.run, self.peer_id, str(index), __version__)
        self.metrics.follow_contribution(self.contribution.meta)
        self.router = RouterFollower(
            self.dht, self.key, cfg, self.manifest, self.record, self.base, self.artifacts, self.metrics
        )
        self.rotation_policy = RotationPolicy(self.membership, self.metrics, fixed_path=cfg.path is not None)
        self._build_model()
        if resumed is not None:
            self._restore(*resumed)
        self._join_path()
        ms = self.membership
        self.authority = serve_if_creator(
            self.sync.service, self.key, self.manifest, self.record, cfg.manifest_path, ms.read_claims
        )
        if cfg.metrics_port is not None:
            port = self.metrics.serve(cfg.metrics_port, cfg.metrics_host)
            logger.info(f"metrics on http://{cfg.metrics_host}:{port}/metrics")
        self.membership.start(self.metrics)
        if cfg.wait_for_peers > 1:
            self.membership.wait_for_peers(cfg.wait_for_peers, ready_only=True)

    def request_stop(self) -> None:
        """SIGTERM: finish the current step, then leave (start-up waits end at once)."""
        self.stop_requested.set()
        if self.membership is not None:
            self.membership.request_stop()
        if self.sync is not None and self.sync.service is not None:
            self.sync.service.leaving.set()  # a round waiting for a gone member does not hold us

    def _artifact_folders(self) -> list[Path]:
        return [self.artifacts.store.root] if self.artifacts is not None else []

    def _build_model(self, kept: PathModel | None = None, kept_sync: PathSync | None = None) -> None:
        """The path model, its inner optimizer and its sync layer; on a rotation, the modules the
        new path shares with `kept` (the old path's model) stay as they are, sync state included."""
        m = self.manifest
        ids = path_module_ids(m.model, self.path)
        # a run with a base model starts every module from it (peer/model/base.py), but kept ones
        modules = base_modules(m.model, self.base, ids) if self.base is not None else {}
        modules.update(dict(kept.parts.items()) if kept is not None else {})
        self.model = PathModel(m.model, self.path, seed=m.seed, modules=modules).to(self.device)
        # DiPaCo gives each path its own inner optimizer: a path we rotate to starts a fresh one
        # (the old path's Adam moments belong to modules and a data shard we no longer train)
        self.inner = make_inner_optimizer(self.model, m.inner, self.config.inner_optimizer)
        if kept is not None:  # start() made the metrics with the path's label
            self.metrics.set_path(str(path_index(m.model, self.path)))
        self.sync = PathSync(
            m, self.model, self.peer_id, self.metrics,
            group_of=self.membership.group_of, round_of=lambda: self.outer_round, kept=kept_sync,
        )  # fmt: skip

    def _join_path(self, service: SyncService | None = None) -> None:
        """Opens our path's sync layer (on the old path's `service` after a rotation), downloads the
        modules whose holders (or keepers) are ahead of us and reads the path's data shard."""
        ms, sent = self.membership, self.checkpoints.sent_rounds(self.manifest.run_id)
        self.sync.start(
            self.dht, ms.is_holder, service, self.key, ms.standing, sent, self.serve_limits, ms.read_claims
        )
        downloaded = self.sync.catch_up(self.membership.donors(), self.membership.kept())
        self.outer_round = max(self.outer_round, self.sync.outer_round)
        if downloaded:
            # a crash before the first round must not cost the download again (minutes for a big path)
            self._try_checkpoint("checkpoint of the downloaded state failed, training goes on")
        self._start_data()

    def _start_data(self) -> None:
        index = path_index(self.manifest.model, self.path)
        try:
            route = self.router.route(self.outer_round, index)
        finally:
            self._adopt_artifacts()
        version = self.router.version_number
        self.batches = self.data.batches(index, route, self._artifact_folders(), self.step, version)

    def _progress(self) -> Progress:
        progress = Progress(
            step=self.step,
            outer_round=self.outer_round,
            tokens_total=self.tokens_total,
            tokens_per_second=self.throughput.tokens_per_second,
            loss=self.history.entries[-1]["loss"] if self.history.entries else None,
        )
        if self.sync is not None:
            totals = self.sync.totals
            progress.digests = self.sync.fingerprints()
            progress.module_rounds = self.sync.fragment_rounds()
            progress.sync_outcomes, progress.bad_parts = dict(totals.outcomes), dict(totals.bad_parts)
            progress.bytes_sent, progress.bytes_received = totals.bytes_sent, totals.bytes_received
        progress.path_steps, progress.round_steps = dict(self.round_path_steps), dict(self.round_steps)
        return progress

    # --- training -------------------------------------------------------------------------------

    def run(self) -> None:
        m = self.manifest
        autocast = autocast_for(self.device)
        self.model.train()
        self.throughput.start()
        self.history.start_clock()
        first_step = True
        while not self._finishing():
            fault_point("train.step")
            batch = next(self.batches).to(self.device)
            began = self.history.lap("batches")  # every part of the loop is a lap (history.LOOP_PARTS)
            self.last_loss = inner_step(self.model, self.inner, batch, m.inner, self.step, autocast=autocast)
            self.history.add_step(self.last_loss)
            tokens = tokens_in(batch)
            if first_step:
                first_step = False
                logger.info(first_step_note(time.time() - self.process_started))
            self.step += 1
            index = path_index(m.model, self.path)
            self.path_steps[index] = self.path_steps.get(index, 0) + 1
            self.tokens_total += tokens
            self.metrics.observe_step(tokens, self.last_loss, self.throughput.add(tokens))
            holders = self.membership.holders()
            self.history.lap("loop")
            for done in self.sync.after_step(self.step, self.tokens_total, holders):
                self._fragment_done(done, holders)
            self.history.lap("sync")
            if self._rotation is not None:  # decided at the round's end, made once its syncs are all done
                rotation, self._rotation = self._rotation, None
                self._rotate(rotation)
                self.model.train()
                self.history.lap("rotation")
            self._pace(began)
            self.history.lap("pace")
        holders = self.membership.holders()
        for done in self.sync.drain(self.step):
            self._fragment_done(done, holders)

    def _pace(self, began: float) -> None:
        """Holds the loop to --max_inner_steps_per_second (a stop request cuts the wait short)."""
        rate = self.config.max_inner_steps_per_second
        if rate is not None and (left := began + 1.0 / rate - time.perf_counter()) > 0:
            self.stop_requested.wait(left)

    def _fragment_done(self, done: FragmentDone, holders: dict[str, list[str]]) -> None:
        for mid in done.results:
            self.metrics.set_holders(mid, len(set(holders.get(mid, [])) | {self.peer_id}))
        self.history.add_sync(done)
        if done.fragment != 0 or done.late:
            return
        self.contribution.end_round(done, self.peer_id)
        # Fragment 0 syncs at H, 2H, ...: one outer round per H inner steps. The trunk is on every path,
        # so its sync count is the swarm's clock (a peer that synced alone is set back when it repairs).
        self.outer_round = self.sync.outer_round
        entry = self.history.end_round(self.outer_round, self.step, self.tokens_total, done)
        before, self.round_path_steps = self.round_path_steps, dict(self.path_steps)
        self.round_steps = {p: d for p, n in self.path_steps.items() if (d := n - before.get(p, 0)) > 0}
        # the log and the metrics show the swarm's round (the DHT claims carry it too) and our own count
        own = self.history.own_rounds
        self.metrics.set_rounds(self.outer_round, own)
        loss, outcomes = entry["loss"], entry["outcomes"]
        logger.info(f"round {self.outer_round} step {self.step} loss {loss:.4f} {outcomes} (own round {own})")
        cfg = self.config
        if cfg.checkpoint_dir is not None and self.outer_round % cfg.checkpoint_every_rounds == 0:
            # a full disk must not stop the training: the last good checkpoint stays, we retry next round
            if not self._try_checkpoint("checkpoint failed, training goes on"):
                self.metrics.checkpoint_failed()
        self.membership.announce()
        self._follow_router()
        # every peer computes the swarm's rotation alike; one that is leaving does not move
        decide, sync = self.rotation_policy.decide, self.sync
        self._rotation = (
            None if self._finishing() else decide(self.outer_round, sync.in_flight, sync.last_members)
        )

    def _finishing(self) -> bool:
        cfg = self.config
        return (
            self.stop_requested.is_set()
            or (cfg.max_steps is not None and self.step >= cfg.max_steps)
            # this peer's own rounds, not the swarm's clock: a late joiner does as many as the others
            or (cfg.max_rounds is not None and self.history.own_rounds >= cfg.max_rounds)
        )

    # --- router, rotation, checkpoints and shutdown ----------------------------------------------

    def _follow_router(self) -> None:
        """At a round boundary: a newer router version that is due re-routes our data shard."""
        try:
            route = self.router.due(self.outer_round, path_index(self.manifest.model, self.path))
        finally:
            self._adopt_artifacts()
        if route is not None:
            self._start_data()

    def _adopt_artifacts(self) -> None:
        """A router version in a run without artifacts made the router follower start an artifact
        service: the peer's from now on (the heartbeat re-publishes what it serves, close stops it)."""
        if self.router.artifacts is not self.artifacts:
            self.artifacts = self.membership.artifacts = self.router.artifacts

    def _rotate(self, rotation: Rotation) -> None:
        """Moves this live peer to `rotation.target` (`RotationPolicy` decided it): checkpoint, hand
        over the modules we were the last to hold, rebuild the path model, optimizer, sync layer and
        data, keeping the modules the two paths share, and download the others (holders, keepers)."""
        cfg = self.manifest.model
        steps = ", ".join(f"{p}: {n}" for p, n in sorted(rotation.steps.items()))
        logger.info(f"rotating from path {rotation.source} to path {rotation.target} (path steps {steps})")
        if self.checkpoints.saved_step != self.step:
            self._try_checkpoint("checkpoint before rotating failed, rotating anyway")
        new_path = path_from_index(cfg, rotation.target)
        dropped = [mid for mid in self.model.module_ids if mid not in path_module_ids(cfg, new_path)]
        if self.rotation_policy.blocked(self._hand_over(self.membership.modules_only_we_hold(dropped))):
            return
        old_model, old_sync = self.model, self.sync
        # the modules we leave: their other holders' rounds must not wait for us from now on
        self.sync.say_bye(dropped, self.membership.holders(), wait=False)
        self.membership.move_to(new_path)
        moved_at = time.monotonic()
        self.path = new_path
        self._build_model(kept=old_model, kept_sync=old_sync)
        # the next sync's weight counts the tokens trained on this path, not those since the start
        self.sync.reset_tokens(self.tokens_total)
        self._join_path(old_sync.service)
        # The other holders count us in their rounds once their claim views show our new claim. We
        # tell them to read it now (HELLO) and train on; our first sync here waits for their answers,
        # and only if one does not confirm, for the two heartbeats in which its view renews itself.
        self.membership.start_path()
        settle_until = moved_at + 2 * self.config.heartbeat_seconds
        self.sync.say_hello(self.membership.holders(), settle_until, self.stop_requested)
        logger.info(f"training path {rotation.target} {self.path}: modules {self.model.module_ids}")

    def checkpoint(self, wait: bool = False) -> None:
        """Checkpoints this peer as it is now, written in the background (`wait`: before returning)."""
        steps = (self.path_steps, self.round_path_steps, self.round_steps)  # resumed, its claims go on alike
        counters = Counters(self.step, self.outer_round, self.tokens_total, *steps)
        data = self.data.positions(self.router.version_number)  # a resumed peer's data goes on from here
        meta = {**self.router.meta(), "contribution": self.contribution.meta(), "data": data}
        self.checkpoints.save(
            counters, self.sync, self.model, self.history, run_id=self.run_id, peer_id=self.peer_id,
            path=self.path, loss=self.last_loss, extra_meta=meta, wait=wait,
        )  # fmt: skip

    def _try_checkpoint(self, failed: str) -> bool:
        """A checkpoint whose failure (a full disk) must not stop what the peer is doing: logged as
        `failed`, as is an earlier background write's; returns whether none failed."""
        try:
            self.checkpoint()
        except CheckpointError as e:
            logger.error(f"{failed}: {e}")
            return False
        for error in (errors := self.checkpoints.errors()):
            logger.error(f"{failed}: {error}")
        return not errors

    def _restore(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        index = path_index(self.manifest.model, self.path)
        c = self.checkpoints.restore(tensors, meta, index, self.sync, self.model, self.history)
        for name in ("step", "outer_round", "tokens_total", "path_steps", "round_path_steps", "round_steps"):
            setattr(self, name, getattr(c, name))
        self.contribution.restore(meta, self.peer_id)
        if "data" in meta:
            self.data.resume_from(meta["data"])

    def _hand_over(self, modules: list[str]) -> list[str]:
        """Hands `modules` (we are their last holder) to the run's keepers; returns those none took."""
        if not modules:
            return []
        try:
            keepers = self.membership.keepers()
            return self.sync.hand_over(modules, keepers) if keepers else list(modules)
        except Exception as e:
            logger.warning(f"handing our modules over to the keepers failed: {type(e).__name__}: {e}")
            return list(modules)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.request_stop()
        if self.sync is not None and self.membership is not None:
            # first: the other holders stop waiting for our parts while we checkpoint and hand over
            self.sync.say_bye(list(self.sync.syncs), self.membership.holders())
        try:
            if self.sync is not None and self.step > 0 and self.checkpoints.saved_step != self.step:
                self.checkpoint(wait=True)
        except Exception as e:
            logger.error(f"final checkpoint failed: {e}")
        if self.membership is not None and self.sync is not None and self.sync.service is not None:
            # the last holder of a module hands it to the run's keepers before it goes
            self._hand_over(self.membership.modules_only_we_hold())
        if self.membership is not None:
            self.membership.leave()
        # the sync layer first (its rounds use the others), the DHT last (every part talks through it)
        for part in (
            self.data, self.sync, self.membership, self.router, self.metrics, self.dialback, self.artifacts,
            self.dht,
        ):  # fmt: skip
            if part is not None:
                part.shutdown()
        self.checkpoints.release()
