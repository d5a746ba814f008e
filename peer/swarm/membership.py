"""One peer's membership in a run: its claim, its view of the other peers, the plan, the heartbeat.

`Membership` holds what a peer says about itself in the DHT (its path claim with progress, its
probe record) and what it believes about the others (claims and probes, kept stable across short
reads), chooses the path to claim (the plan, else the least-covered path), and runs the heartbeat
thread that renews the claim, re-reads the others, re-probes now and then and keeps the manifest
alive. The training loop only reads its views; every DHT call goes through one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey

from dht.keys import MANIFEST_REPUBLISH_SECONDS
from dht.schema import MAX_ROUND_STEPS_ENTRIES, ClaimRecord, ManifestRecord, ProbeRecord
from monitoring.metrics import PeerMetrics
from peer import __version__
from peer.config import PeerConfig, RunManifest
from peer.model.grid import Path, path_from_index, path_index, path_module_ids
from peer.model.transformer import PathModel
from peer.run.admission import AdmissionCheck
from peer.seeding import stable_seed
from peer.swarm import probes
from peer.swarm.admission import save_token
from peer.swarm.admission import seek as seek_admission
from peer.swarm.claims import (
    ClaimView,
    choose_path,
    holders_by_module,
    last_held,
    publish_claim,
    should_move,
    steering_claims,
)
from peer.swarm.keeper import kept_modules
from peer.swarm.manifest import publish_record
from peer.swarm.planning import build_snapshot, my_averaging_group, path_parameters, planned_path
from peer.swarm.progress import Progress
from peer.swarm.rotation import (
    Rotation,
    RotationRead,
    claimed_path_steps,
    live_claims,
    plan_rotation,
    round_view,
)
from peer.sync.standing import Standing

logger = logging.getLogger(__name__)

#: every how many heartbeats a peer on probation in an open run asks the run's authority to admit it
ADMISSION_SEEK_HEARTBEATS = 4


class Membership:
    """This peer's claim and its view of the run's other peers, renewed by a heartbeat thread."""

    def __init__(
        self,
        dht: hivemind.DHT,
        key: RSAPrivateKey,
        config: PeerConfig,
        manifest: RunManifest,
        record: ManifestRecord,
        progress: Callable[[], Progress],
        device: torch.device,
        admission: str = "",
    ):
        """`admission`: this peer's token ("" on probation: the heartbeat asks the run's authority)."""
        self.dht, self.key, self.config = dht, key, config
        self.manifest, self.record = manifest, record
        self.run_name, self.run_id = config.run_name, record.run_id
        self.peer_id = str(dht.peer_id)
        self.progress = progress
        self.device = device
        self.path: Path | None = None
        #: false until the peer caught up and can average; holders do not wait for it before
        self.ready = False
        #: how other peers reach us: "direct", "relay", "unreachable" or "unknown" (not checked yet)
        self.reachability = "unknown"
        #: the claim view; replaced by each read, never changed in place: what is worked out from it is
        #: kept per view (`holders`, the rotation's first-seen notes)
        self.claims: dict[str, ClaimRecord] = {}
        self._holders: tuple[dict, dict[str, list[str]]] = ({}, {})  # (the view, its ready holders)
        self.snapshot = None
        self._lock = threading.Lock()  # one DHT call at a time: training thread vs heartbeat
        self._claim_view = ClaimView.of_run(manifest, record)
        self._probes: dict[str, ProbeRecord] = {}
        self._probe_record: ProbeRecord | None = None
        self._path_parameters = path_parameters(manifest)
        self._probe_service = probes.ProbeService(dht) if config.probe_file is None else None
        self._stop = threading.Event()
        self._wake = threading.Event()  # "publish our claim now" from the training loop
        self._rotation_read = RotationRead(config.rotate_every_rounds)  # a read for the next rotation
        self._heartbeat: threading.Thread | None = None
        #: the peer's artifact service, whose offers the heartbeat keeps published (None: no artifacts)
        self.artifacts = None
        #: the peer's signed contribution totals, which the heartbeat keeps published (None: not yet)
        self.contribution = None
        self._keeper_tokens: dict[str, str] = {}
        #: whose votes count, from the tokens in claims (peer/run/admission.py); ours goes in our claim
        self.standing = Standing(
            AdmissionCheck.of(record), manifest.admission.mode, self._token_of, self.peer_id
        )
        self.standing.own_token = admission

    # --- views ----------------------------------------------------------------------------------

    def read_claims(self) -> dict[str, ClaimRecord]:
        with self._lock:
            self.claims = self._claim_view.update(self.dht)
        return self.claims

    def is_holder(self, peer_id: str, module: str) -> bool:
        """Whether the claim view has `peer_id` claiming a path through `module` (any thread)."""
        claim = self.claims.get(peer_id)
        return claim is not None and module in claim.modules

    def holders(self) -> dict[str, list[str]]:
        """Ready holders of each module in the claim view (a copy), worked out once per view: the
        training loop asks every step, and a flooded view holds hundreds of claims."""
        claims = self.claims
        if self._holders[0] is not claims:
            self._holders = (claims, holders_by_module(claims))
        return {module: list(peers) for module, peers in self._holders[1].items()}

    def donors(self) -> dict[str, list[tuple[str, int]]]:
        """(peer id, total fragment rounds) of the other holders of each module, movers included: one
        keeping the module as it moves holds its state (two peers moving onto a path at once reset it)."""
        self.read_claims()
        others = {k: v for k, v in self.claims.items() if k != self.peer_id and not v.client_mode}
        held = holders_by_module(others, ready_only=False)
        return {m: [(p, sum(others[p].module_rounds.get(m, [0]))) for p in ps] for m, ps in held.items()}

    def kept(self) -> dict[str, list[tuple[str, int]]]:
        """(keeper peer id, total fragment rounds) of every module a keeper holds."""
        with self._lock:
            kept = kept_modules(self.dht, self.run_name, self.run_id, self._keeper_tokens)
        kept.pop("", None)
        return kept

    def keepers(self) -> list[str]:
        with self._lock:
            return [p for p, _ in kept_modules(self.dht, self.run_name, self.run_id, self._keeper_tokens)[""]]

    def _token_of(self, peer: str) -> str:
        """The admission token a peer's claim (or a keeper's record) carries."""
        claim = self.claims.get(peer)
        return claim.admission if claim is not None else self._keeper_tokens.get(peer, "")

    def modules_only_we_hold(self, modules: list[str] | None = None) -> list[str]:
        """Modules of our path (or `modules` of it) no other ready peer with standing holds: we are
        their last holder (`claims.last_held`)."""
        ours = path_module_ids(self.manifest.model, self.path) if modules is None else modules
        return last_held(ours, self.holders(), self.peer_id, self.standing)

    def group_of(self, module_id: str, round_index: int) -> tuple[int, list[str]] | None:
        """Our planned subgroup of the module's holders this round (None: all holders together)."""
        if not self.manifest.sync.max_group_size or self.snapshot is None:
            return None
        return my_averaging_group(
            self.manifest, self.snapshot, self.claims, self.peer_id, module_id, round_index
        )

    def build_snapshot(self):
        # Like claims, probe records missing from one read are kept (while their peer's claim is).
        with self._lock:
            self._probes.update(probes.live_probes(self.dht, self.run_name, self.run_id))
        self._probes[self.peer_id] = self._probe_record
        self._probes = {p: r for p, r in self._probes.items() if p in self.claims or p == self.peer_id}
        return build_snapshot(
            self.manifest, self._probes, self.claims, self._path_parameters, self.config.batch_size
        )

    # --- what we say about ourselves ------------------------------------------------------------

    def claim_record(self, leaving: bool = False) -> ClaimRecord:
        m, p = self.manifest, self.progress()
        return ClaimRecord(
            peer_id=self.peer_id, path=path_index(m.model, self.path),
            modules=path_module_ids(m.model, self.path), step=p.step, outer_round=p.outer_round,
            tokens_total=p.tokens_total, tokens_per_second=p.tokens_per_second,
            client_mode=self.config.client_mode, digests=p.digests, module_rounds=p.module_rounds,
            ready=self.ready, leaving=leaving, software_version=__version__, reachability=self.reachability,
            loss=p.loss, sync_outcomes=p.sync_outcomes, bad_parts=p.bad_parts, bytes_sent=p.bytes_sent,
            bytes_received=p.bytes_received, path_steps=claimed_path_steps(p.path_steps),
            round_steps={str(i): n for i, n in sorted(p.round_steps.items())[:MAX_ROUND_STEPS_ENTRIES]},
            admission=self.standing.own_token,
        )  # fmt: skip

    def publish_claim(self, leaving: bool = False) -> None:
        # the record is made under the lock: one made before a move and stored after it put the
        # mover back on its old path in every view (same step, later expiry) until the next beat
        with self._lock:
            publish_claim(self.dht, self.key, self.run_name, self.run_id, self.claim_record(leaving))

    def announce(self) -> None:
        """Publishes our claim (new progress and digests) from the heartbeat thread, at once: the
        training loop never waits on the DHT, whose stores to unreachable nodes take their RPC
        timeouts (seconds, in a partition) and would put this peer out of step with its groups."""
        if self._heartbeat is None or not self._heartbeat.is_alive():
            self.publish_claim()
        else:
            # a read for the next round's rotation, where one is possible (a path nobody holds)
            self._rotation_read.round_ended(
                self.progress().outer_round, lambda: self.path is not None and self._uncovered()
            )
            self._wake.set()

    def probe(self, cycle: int) -> None:
        """Measures (or reads injected) compute, memory and links, and publishes them."""
        cfg, m = self.config, self.manifest
        if cfg.probe_file is not None:
            record = probes.load_probe_file(cfg.probe_file, self.peer_id)
        else:
            tps = self.progress().tokens_per_second
            if tps <= 0:
                probe_model = PathModel(m.model, (0,) * m.model.n_levels, m.seed).to(self.device)
                tps = probes.measure_tokens_per_second(probe_model, cfg.batch_size, m.seq_len, self.device)
            with self._lock:
                known = list(probes.live_probes(self.dht, self.run_name, self.run_id)) + list(self.claims)
            targets = probes.sample_peers(known, self.peer_id, cycle, m.scheduler.max_links)
            links = self._probe_service.measure_links(targets) if self._probe_service and targets else {}
            record = ProbeRecord(
                peer_id=self.peer_id,
                tokens_per_second=max(tps, 1e-3),
                memory_bytes=probes.free_memory_bytes(self.device),
                links={p: [lat, bw] for p, (lat, bw) in links.items()},
                admission=self.standing.own_token,
            )
        self._probe_record = record
        with self._lock:
            probes.publish_probe(self.dht, self.key, self.run_name, self.run_id, record)

    # --- choosing a path ------------------------------------------------------------------------

    def claim_path(self, fixed: Path | None) -> Path:
        """Claims `fixed` (a --path flag or a resumed checkpoint's path), or the path of the plan,
        else the least-covered one; peers that joined together look again once claims settle."""
        mcfg = self.manifest.model
        if fixed is not None:
            self.path = fixed
            self.publish_claim()
            return fixed
        self.read_claims()
        self.path = path_from_index(mcfg, self._choose_path(joining=True))
        self.publish_claim()
        # Peers that joined together may have picked the same path: look again once claims settled
        # (for a run whose peers start together, once all of them have claimed).
        if self.config.wait_for_peers > 1:
            self.wait_for_peers(self.config.wait_for_peers, ready_only=False)
        time.sleep(min(2.0, self.config.heartbeat_seconds))
        self.read_claims()
        target = self._choose_path(joining=False)
        if target != path_index(mcfg, self.path):
            logger.info(f"moving from path {path_index(mcfg, self.path)} to {target} before training")
            self.path = path_from_index(mcfg, target)
            self.publish_claim()
        return self.path

    def _choose_path(self, joining: bool) -> int:
        """The plan's path for us ("planned" runs), else the least-covered one."""
        mcfg = self.manifest.model
        if self.manifest.scheduler.mode == "planned":
            try:
                path = planned_path(
                    self.manifest,
                    self.build_snapshot(),
                    self.claims,
                    self.peer_id,
                    stable_seed(self.run_id),
                    joining,
                )
                if path is not None:
                    return path
                logger.warning("the plan left us unplaced; taking the least-covered path")
            except Exception as e:  # planning must never keep a volunteer from training
                logger.warning(f"planning failed ({type(e).__name__}: {e}); taking the least-covered path")
        if joining:
            return choose_path(mcfg, self.claims, self.peer_id)
        current = path_index(mcfg, self.path)
        target = should_move(mcfg, self.claims, self.peer_id, current)
        return current if target is None else target

    def rotation(self, round_index: int, took_part: frozenset[str] | None = None) -> Rotation | None:
        """The swarm's rotation at the end of `round_index`, planned on the claims as of the round
        before (`round_view`: the last heartbeat's view, read again only when a claim lags) with ours as
        it is now; `took_part`: the agreed senders of our latest trunk round (`live_claims`). Nothing is
        read unless that view says a rotation is possible at all (a rotation round, a path nobody holds)."""
        every, cfg = self.config.rotate_every_rounds, self.manifest.model
        me, standing = self.peer_id, self.standing
        took_part = None if took_part is None else took_part | {me}
        if not every or round_index % every or cfg.n_paths < 2 or not self._uncovered(took_part):
            return None
        own, wait, h = self.claim_record(), self.config.heartbeat_seconds, self.manifest.sync.inner_steps
        claims, steering = round_view(lambda: dict(self.read_claims()) | {me: own},
                                      lambda c: steering_claims(c, standing, me), round_index, wait,
                                      self._stop, in_hand=dict(self.claims) | {me: own})  # fmt: skip
        return plan_rotation(cfg, claims, round_index, every, h, h, set(steering), took_part)

    def _uncovered(self, took_part: frozenset[str] | None = None) -> bool:
        """Whether the claim view in hand has a path that no live peer holds (`live_claims`)."""
        counted = set(steering_claims(self.claims, self.standing, self.peer_id))
        paths = {c.path for c in live_claims(self.claims, counted, took_part).values()}
        return len(paths | {path_index(self.manifest.model, self.path)}) < self.manifest.model.n_paths

    def move_to(self, path: Path) -> None:
        """Claims `path` instead of ours, not ready (holders do not wait for us) until `start_path`. Not
        stored here: the move's downloads take a tenth of a second, `start_path` stores the claim before
        anyone needs it, and the store was 0.04–0.23 s of a move on the training thread (session 51);
        the holders of the modules we leave were told by our BYE, a heartbeat in between stores it."""
        self.path = path
        self.ready = False

    def start_path(self) -> None:
        """Ready to average on the path we moved to: in the DHT before we say HELLO to its holders."""
        self.ready = True
        self.publish_claim()

    def wait_for_peers(self, n: int, ready_only: bool) -> None:
        """Waits until `n` peers (us included) have claimed a path, or are ready to average."""
        what = "ready" if ready_only else "claimed a path"
        deadline = time.monotonic() + self.config.wait_for_peers_timeout_seconds
        while not self._stop.is_set():
            claims = self.read_claims()
            count = sum(c.ready or not ready_only for c in claims.values())
            if count >= n:
                # The fresh view also serves the first syncs: with an older one a peer would sync
                # "alone" and its global copy drift from the others.
                logger.info(f"{count} peers have {what}")
                return
            if time.monotonic() > deadline:
                logger.warning(
                    f"only {count} of {n} peers have {what} after "
                    f"{self.config.wait_for_peers_timeout_seconds:.0f}s: going on"
                )
                return
            time.sleep(0.5)

    # --- heartbeat ------------------------------------------------------------------------------

    def start(self, metrics: PeerMetrics) -> None:
        """Announces that we are ready to average and starts the heartbeat."""
        self.ready = True
        self.publish_claim()
        # A holder that (re)started with us (a module's holders killed at once) claimed after our first
        # read: with none in view, each took its first round alone and their copies split (goodput churn)
        held, ours = self.holders(), path_module_ids(self.manifest.model, self.path)
        if any(set(held.get(m, [])) <= {self.peer_id} for m in ours):
            self.read_claims()
        if self.manifest.sync.max_group_size or self.manifest.scheduler.replan_online:
            self.snapshot = self.build_snapshot()
        self._heartbeat = threading.Thread(target=self._beat, args=(metrics,), name="heartbeat", daemon=True)
        self._heartbeat.start()

    def _on_probation(self) -> bool:
        creator = self.standing.check.creator_peer_id if self.standing.check is not None else None
        return not self.standing.own_token and self.peer_id != creator and self.ready

    def _seek_admission(self) -> None:
        """Asks the run's authority to admit us after our probation; on a yes, our claim says so."""
        with self._lock:
            token = seek_admission(self.dht, self.manifest, self.record, self.peer_id)
        if token:
            self.standing.own_token = token
            save_token(self.config.checkpoint_dir, token)
            logger.info("admitted to the run after probation: our reports and confirmations count now")
            self.publish_claim()

    def _beat(self, metrics: PeerMetrics) -> None:
        last_manifest = last_probe = last_seek = time.monotonic()
        cycle = 0
        next_beat = time.monotonic() + self.config.heartbeat_seconds
        while True:
            woken = self._wake.wait(max(0.0, self._rotation_read.until(next_beat) - time.monotonic()))
            if self._stop.is_set():
                break
            self._wake.clear()
            if time.monotonic() < next_beat:  # between beats: an announcement (the claim), a read due
                try:
                    if woken:
                        self.publish_claim()
                    if self._rotation_read.take():
                        self.read_claims()
                except Exception as e:
                    logger.warning(f"publishing our claim or reading the others' failed: {e}")
                continue
            next_beat = time.monotonic() + self.config.heartbeat_seconds
            try:
                self.publish_claim()
                self._rotation_read.take()  # the beat's read below serves it
                self.read_claims()
                metrics.set_peers_seen(len(self.claims))
                if time.monotonic() - last_probe > self.manifest.scheduler.probe_every_seconds:
                    cycle += 1
                    self.probe(cycle)
                    last_probe = time.monotonic()
                if self.manifest.sync.max_group_size or self.manifest.scheduler.replan_online:
                    self.snapshot = self.build_snapshot()
                if self.artifacts is not None:  # it re-publishes once a minute at most
                    with self._lock:
                        served = (self.config.run_name, self.record.run_id, self.standing.own_token)
                        self.artifacts.publish(self.dht, self.key, *served)
                if self.contribution is not None:  # it re-publishes every few seconds at most
                    with self._lock:
                        self.contribution.publish(self.dht, self.key, admission=self.standing.own_token)
                if time.monotonic() - last_manifest > MANIFEST_REPUBLISH_SECONDS:
                    with self._lock:
                        publish_record(self.dht, self.key, self.record)
                    last_manifest = time.monotonic()
                seek_every = max(ADMISSION_SEEK_HEARTBEATS * self.config.heartbeat_seconds, 2.0)
                if self._on_probation() and time.monotonic() - last_seek > seek_every:
                    self._seek_admission()
                    last_seek = time.monotonic()
            except Exception as e:  # a heartbeat must never kill the peer
                logger.warning(f"heartbeat failed: {e}")

    def request_stop(self) -> None:
        """Stops waits for other peers at once (SIGTERM during start-up)."""
        self._stop.set()
        self._wake.set()

    def _stop_heartbeat(self) -> None:
        self.request_stop()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=10)

    def leave(self) -> None:
        """Stops the heartbeat and announces that we are leaving, so holders stop waiting for us."""
        self._stop_heartbeat()
        if self.path is not None:
            try:
                self.publish_claim(leaving=True)
                if self.contribution is not None:  # the totals at the end, with the last round in
                    token = self.standing.own_token
                    self.contribution.publish(self.dht, self.key, force=True, admission=token)
            except Exception as e:
                logger.debug(f"could not announce leaving: {e}")

    def shutdown(self) -> None:
        self._stop_heartbeat()  # before the DHT it publishes to goes (a leave may not have come first)
        if self._probe_service is not None:
            self._probe_service.shutdown()
