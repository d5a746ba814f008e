"""One training peer: its lifecycle and its training loop.

`Peer.start()` joins the DHT, verifies the run manifest, claims a path (`Membership`), builds the
path model and its sync layer (`PathSync`), restores a checkpoint or catches up with the holders
that are ahead, and starts the heartbeat. `Peer.run()` is the inner loop, with fragment syncs and
outer steps at Streaming DiLoCo's offsets; with fewer peers than paths, a peer rotates to the
least-trained path every --rotate_every_rounds rounds (`Peer._rotate`). `Peer.close()` checkpoints,
announces that the peer is leaving and shuts everything down; it is safe to call at any point.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from pathlib import Path

import psutil
import torch

from dht.node import start_dht
from dht.schema import ManifestRecord
from dht.validators import RecordSchemaValidator
from monitoring.metrics import PeerMetrics
from peer import __version__
from peer.artifacts.transfer import ArtifactService
from peer.checkpoint import CheckpointDirLock, CheckpointError, load_latest_checkpoint, save_checkpoint
from peer.config import PeerConfig, RunManifest
from peer.data.batches import PathBatches
from peer.data.sources import load_documents
from peer.errors import ConfigError
from peer.faults import fault_point
from peer.model.base import ModuleStates, base_modules
from peer.model.grid import parse_path, path_index, path_module_ids
from peer.model.transformer import PathModel
from peer.run.rebuild import check_tokenizer
from peer.run.record import load_verified_manifest
from peer.seeding import stable_seed
from peer.swarm.base_model import start_artifact_service
from peer.swarm.manifest import creator_of, fetch_manifest, publish_record
from peer.swarm.membership import Membership, Progress
from peer.swarm.reachability import DialBackService, helpers_from
from peer.swarm.rotation import Rotation
from peer.sync.outer import FragmentDone
from peer.sync.path_sync import PathSync
from peer.sync.service import SyncService
from peer.training.history import RoundHistory
from peer.training.inner import autocast_for, device_of, inner_step, make_inner_optimizer, tokens_in
from peer.training.rotate import PathRotation
from peer.training.router_switch import RouterSwitch
from peer.training.startup_checks import check_data, check_memory

logger = logging.getLogger(__name__)

#: throughput is reported over windows of at least this long
TOKENS_PER_SECOND_WINDOW_SECONDS = 2.0


class Peer(PathRotation, RouterSwitch):
    """A volunteer's peer: joins a run, trains one path and keeps its modules in sync."""

    def __init__(self, config: PeerConfig):
        self.config = config
        self.stop_requested = threading.Event()
        self.dht = None
        self.dialback: DialBackService | None = None
        self.membership: Membership | None = None
        self.sync: PathSync | None = None
        self.metrics: PeerMetrics | None = None
        self.manifest: RunManifest | None = None
        self.record: ManifestRecord | None = None
        self.run_id = ""
        self.step = 0
        self.tokens_total = 0
        # a join's cost as a volunteer sees it: from the process's start (imports included) to training
        self.process_started = psutil.Process().create_time()
        self.outer_round = 0
        self.last_loss = float("nan")
        self.tokens_per_second = 0.0
        self.history = RoundHistory()
        #: path index -> inner steps this peer trained on it (several paths once it rotated)
        self.path_steps: dict[int, int] = {}
        self._rotation: Rotation | None = None
        self._checkpointed_step = -1
        self._closed = False
        self._dir_lock: CheckpointDirLock | None = None
        self.artifacts: ArtifactService | None = None
        self.base: ModuleStates | None = None

    # --- start-up -------------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.device = device_of(cfg.device)
        if cfg.checkpoint_dir is not None:  # before anything joins: a second peer here stops at once
            self._dir_lock = CheckpointDirLock(cfg.checkpoint_dir).acquire()
        self.dht, self.key = start_dht(
            initial_peers=cfg.initial_peers,
            host_maddrs=cfg.host_maddrs,
            announce_maddrs=cfg.announce_maddrs,
            identity_path=cfg.identity_path,
            client_mode=cfg.client_mode,
            use_relay=cfg.use_relay,
            use_auto_relay=cfg.use_auto_relay,
            run_name=cfg.run_name,
        )
        self.peer_id = str(self.dht.peer_id)
        self.dialback = DialBackService(self.dht)
        self.reachability = self.dialback.check(
            self.dht, helpers_from(cfg.initial_peers), cfg.client_mode, cfg.use_auto_relay
        )
        logger.info(self.reachability.message)
        self.manifest, self.record = self._join_run()
        self.run_id = self.record.run_id
        self.dht.add_validators([RecordSchemaValidator(cfg.run_name, self.run_id)])
        check_memory(self.manifest, cfg, self.device)
        self._data_root = check_data(self.manifest, cfg)
        self.base = self._obtain_artifacts()
        self.tokenizer = check_tokenizer(self.manifest, self._artifact_folders())
        self.membership = Membership(
            self.dht, self.key, cfg, self.manifest, self.record, self._progress, self.device
        )
        self.membership.reachability = self.reachability.state
        self.membership.artifacts = self.artifacts
        if self.stop_requested.is_set():
            self.membership.request_stop()
        self.membership.read_claims()
        self.membership.probe(cycle=0)
        resumed = self._load_checkpoint() if cfg.resume else None
        fixed = parse_path(self.manifest.model, cfg.path) if cfg.path is not None else None
        if resumed is not None:
            fixed = tuple(resumed[1]["path"])
        self.path = self.membership.claim_path(fixed)
        logger.info(
            f"training path {path_index(self.manifest.model, self.path)} {self.path}: "
            f"modules {path_module_ids(self.manifest.model, self.path)}"
        )
        self._build_model()
        if resumed is not None:
            self._restore(*resumed)
        self._join_path()
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

    def _join_run(self) -> tuple[RunManifest, ManifestRecord]:
        """The run's verified manifest: from --manifest_path (then published for the others), or
        from the DHT; either way this peer keeps re-publishing it, so the run outlives its creator."""
        cfg = self.config
        pin = cfg.run_pin
        if cfg.manifest_path is not None:
            _, record = load_verified_manifest(cfg.manifest_path, cfg.run_name, pin)
            publish_record(self.dht, self.key, record)
            pin = record.run_id
        manifest, record = fetch_manifest(self.dht, cfg.run_name, pin, creator=cfg.creator)
        logger.info(
            f"joined run {cfg.run_name}@{record.run_id[:16]} (created by key {creator_of(record)[:16]}) "
            f"as {self.peer_id}"
        )
        publish_record(self.dht, self.key, record)
        return manifest, record

    def _obtain_artifacts(self) -> ModuleStates | None:
        """The run's base model (None if it has none) and data shards, fetched if need be and served
        from now on."""
        m = self.manifest
        if not (m.base_checkpoint or m.tokenizer_file or m.router_file or m.dataset.shards):
            return None
        self.artifacts, base = start_artifact_service(self.dht, self.key, self.config, m, self.run_id)
        return base

    def _artifact_folders(self) -> list[Path]:
        return [self.artifacts.store.root] if self.artifacts is not None else []

    def _load_checkpoint(self):
        loaded = load_latest_checkpoint(self.config.checkpoint_dir)
        if loaded is None:
            logger.info(f"no checkpoint in {self.config.checkpoint_dir}; starting fresh")
            return None
        tensors, meta = loaded
        if meta.get("run_id") != self.run_id:
            raise ConfigError(f"checkpoint in {self.config.checkpoint_dir} belongs to another run")
        return tensors, meta

    def _build_model(self, kept: PathModel | None = None, kept_sync: PathSync | None = None) -> None:
        """The path model, its inner optimizer and its sync layer; on a rotation, the modules the
        new path shares with `kept` (the old path's model) stay as they are, sync state included."""
        m = self.manifest
        ids = path_module_ids(m.model, self.path)
        # a run with a base model starts every module from it (peer/model/base.py); the modules a
        # rotation keeps stay as they are
        modules = base_modules(m.model, self.base, ids) if self.base is not None else {}
        modules.update(dict(kept.parts.items()) if kept is not None else {})
        self.model = PathModel(m.model, self.path, seed=m.seed, modules=modules).to(self.device)
        # DiPaCo gives each path its own inner optimizer: a path we rotate to starts a fresh one
        # (the old path's Adam moments belong to modules and a data shard we no longer train)
        self.inner = make_inner_optimizer(self.model.parameters(), m.inner, self.config.inner_optimizer)
        label = str(path_index(m.model, self.path))
        if self.metrics is None:
            self.metrics = PeerMetrics(self.config.run, self.peer_id, label, __version__)
        else:
            self.metrics.set_path(label)
        self.sync = PathSync(
            m,
            self.model,
            self.peer_id,
            self.metrics,
            group_of=self.membership.group_of,
            round_of=lambda: self.outer_round,
            kept=kept_sync,
        )

    def _join_path(self, service: SyncService | None = None) -> None:
        """Opens our path's sync layer (on the old path's `service` after a rotation), downloads the
        modules whose holders (or keepers) are ahead of us and reads the path's data shard: at
        start-up and after a rotation."""
        self.sync.start(self.dht, self.membership.is_holder, service)
        downloaded = self.sync.catch_up(self.membership.donors(), self.membership.kept())
        self.outer_round = max(self.outer_round, self.sync.outer_round)
        if downloaded:
            # a crash before the first round must not cost the download again (minutes for a big path)
            try:
                self.checkpoint()
            except CheckpointError as e:
                logger.error(f"checkpoint of the downloaded state failed, training goes on: {e}")
        self._start_data()

    def _start_data(self) -> None:
        m = self.manifest
        batches = PathBatches(
            load_documents(
                m.dataset,
                root=self._data_root,
                shard_folders=self._artifact_folders(),
            ),
            self._route(),
            path_index(m.model, self.path),
            self.tokenizer,
            m.seq_len,
            self.config.batch_size,
            seed=stable_seed(self.peer_id, self.step),
            eval_fraction=m.dataset.eval_fraction,
        )
        # The first batch routes the path's whole shard (seconds): do it before announcing that we
        # are ready, so a start barrier releases peers that can all step at once.
        self.batches = itertools.chain([next(batches)], batches)

    def _progress(self) -> Progress:
        progress = Progress(
            step=self.step,
            outer_round=self.outer_round,
            tokens_total=self.tokens_total,
            tokens_per_second=self.tokens_per_second,
            loss=self.history.entries[-1]["loss"] if self.history.entries else None,
        )
        if self.sync is not None:
            totals = self.sync.totals
            progress.digests = self.sync.fingerprints()
            progress.module_rounds = self.sync.fragment_rounds()
            progress.sync_outcomes = dict(totals.outcomes)
            progress.bad_parts = dict(totals.bad_parts)
            progress.bytes_sent, progress.bytes_received = totals.bytes_sent, totals.bytes_received
        progress.path_steps = dict(self.path_steps)
        return progress

    # --- training -------------------------------------------------------------------------------

    def run(self) -> None:
        m = self.manifest
        autocast = autocast_for(self.device)
        self.model.train()
        window_started, window_tokens = time.monotonic(), 0
        self.history.start_clock()
        first_step = True
        while not self._finishing():
            fault_point("train.step")
            batch = next(self.batches).to(self.device)
            self.last_loss = inner_step(self.model, self.inner, batch, m.inner, self.step, autocast=autocast)
            tokens = tokens_in(batch)
            if first_step:
                first_step = False
                logger.info(
                    f"first inner step {time.time() - self.process_started:.1f} s after the peer started"
                )
            self.step += 1
            index = path_index(m.model, self.path)
            self.path_steps[index] = self.path_steps.get(index, 0) + 1
            self.tokens_total += tokens
            window_tokens += tokens
            self.history.add_loss(self.last_loss)
            elapsed = time.monotonic() - window_started
            if elapsed > TOKENS_PER_SECOND_WINDOW_SECONDS:
                self.tokens_per_second = window_tokens / elapsed
                window_started, window_tokens = time.monotonic(), 0
            self.metrics.observe_step(tokens, self.last_loss, self.tokens_per_second)
            holders = self.membership.holders()
            for done in self.sync.after_step(self.step, self.tokens_total, holders):
                self._fragment_done(done, holders)
            if self._rotation is not None:  # decided at the round's end, made once its syncs are all done
                rotation, self._rotation = self._rotation, None
                self._rotate(rotation)
                self.model.train()
        holders = self.membership.holders()
        for done in self.sync.drain(self.step):
            self._fragment_done(done, holders)

    def _fragment_done(self, done: FragmentDone, holders: dict[str, list[str]]) -> None:
        for mid in done.results:
            self.metrics.set_holders(mid, len(set(holders.get(mid, [])) | {self.peer_id}))
        self.history.add_sync(done)
        if done.fragment != 0:
            return
        # Fragment 0 syncs at H, 2H, ...: one outer round per H inner steps. The trunk is on every
        # path, so its sync count is the swarm's clock: a peer that synced alone while the others
        # were starting is set back in step when it repairs its copy.
        self.outer_round = self.sync.outer_round
        entry = self.history.end_round(self.outer_round, self.step, self.tokens_total, done)
        # the log and the metrics show the swarm's round (the DHT claims carry it too) and our own count
        own = self.history.own_rounds
        self.metrics.set_rounds(self.outer_round, own)
        loss, outcomes = entry["loss"], entry["outcomes"]
        logger.info(f"round {self.outer_round} step {self.step} loss {loss:.4f} {outcomes} (own round {own})")
        if (
            self.config.checkpoint_dir is not None
            and self.outer_round % self.config.checkpoint_every_rounds == 0
        ):
            try:
                self.checkpoint()
            except CheckpointError as e:
                # a full disk must not stop the training: the last good checkpoint stays, we retry next round
                logger.error(f"checkpoint failed, training goes on: {e}")
                self.metrics.checkpoint_failed()
        self.membership.announce()
        self._follow_router()
        self._rotation = self._rotation_due()

    def _finishing(self) -> bool:
        cfg = self.config
        return (
            self.stop_requested.is_set()
            or (cfg.max_steps is not None and self.step >= cfg.max_steps)
            # this peer's own rounds, not the swarm's clock: a late joiner does as many as the others
            or (cfg.max_rounds is not None and self.history.own_rounds >= cfg.max_rounds)
        )

    # --- checkpoints and shutdown ---------------------------------------------------------------

    def checkpoint(self) -> Path | None:
        if self.config.checkpoint_dir is None:
            return None
        tensors = self.sync.state_tensors()
        for name, p in self.model.named_parameters():
            tensors[f"local/{name}"] = p.detach()
        meta = dict(
            step=self.step,
            run_id=self.run_id,
            run=self.config.run_name,
            path=list(self.path),
            path_steps={str(p): n for p, n in sorted(self.path_steps.items())},
            outer_round=self.outer_round,
            fragment_rounds=self.sync.fragment_rounds(),
            tokens_total=self.tokens_total,
            peer_id=self.peer_id,
            loss=self.last_loss if math.isfinite(self.last_loss) else None,
            history=self.history.entries[-200:],
            own_rounds=self.history.own_rounds,
            train_seconds=self.history.train_seconds,
            **self._router_meta(),
        )
        path = save_checkpoint(
            Path(self.config.checkpoint_dir), tensors, meta, keep=self.config.keep_checkpoints
        )
        self._checkpointed_step = self.step
        return path

    def _restore(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.step = int(meta["step"])
        self.outer_round = int(meta["outer_round"])
        self.tokens_total = int(meta.get("tokens_total", 0))
        # a checkpoint from before rotation trained only the path it names
        steps = meta.get("path_steps") or {path_index(self.manifest.model, self.path): self.step}
        self.path_steps = {int(p): int(n) for p, n in steps.items() if int(n) > 0}
        own = meta.get("own_rounds")
        self.history.restore(
            meta.get("history", []), float(meta.get("train_seconds", 0.0)), None if own is None else int(own)
        )
        self.sync.restore(tensors, meta.get("fragment_rounds"), self.outer_round, self.tokens_total)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors[f"local/{name}"].to(p.dtype))
        logger.info(
            f"resumed from checkpoint at step {self.step}, outer round {self.outer_round} "
            f"(own rounds {self.history.own_rounds}), fragment rounds {self.sync.fragment_rounds()}"
        )

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
        try:
            if self.sync is not None and self.step > 0 and self._checkpointed_step != self.step:
                self.checkpoint()
        except Exception as e:
            logger.error(f"final checkpoint failed: {e}")
        if self.membership is not None and self.sync is not None and self.sync.service is not None:
            # the last holder of a module hands it to the run's keepers before it goes
            self._hand_over(self.membership.modules_only_we_hold())
        if self.membership is not None:
            self.membership.leave()
        if self.sync is not None:
            self.sync.shutdown()
        if self.membership is not None:
            self.membership.shutdown()
        if self.metrics is not None:
            self.metrics.shutdown()
        if self.dialback is not None:
            self.dialback.shutdown()
        if self.artifacts is not None:
            self.artifacts.shutdown()
        if self.dht is not None:
            self.dht.shutdown()
        if self._dir_lock is not None:
            self._dir_lock.release()
