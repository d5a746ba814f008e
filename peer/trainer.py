"""One training peer: join the run, claim a path, train it, and sync its modules with their holders.

`Peer.start()` joins the DHT, verifies the manifest, claims a path, builds the path model and one
`ModuleSync` + `ModuleAverager` per module, and catches up (checkpoint and/or download of the
current global copies). `Peer.run()` is the inner loop with an outer round every H steps.
`Peer.close()` checkpoints and leaves; it is safe to call at any point.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from dht.keys import CLAIM_TTL_SECONDS, averaging_prefix
from dht.node import SwarmError, start_dht
from dht.schema import ClaimRecord, ProbeRecord
from dht.validators import RecordSchemaValidator
from monitoring.metrics import PeerMetrics
from peer.averaging import ModuleAverager
from peer.checkpoint import load_latest_checkpoint, save_checkpoint
from peer.claims import ClaimView, choose_path, holders_by_module, publish_claim, should_move
from peer.config import PeerConfig, RunManifest
from peer.data import PathBatches, load_documents
from peer.faults import fault_point
from peer.manifest import fetch_manifest, load_record, publish_record, verify_record
from peer.model import (
    TRUNK,
    PathModel,
    all_paths,
    parse_path,
    path_from_index,
    path_index,
    path_module_ids,
    stable_seed,
)
from peer.module_sync import ModuleSync, StateRejected
from peer.outer import StreamingOuter
from peer.planning import build_snapshot, my_averaging_group, path_parameters, planned_path
from peer.probes import (
    ProbeService,
    free_memory_bytes,
    live_probes,
    load_probe_file,
    measure_tokens_per_second,
    publish_probe,
    sample_peers,
)
from peer.run_setup import check_tokenizer, device_of, make_route

logger = logging.getLogger(__name__)
VERSION = "0.1.0"


def _cosine_lr(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class Peer:
    def __init__(self, config: PeerConfig):
        self.config = config
        self.dht = None
        self.key = None
        self.manifest: RunManifest | None = None
        self.run_id = ""
        self.syncs: dict[str, ModuleSync] = {}
        self.metrics: PeerMetrics | None = None
        self.step = 0
        self.tokens_total = 0
        self.tokens_since_sync = 0
        self.outer_round = 0
        self.last_loss = float("nan")
        self.tokens_per_second = 0.0
        self.stop_requested = threading.Event()
        self._dht_lock = threading.Lock()
        self._heartbeat: threading.Thread | None = None
        self._claims: dict[str, ClaimRecord] = {}
        self._closed = False
        self.history: list[dict] = []
        self._round_losses: list[float] = []
        self._checkpointed_step = -1
        self._round_bytes = self._round_peak_bytes = 0
        self._ready = False
        self._probe_service: ProbeService | None = None
        self._probe_record: ProbeRecord | None = None
        self._probes: dict[str, ProbeRecord] = {}
        self._snapshot = None
        self._claim_view: ClaimView | None = None
        self._train_seconds_before = 0.0  # from a resumed checkpoint
        self._train_clock: float | None = None

    # --- start-up -------------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        self.device = device_of(cfg.device)
        if cfg.inner_optimizer == "adamw8bit" and self.device.type != "cuda":
            raise SwarmError("--inner_optimizer adamw8bit needs a CUDA device (bitsandbytes 8-bit AdamW)")
        self.dht, self.key = start_dht(
            initial_peers=cfg.initial_peers,
            host_maddrs=cfg.host_maddrs,
            announce_maddrs=cfg.announce_maddrs,
            identity_path=cfg.identity_path,
            client_mode=cfg.client_mode,
            run_name=cfg.run_name,
        )
        self.peer_id = str(self.dht.peer_id)
        self._join_run()
        self.dht.add_validators([RecordSchemaValidator(cfg.run_name, self.run_id)])
        self.tokenizer = check_tokenizer(self.manifest)
        self._path_parameters = path_parameters(self.manifest)
        if cfg.probe_file is None:
            self._probe_service = ProbeService(self.dht)
        self._claims = self._read_claims()
        self._probe(cycle=0)
        resumed = self._load_checkpoint() if cfg.resume else None
        self._claim_path(resumed)
        self._build_model()
        if resumed is not None:
            self._restore(resumed)
        self._build_averagers()
        self._catch_up()
        self._start_data()
        if cfg.metrics_port is not None:
            port = self.metrics.serve(cfg.metrics_port, cfg.metrics_host)
            logger.info(f"metrics on http://{cfg.metrics_host}:{port}/metrics")
        self._ready = True
        self._publish_claim()
        if self.manifest.sync.max_group_size:
            self._snapshot = self._build_snapshot()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._heartbeat.start()
        if cfg.wait_for_peers > 1:
            self._wait_for_peers(cfg.wait_for_peers, cfg.wait_for_peers_timeout_seconds, ready_only=True)

    def _wait_for_peers(self, n: int, timeout: float, ready_only: bool) -> None:
        what = "ready" if ready_only else "claimed a path"
        deadline = time.monotonic() + timeout
        while not self.stop_requested.is_set():
            claims = self._read_claims()
            count = sum(c.ready or not ready_only for c in claims.values())
            if count >= n:
                logger.info(f"{count} peers have {what}")
                # The first syncs can come before the next heartbeat refreshes the holders: with an
                # older snapshot a peer would sync "alone" and its global copy drift from the others.
                self._claims = claims
                return
            if time.monotonic() > deadline:
                logger.warning(f"only {count} of {n} peers have {what} after {timeout:.0f}s: going on")
                return
            time.sleep(0.5)

    def _join_run(self) -> None:
        cfg = self.config
        pin = cfg.run_pin
        if cfg.manifest_path is not None:
            record = load_record(cfg.manifest_path)
            try:
                manifest = verify_record(record)
            except ValueError as e:
                raise SwarmError(f"manifest file {cfg.manifest_path} does not verify: {e}") from e
            if manifest.name != cfg.run_name:
                raise SwarmError(
                    f"manifest file {cfg.manifest_path} is for run {manifest.name!r}, not {cfg.run_name!r}"
                )
            if pin and not record.run_id.startswith(pin):
                raise SwarmError(
                    f"manifest file {cfg.manifest_path} has hash {record.run_id[:12]}, not {pin}"
                )
            publish_record(self.dht, self.key, record)
            pin = record.run_id
        self.manifest, self.record = fetch_manifest(self.dht, cfg.run_name, pin)
        self.run_id = self.record.run_id
        logger.info(f"joined run {cfg.run_name}@{self.run_id[:12]} as {self.peer_id}")
        publish_record(self.dht, self.key, self.record)  # every holder keeps the run alive

    def _load_checkpoint(self):
        if self.config.checkpoint_dir is None:
            raise SwarmError("--resume needs --checkpoint_dir")
        loaded = load_latest_checkpoint(self.config.checkpoint_dir)
        if loaded is None:
            logger.info(f"no checkpoint in {self.config.checkpoint_dir}; starting fresh")
            return None
        tensors, meta = loaded
        if meta.get("run_id") != self.run_id:
            raise SwarmError(f"checkpoint in {self.config.checkpoint_dir} belongs to another run")
        return tensors, meta

    def _claim_path(self, resumed) -> None:
        mcfg = self.manifest.model
        if self.config.path is not None:
            self.path = parse_path(mcfg, self.config.path)
            self._explicit_path = True
        elif resumed is not None:
            self.path = tuple(resumed[1]["path"])
            self._explicit_path = True
        else:
            self._claims = self._read_claims()
            self.path = path_from_index(mcfg, self._choose_path(joining=True))
            self._explicit_path = False
        self._publish_claim()
        if not self._explicit_path:
            # Peers that joined together may have picked the same path: look again once claims
            # settled (for a run whose peers start together, once all of them have claimed).
            if self.config.wait_for_peers > 1:
                self._wait_for_peers(
                    self.config.wait_for_peers, self.config.wait_for_peers_timeout_seconds, False
                )
            time.sleep(min(2.0, self.config.heartbeat_seconds))
            self._claims = self._read_claims()
            target = self._choose_path(joining=False)
            if target != path_index(mcfg, self.path):
                logger.info(f"moving from path {path_index(mcfg, self.path)} to {target} before training")
                self.path = path_from_index(mcfg, target)
                self._publish_claim()
        logger.info(
            f"training path {path_index(mcfg, self.path)} {self.path}: "
            f"modules {path_module_ids(mcfg, self.path)}"
        )

    def _choose_path(self, joining: bool) -> int:
        """The plan's path for us ("planned" runs), else the least-covered one."""
        mcfg = self.manifest.model
        if self.manifest.scheduler.mode == "planned":
            try:
                snapshot = self._build_snapshot()
                path = planned_path(
                    self.manifest, snapshot, self._claims, self.peer_id, stable_seed(self.run_id), joining
                )
                if path is not None:
                    return path
                logger.warning("the plan left us unplaced; taking the least-covered path")
            except Exception as e:  # planning must never keep a volunteer from training
                logger.warning(f"planning failed ({type(e).__name__}: {e}); taking the least-covered path")
        if joining:
            return choose_path(mcfg, self._claims, self.peer_id)
        current = path_index(mcfg, self.path)
        target = should_move(mcfg, self._claims, self.peer_id, current)
        return current if target is None else target

    # --- probes and the plan ----------------------------------------------------------------------

    def _build_snapshot(self):
        # Like claims, probe records missing from one read are kept (while their peer's claim is).
        with self._dht_lock:
            self._probes.update(live_probes(self.dht, self.config.run_name, self.run_id))
        self._probes[self.peer_id] = self._probe_record
        self._probes = {p: r for p, r in self._probes.items() if p in self._claims or p == self.peer_id}
        return build_snapshot(
            self.manifest, self._probes, self._claims, self._path_parameters, self.config.batch_size
        )

    def _probe(self, cycle: int) -> None:
        """Measures (or reads injected) compute, memory and links, and publishes them."""
        cfg = self.config
        if cfg.probe_file is not None:
            record = load_probe_file(cfg.probe_file, self.peer_id)
        else:
            if self.tokens_per_second > 0:
                tps = self.tokens_per_second
            else:
                probe_model = PathModel(
                    self.manifest.model, (0,) * self.manifest.model.n_levels, self.manifest.seed
                )
                tps = measure_tokens_per_second(
                    probe_model.to(self.device), cfg.batch_size, self.manifest.seq_len, self.device
                )
            with self._dht_lock:
                known = list(live_probes(self.dht, cfg.run_name, self.run_id)) + list(self._claims)
            targets = sample_peers(known, self.peer_id, cycle, self.manifest.scheduler.max_links)
            links = self._probe_service.measure_links(targets) if self._probe_service and targets else {}
            record = ProbeRecord(
                peer_id=self.peer_id,
                tokens_per_second=max(tps, 1e-3),
                memory_bytes=free_memory_bytes(self.device),
                links={p: [lat, bw] for p, (lat, bw) in links.items()},
            )
        self._probe_record = record
        with self._dht_lock:
            publish_probe(self.dht, self.key, cfg.run_name, self.run_id, record)

    def _group_of(self, module_id: str, round_index: int):
        if not self.manifest.sync.max_group_size or self._snapshot is None:
            return None
        return my_averaging_group(
            self.manifest, self._snapshot, self._claims, self.peer_id, module_id, round_index
        )

    def _build_model(self) -> None:
        m = self.manifest
        self.model = PathModel(m.model, self.path, seed=m.seed).to(self.device)
        paths_through = {
            mid: sum(mid in path_module_ids(m.model, p) for p in all_paths(m.model))
            for mid in self.model.module_ids
        }
        self.syncs = {
            mid: ModuleSync(
                m.model, mid, self.model.parts[mid], m.outer, m.sync.fragments, paths_through[mid]
            )
            for mid in self.model.module_ids
        }
        params = list(self.model.parameters())
        betas = (m.inner.beta1, m.inner.beta2)
        if self.config.inner_optimizer == "adamw8bit":
            import bitsandbytes as bnb

            self.inner = bnb.optim.AdamW8bit(
                params, lr=m.inner.lr, betas=betas, weight_decay=m.inner.weight_decay
            )
        else:
            self.inner = torch.optim.AdamW(
                params, lr=m.inner.lr, betas=betas, weight_decay=m.inner.weight_decay
            )
        self.metrics = PeerMetrics(
            self.config.run, self.peer_id, str(path_index(m.model, self.path)), VERSION
        )
        self.outer = StreamingOuter(
            self.syncs,
            m,
            self.peer_id,
            self.metrics,
            group_of=self._group_of,
            round_of=lambda: self.outer_round,
        )

    def _build_averagers(self) -> None:
        sync = self.manifest.sync
        for mid, ms in self.syncs.items():
            ms.averager = ModuleAverager(
                max(ms.fragment_size(f) for f in range(ms.n_fragments)),
                self.dht,
                prefix=averaging_prefix(self.config.run_name, self.run_id, mid),
                codec=sync.codec,
                state_provider=lambda ms=ms: (ms.state_metadata(), ms.state_tensors()),
                checksum_seed=stable_seed(self.run_id, mid),
                max_part_norm=sync.max_delta_norm,
                state_numel=2 * ms.plan.numel,
                start=True,
                min_matchmaking_time=sync.matchmaking_time_seconds,
                request_timeout=min(3.0, sync.matchmaking_time_seconds / 2),
                target_group_size=None,
                client_mode=self.config.client_mode,
            )
            # Donors rank themselves differently per module, so a joiner's downloads spread out.
            ms.averager.state_sharing_priority = stable_seed(self.peer_id, mid) / 2**63

    def _catch_up(self) -> None:
        """Downloads the global copy of every module that other holders have advanced past ours.
        Donors are the most advanced holders, ordered by a hash of (us, module, donor), so a joiner's
        modules come from different peers rather than all from one."""
        self._claims = self._read_claims()
        others = {k: v for k, v in self._claims.items() if k != self.peer_id and not v.client_mode}
        holders = holders_by_module(others, ready_only=True)
        for mid, ms in self.syncs.items():
            claims = [others[p] for p in holders.get(mid, [])]
            best = max((c.outer_round for c in claims), default=0)
            if best == 0 or best <= self.outer_round:
                continue  # nobody is ahead of us (round 0: everyone starts from the seeded init)
            donors = sorted(
                (c.peer_id for c in claims if c.outer_round == best),
                key=lambda d, mid=mid: stable_seed(self.peer_id, mid, d),
            )
            got = ms.averager.download_state(donors, timeout=self.manifest.sync.averaging_timeout_seconds)
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
        self.outer_round = max(self.outer_round, self.syncs[TRUNK].outer_round)

    def _start_data(self) -> None:
        m = self.manifest
        self.batches = PathBatches(
            load_documents(m.dataset),
            make_route(m),
            path_index(m.model, self.path),
            self.tokenizer,
            m.seq_len,
            self.config.batch_size,
            seed=stable_seed(self.peer_id, self.step),
            eval_fraction=m.dataset.eval_fraction,
        )

    # --- DHT traffic ----------------------------------------------------------------------------

    def _read_claims(self) -> dict[str, ClaimRecord]:
        if self._claim_view is None:
            self._claim_view = ClaimView(self.config.run_name, self.run_id)
        with self._dht_lock:
            return self._claim_view.update(self.dht)

    def _claim_record(self, leaving: bool = False) -> ClaimRecord:
        m = self.manifest
        modules = path_module_ids(m.model, self.path)
        # sum and L1 norm of each module's global copy: cheap, and enough to see holders disagree
        fingerprints = {
            mid: [
                float(sum(g.sum() for g in ms.global_flats)),
                float(sum(g.abs().sum() for g in ms.global_flats)),
            ]
            for mid, ms in self.syncs.items()
        }
        return ClaimRecord(
            peer_id=self.peer_id,
            path=path_index(m.model, self.path),
            modules=modules,
            step=self.step,
            outer_round=self.outer_round,
            tokens_total=self.tokens_total,
            tokens_per_second=self.tokens_per_second,
            client_mode=self.config.client_mode,
            fingerprints=fingerprints,
            ready=self._ready,
            leaving=leaving,
        )

    def _publish_claim(self, leaving: bool = False) -> None:
        with self._dht_lock:
            publish_claim(self.dht, self.key, self.config.run_name, self.run_id, self._claim_record(leaving))

    def _heartbeat_loop(self) -> None:
        last_manifest = last_probe = time.monotonic()
        cycle = 0
        while not self.stop_requested.wait(self.config.heartbeat_seconds):
            try:
                self._publish_claim()
                self._claims = self._read_claims()
                self.metrics.set_peers_seen(len(self._claims))
                if time.monotonic() - last_probe > self.manifest.scheduler.probe_every_seconds:
                    cycle += 1
                    self._probe(cycle)
                    last_probe = time.monotonic()
                if self.manifest.sync.max_group_size:
                    self._snapshot = self._build_snapshot()
                if time.monotonic() - last_manifest > 60:
                    with self._dht_lock:
                        publish_record(self.dht, self.key, self.record)
                    last_manifest = time.monotonic()
            except Exception as e:  # a heartbeat must never kill the peer
                logger.warning(f"heartbeat failed: {e}")

    # --- training -------------------------------------------------------------------------------

    def run(self) -> None:
        m, cfg = self.manifest, self.config
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()
        )
        self.model.train()
        window_started, window_tokens = time.monotonic(), 0
        self._train_clock = time.monotonic()
        while not self.stop_requested.is_set():
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                break
            if cfg.max_rounds is not None and self.outer_round >= cfg.max_rounds:
                break
            fault_point("train.step")
            batch = next(self.batches).to(self.device)
            for group in self.inner.param_groups:
                group["lr"] = m.inner.lr * _cosine_lr(self.step, m.inner.warmup_steps, m.inner.total_steps)
            with autocast:
                loss = self.model.loss(batch)
            if not torch.isfinite(loss):
                raise RuntimeError(
                    f"loss became {loss.item()} at step {self.step}; stopping before it spreads"
                )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), m.inner.grad_clip_norm)
            self.inner.step()
            self.inner.zero_grad(set_to_none=True)
            tokens = batch.shape[0] * (batch.shape[1] - 1)
            self.step += 1
            self.tokens_total += tokens
            self.tokens_since_sync += tokens
            window_tokens += tokens
            self.last_loss = loss.item()
            self._round_losses.append(self.last_loss)
            elapsed = time.monotonic() - window_started
            if elapsed > 2.0:
                self.tokens_per_second = window_tokens / elapsed
                window_started, window_tokens = time.monotonic(), 0
            self.metrics.observe_step(tokens, self.last_loss, self.tokens_per_second)
            self._after_step()
        for done in self.outer.drain(self.step):
            self._fragment_done(done, holders_by_module(self._claims))

    @property
    def train_seconds(self) -> float:
        """Wall time spent in the training loop, waits on averaging included."""
        running = time.monotonic() - self._train_clock if self._train_clock is not None else 0.0
        return self._train_seconds_before + running

    def _after_step(self) -> None:
        holders = holders_by_module(self._claims)
        for done in self.outer.after_step(self.step, self.tokens_total, holders):
            self._fragment_done(done, holders)

    def _fragment_done(self, done, holders: dict[str, list[str]]) -> None:
        for mid in done.results:
            self.metrics.set_holders(mid, len(set(holders.get(mid, [])) | {self.peer_id}))
        self._round_bytes += done.bytes_sent
        self._round_peak_bytes = max(self._round_peak_bytes, done.bytes_sent)
        if done.fragment != 0:
            return
        # Fragment 0 syncs at H, 2H, ...: one outer round per H inner steps.
        round_loss = sum(self._round_losses) / max(1, len(self._round_losses))
        self._round_losses = []
        # The trunk is on every path, so its sync count is the swarm's clock: a peer that synced
        # alone while the others were starting is set back in step when it repairs its copy.
        self.outer_round = self.syncs[TRUNK].outer_round
        summary = done.summary()
        logger.info(f"round {self.outer_round} step {self.step} loss {round_loss:.4f} {summary}")
        self.history.append(
            dict(
                round=self.outer_round,
                step=self.step,
                loss=round_loss,
                outcomes=summary,
                bytes_sent=self._round_bytes,
                # the most this peer put on the wire for one sync event (a fragment, or everything)
                peak_sync_bytes=self._round_peak_bytes,
                groups={mid: r.members for mid, r in done.results.items()},
                tokens_total=self.tokens_total,
                time=time.time(),
                train_seconds=self.train_seconds,
            )
        )
        self._round_bytes = self._round_peak_bytes = 0
        if (
            self.config.checkpoint_dir is not None
            and self.outer_round % self.config.checkpoint_every_rounds == 0
        ):
            self.checkpoint()
        self._publish_claim()

    # --- checkpoints and shutdown ---------------------------------------------------------------

    def checkpoint(self) -> Path | None:
        if self.config.checkpoint_dir is None:
            return None
        tensors: dict[str, torch.Tensor] = {}
        for ms in self.syncs.values():
            tensors.update(ms.named_state())
        for name, p in self.model.named_parameters():
            tensors[f"local/{name}"] = p.detach()
        meta = dict(
            step=self.step,
            run_id=self.run_id,
            run=self.config.run_name,
            path=list(self.path),
            outer_round=self.outer_round,
            tokens_total=self.tokens_total,
            peer_id=self.peer_id,
            loss=self.last_loss if math.isfinite(self.last_loss) else None,
            history=self.history[-200:],
        )
        path = save_checkpoint(
            Path(self.config.checkpoint_dir), tensors, meta, keep=self.config.keep_checkpoints
        )
        self._checkpointed_step = self.step
        return path

    def _restore(self, resumed) -> None:
        tensors, meta = resumed
        self.step = int(meta["step"])
        self.outer_round = int(meta["outer_round"])
        self.tokens_total = int(meta.get("tokens_total", 0))
        self.history = list(meta.get("history", []))
        rounds = meta.get("fragment_rounds", {})
        for mid, ms in self.syncs.items():
            ms.load_named_state(tensors, rounds.get(mid, [self.outer_round] * ms.n_fragments))
        self.outer.reset_tokens(self.tokens_total)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors[f"local/{name}"].to(p.dtype))
        logger.info(f"resumed from checkpoint at step {self.step}, outer round {self.outer_round}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop_requested.set()
        try:
            if self.syncs and self.step > 0 and self._checkpointed_step != self.step:
                self.checkpoint()
        except Exception as e:
            logger.error(f"final checkpoint failed: {e}")
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=10)
        if self.dht is not None and self.run_id and self.syncs:
            try:
                self._publish_claim(leaving=True)
            except Exception as e:
                logger.debug(f"could not announce leaving: {e}")
        for ms in self.syncs.values():
            if ms.averager is not None:
                try:
                    ms.averager.shutdown()
                except Exception as e:
                    logger.debug(f"averager shutdown: {e}")
        if self._probe_service is not None:
            self._probe_service.shutdown()
        if self.metrics is not None:
            self.metrics.shutdown()
        if self.dht is not None:
            self.dht.shutdown()


def n_other_holders(holders: dict[str, list[str]], mid: str, me: str) -> int:
    return len(set(holders.get(mid, [])) - {me})


__all__ = ["Peer", "ModuleAverager", "CLAIM_TTL_SECONDS"]
