"""The sync layer of one peer: everything that keeps the modules of its path equal to their holders'.

`PathSync` owns a `ModuleSync` (global copy, outer momentum) per module of the path, the Streaming
DiLoCo outer loop over them (`StreamingOuter`), and the peer's end of the sync protocol: the
`SyncService` (P2P), the `RoundRunner`, the history of state digests other holders may ask to
confirm. It catches up from the holders that are ahead — downloading a module's state from one of
them and loading it only once a holder with standing confirms its digest — repairs a copy that a
round's voters show to differ from their majority, merges copies that have none, and keeps the sync
state a checkpoint holds (every fragment's round, since fragments of a module sync at different
steps). The training loop calls only this class (`after_step`, `drain`), which drives the outer
loop and deals with what each round's result asks for."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey

from dht.serve_limits import ServeLimits
from monitoring.metrics import PeerMetrics
from peer.codecs.formats import make_codec
from peer.config import RunManifest
from peer.model.grid import TRUNK, all_paths, path_module_ids
from peer.model.transformer import PathModel
from peer.seeding import stable_seed
from peer.sync import wire
from peer.sync.aggregate import AggregatorConfig
from peer.sync.hello import ClaimRefresh, Greeting, install_hello_handler
from peer.sync.inbox import HOSTILE_REASONS, Inbox
from peer.sync.merge import ReportedCopies, install_copy_handler, merged_copy
from peer.sync.module_sync import ModuleSync, StateRejected
from peer.sync.outer import GroupOf, StreamingOuter, heard_within
from peer.sync.pending import FragmentDone, PendingSync, SyncTotals
from peer.sync.rounds import LEFT, RoundResult, RoundRunner, RoundSettings
from peer.sync.sent_rounds import SentRounds
from peer.sync.service import SyncService
from peer.sync.settling import SETTLING_ROUNDS, merge_note, repair_note, settle, went_on_without_us
from peer.sync.standing import Standing
from peer.sync.state_fetch import fetch_module_state
from peer.sync.state_transfer import StateHistory, install_state_handlers
from peer.sync.strays import StrayWatch
from peer.sync.wire import Kind

logger = logging.getLogger(__name__)

#: module id -> (peer id, module round) of the other ready holders a joiner may download it from
Donors = dict[str, list[tuple[str, int]]]


def _trains(ms: ModuleSync, part: torch.nn.Module) -> bool:
    """Whether `ms` keeps the global copy of exactly these parameters (the path model reused them)."""
    params = list(part.parameters())
    return len(params) == len(ms.local_params) and all(
        a is b for a, b in zip(params, ms.local_params, strict=True)
    )


class PathSync:
    """A `ModuleSync` per module of one path, the outer loop over them and the protocol behind it."""

    def __init__(
        self,
        manifest: RunManifest,
        model: PathModel,
        peer_id: str,
        metrics: PeerMetrics,
        group_of: GroupOf | None = None,
        round_of: Callable[[], int] | None = None,
        kept: PathSync | None = None,
    ):
        """`kept`: the sync layer of the path this peer rotates away from; the modules both paths
        share keep their state (global copy, momentum, rounds), its totals and τ carry on."""
        self.manifest = manifest
        self.peer_id = peer_id
        self.metrics = metrics
        cfg = manifest.model
        paths_through = {
            mid: sum(mid in path_module_ids(cfg, p) for p in all_paths(cfg)) for mid in model.module_ids
        }
        old = kept.syncs if kept is not None else {}
        self.syncs = {
            mid: old[mid]
            if mid in old and _trains(old[mid], model.parts[mid])
            else ModuleSync(
                cfg, mid, model.parts[mid], manifest.outer, manifest.sync.fragments, paths_through[mid]
            )
            for mid in model.module_ids
        }
        self._group_of, self._round_of = group_of, round_of
        #: the outer loop, built by `start` with the round runner
        self.outer: StreamingOuter | None = None
        self._totals = kept.totals if kept is not None else SyncTotals()
        self._overlap = kept.outer.overlap if kept is not None and kept.outer is not None else None
        self._tokens_total = 0
        sync = manifest.sync
        # long enough for every member of a round to download the copy we reported in it
        self.copies = ReportedCopies(2 * (sync.averaging_timeout_seconds + sync.report_timeout_seconds) + 60)
        self.history = StateHistory()
        self.service: SyncService | None = None
        self._refused_seen: Counter[str] = Counter()
        self._strays = StrayWatch()
        #: module -> the members of our latest round of it (a rotation waits for a module's joiners)
        self.last_members: dict[str, frozenset[str]] = {}
        self._greeting: Greeting | None = None  # a mover's HELLOs, answered before its first sync here

    @property
    def outer_round(self) -> int:
        """The trunk is on every path, so its round is the swarm's clock."""
        return self.syncs[TRUNK].outer_round

    @property
    def totals(self) -> SyncTotals:
        return self.outer.totals if self.outer is not None else self._totals

    @property
    def in_flight(self) -> bool:
        """Whether fragment syncs are still running (a rotation waits for a round without any)."""
        return self.outer is not None and bool(self.outer.pending)

    def reset_tokens(self, tokens_total: int) -> None:
        """The next syncs' weights count tokens from `tokens_total` (after a restore or a rotation)."""
        self._tokens_total = tokens_total
        if self.outer is not None:
            self.outer.reset_tokens(tokens_total)

    def start(
        self,
        dht: hivemind.DHT,
        is_holder: Callable[[str, str], bool],
        service: SyncService | None = None,
        key: RSAPrivateKey | None = None,
        standing: Standing | None = None,
        sent: SentRounds | None = None,
        limits: ServeLimits | None = None,
        read_claims: Callable[[], object] | None = None,
    ) -> None:
        """Opens this peer's end of the protocol (call once the modules hold their starting state):
        `key` signs our reports, `standing` says whose votes count, `sent` keeps the rounds we sent
        parts for (across restarts), `limits` bounds what other peers can make us upload,
        `read_claims` renews the claim view behind `is_holder` when a mover says HELLO. After a
        rotation, `service` is the old path's: the peer keeps its P2P stream handler (the daemon does
        not reliably route a protocol re-registered by another replica) and its inbox's bans and
        pending deliveries; only the modules the inbox accepts change."""
        sync = self.manifest.sync
        codec = make_codec(sync.codec)
        sizes = {mid: [ms.fragment_size(f) for f in range(ms.n_fragments)] for mid, ms in self.syncs.items()}
        if service is None:
            inbox = Inbox(sizes, codec, is_holder, max_senders=sync.max_round_senders,
                          max_delta_norm=sync.max_delta_norm, standing=standing)  # fmt: skip
            service = SyncService(
                dht, self.manifest.run_id, inbox, sync.averaging_timeout_seconds + 30, key=key, starting=True
            )
            if read_claims is not None:
                install_hello_handler(service, ClaimRefresh(read_claims))
        else:
            service.inbox.hold(sizes)
            self._refused_seen = Counter(service.refused)
        self.service = service
        install_state_handlers(self.service, self._snapshot, self.history, limits)
        install_copy_handler(self.service, self.copies, limits)
        aggregator = AggregatorConfig(
            method=sync.aggregator, weight_cap=sync.weight_cap, norm_cap=sync.norm_cap
        )
        settings = RoundSettings(sync.averaging_timeout_seconds, sync.report_timeout_seconds, aggregator)
        runner = RoundRunner(self.service, codec, settings, sent)
        self.outer = StreamingOuter(
            self.syncs, self.manifest, self.peer_id, self.metrics, runner, self._group_of, self._round_of,
            self._totals, self.copies, overlap=self._overlap,
        )  # fmt: skip
        self.outer.reset_tokens(self._tokens_total)
        self.align()
        for ms in self.syncs.values():
            self._track(ms)

    def _track(self, ms: ModuleSync) -> None:
        """Records the module's current state (for confirmations) and moves the inbox's windows."""
        self.history.record(ms.module_id, ms.fragment_rounds, [ms.digest(f) for f in range(ms.n_fragments)])
        if self.service is not None:
            for f, r in enumerate(ms.fragment_rounds):
                self.service.loop.call_soon_threadsafe(self.service.inbox.set_current, ms.module_id, f, r)

    def _snapshot(self, module: str):
        ms = self.syncs.get(module)
        if ms is None:
            return None
        return ms.snapshot()

    # --- the outer loop ----------------------------------------------------------------------------

    def after_step(self, step: int, tokens_total: int, holders: dict[str, list[str]]) -> list[FragmentDone]:
        """One inner step done: starts the fragment syncs due now, and finishes those whose τ ran out."""
        self.copies.forget_old()
        # keeps the copy each round reports, for merges; a mover's first sync waits for its HELLOs
        self.outer.tick(tokens_total, holders, self._greeting)
        return [self._finish(p, step) for p in self.outer.due()]

    def drain(self, step: int) -> list[FragmentDone]:
        """Finishes every sync still in flight (before a checkpoint, a rotation or leaving)."""
        return [self._finish(p, step) for p in self.outer.drain()] if self.outer is not None else []

    def _finish(self, pending: PendingSync, step: int) -> FragmentDone:
        """Collects a fragment sync's results and does what each asks: a download when others are past
        the round, a merge of diverged copies before the step, the step, a repair after it."""
        fragment = pending.fragment
        for mid, r in self.outer.collect(pending).items():
            ms = self.syncs[mid]
            if pending.epochs.get(mid, ms.epoch) != ms.epoch:
                continue  # the module's state was downloaded meanwhile: it already holds this round
            if r.outcome == "behind":
                self.outer.record(r)
                if self._behind(ms, r.ahead):
                    logger.info(f"{mid}: other holders were past our round; fetched their state")
                continue
            if (unseen := went_on_without_us(ms, r)) and self.fetch_state(ms, unseen):
                self.outer.record(r)
                ms.settling -= 1  # not armed again: holders that never answer must not loop us here
                if mid == TRUNK:
                    self.align()
                logger.info(f"{mid}: its holders went on without us, just after we joined; took their state")
                continue
            if r.merge_with:
                self._merge(ms, fragment, pending.digests[mid], r.merge_with)
            self.outer.apply(pending, mid, r)
            self._applied(ms, fragment, r)
            if self._strays.strayed(mid, fragment, r.lagging):
                logger.warning(f"{mid}: our rounds ran away from {len(r.lagging)} holders'; taking theirs")
                self._behind(ms, r.lagging, confirmed_only=True)
        return FragmentDone(fragment, step, pending.results, self.outer.overlap.tau, late=pending.detached)

    def _applied(self, ms: ModuleSync, fragment: int, result: RoundResult) -> None:
        self._track(ms)
        self.last_members[ms.module_id] = frozenset(result.members)
        if self.service is not None:
            refused = self.service.refused - self._refused_seen
            self._refused_seen = Counter(self.service.refused)
            result.bad_parts = {r: n for r, n in refused.items() if r in HOSTILE_REASONS}
        level, mid = settle(ms, result), ms.module_id
        if result.dropped:
            # a member that announced it is leaving is an expected absence, not a fault; so is a
            # claimant never heard from (a sample of them is tried each round: outer.MAX_UNPROVEN_MEMBERS)
            unheard = set(self.service.inbox.unproven(result.dropped, heard_within(self.manifest.sync)))
            gone = all(why == LEFT or m in unheard for m, why in result.dropped.items())
            logger.log(
                logging.INFO if gone else level,
                f"{mid} fragment {fragment}: left out of the average: {result.dropped}",
            )
        if result.repair_from:
            logger.log(level, repair_note(ms, fragment, level))
            self.fetch_state(ms, result.repair_from)

    def _merge(self, ms: ModuleSync, fragment: int, own_digest: str, reported: dict[str, str]) -> None:
        own = self.copies.find(ms.module_id, fragment, own_digest)
        if own is None or self.service is None:
            logger.warning(f"{ms.module_id} fragment {fragment}: our reported copy is gone; not merging")
            return
        timeout = self.manifest.sync.averaging_timeout_seconds + self.manifest.sync.report_timeout_seconds
        coro = merged_copy(self.service, ms.module_id, fragment, own, own_digest, reported, timeout)
        try:
            (theta, momentum), used = self.service.call(coro, timeout + 30)
            if all(reported.get(p) == own_digest for p in used):  # only copies like ours came
                logger.warning(f"{ms.module_id} fragment {fragment}: no other copy came; keeping ours")
                return
            ms.load_fragment_copy(fragment, theta, momentum)
        except Exception as e:
            logger.error(
                f"{ms.module_id} fragment {fragment}: merging copies failed: {type(e).__name__}: {e}"
            )
            return
        self.metrics.copies_merged()
        # holders that each started alone meet in their first rounds; copies in step that split warn
        logger.log(*merge_note(ms, fragment, len(set(reported.values()) | {own_digest}), len(used)))

    def _behind(self, ms: ModuleSync, ahead: list[str], confirmed_only: bool = False) -> bool:
        fetched = self.fetch_state(ms, ahead, confirmed_only)
        if fetched:  # in step again, with the group's views of its members still to settle
            ms.settling = SETTLING_ROUNDS
        if fetched and ms.module_id == TRUNK:
            self.align()
        return fetched

    def align(self) -> None:
        """Puts the sync schedule where the trunk's fragment rounds say the swarm is."""
        if self.outer is not None:
            self.outer.align(self.syncs[TRUNK].fragment_rounds)

    # --- catching up and repairing ------------------------------------------------------------------

    def catch_up(self, donors: Donors, kept: Donors | None = None) -> int:
        """Downloads the state of every module that its live holders — or, failing them, a keeper — have
        advanced past ours. Donors are the most advanced, ordered by a hash of (us, module, donor), so
        a joiner's modules come from different peers rather than all from one. A module whose holders
        and keepers all fail to send it starts again from its initial weights: that is said loudly and
        counted, never done silently. Returns how many modules were downloaded."""
        kept = kept or {}
        downloaded = 0
        for mid, ms in self.syncs.items():
            ours = sum(ms.fragment_rounds)
            best = 0
            for kind, sources in (("holders", donors.get(mid, [])), ("keepers", kept.get(mid, []))):
                top = max((r for _, r in sources), default=0)
                if top <= ours:
                    continue
                best = max(best, top)
                # not those without a round of it: one that moved onto it with us confirmed nothing (a reset)
                ahead = [c for c in sources if c[1] > 0]
                ordered = sorted(ahead, key=lambda c, mid=mid: (-c[1], stable_seed(self.peer_id, mid, c[0])))
                if self.fetch_state(ms, [p for p, _ in ordered]):
                    ms.settling = SETTLING_ROUNDS
                    logger.info(f"{mid}: caught up to module round {ms.outer_round} from its {kind}")
                    downloaded += 1
                    break
            else:
                if best > ours and ours == 0:
                    logger.error(
                        f"{mid}: its holders or keepers are at round {best} but none sent a state that "
                        "another confirms (gone, or their copies differ): it starts again from its initial "
                        "weights here; a later round's digest check repairs it from the holders' majority "
                        "if they agree, and a keeper (pathswarm bootstrap --keep_state DIR) keeps modules "
                        "whose holders all leave"
                    )
                    self.metrics.module_reset()
        self.align()
        return downloaded

    def say_bye(
        self, modules: list[str], holders: dict[str, list[str]], timeout: float = 3.0, wait: bool = True
    ) -> None:
        """Tells the other holders of `modules` that we stop holding them now (we move to another path,
        or leave), so that their rounds do not wait for us; best effort, at most `timeout`. `wait`: for
        their answers (a peer leaving), else sent from the service's loop as we go on (a move)."""
        if self.service is None or not modules:
            return
        # heard-from holders only (`Inbox.unproven`): a flood of claims must not make a leave dial every key
        peers = {p for m in modules for p in holders.get(m, []) if p != self.peer_id}
        peers = self.service.inbox.heard(peers, heard_within(self.manifest.sync))
        if not peers:
            return
        frames = [wire.pack_header(Kind.BYE, wire.Bye(run=self.service.run, modules=modules))]
        if wait:
            self.service.request_each(peers, frames, timeout)
        else:
            self.service.submit(self.service.ask_each(peers, frames, timeout))

    def say_hello(self, holders: dict[str, list[str]], settle_until: float, stop: threading.Event) -> None:
        """Tells the other holders of our modules (we just moved here) to read our claim; our first sync
        here waits for all to see it, else until `settle_until` (their views renew) or `stop`."""
        if self.service is not None:
            peers = {p for m in self.syncs for p in holders.get(m, []) if p != self.peer_id}
            if peers := self.service.inbox.heard(peers, heard_within(self.manifest.sync)):
                self._greeting = Greeting(self.service, sorted(self.syncs), sorted(peers), settle_until, stop)

    def hand_over(self, modules: list[str], keepers: list[str]) -> list[str]:
        """Asks keepers to take our state of `modules` (we are their last holder, leaving) and waits;
        returns the modules no keeper took."""
        timeout = self.manifest.sync.averaging_timeout_seconds + 30

        async def ask(module: str, keeper: str) -> bool:
            request = wire.Keep(run=self.service.run, module=module)
            try:
                return (
                    await self.service.request(keeper, [wire.pack_header(Kind.KEEP, request)], timeout)
                ).ok
            except Exception as e:
                logger.warning(f"{module}: keeper {keeper} did not take our state: {type(e).__name__}: {e}")
                return False

        untaken = []
        for module in modules:
            taken = [k for k in keepers if self.service.call(ask(module, k), timeout + 5)]
            if taken:
                logger.info(f"{module}: we were its last holder; keeper {taken[0]} took our state")
            else:
                logger.warning(f"{module}: we were its last holder and no keeper took our state")
                untaken.append(module)
        return untaken

    def fetch_state(self, ms: ModuleSync, donors: list[str], confirmed_only: bool = False) -> bool:
        """Loads a module's state from the first donor whose state a holder with standing confirms
        (`confirmed_only`: never a sole voice's, nor an initial state: what a stray lineage yields to)."""
        numels = [t.numel() for t in ms.state_tensors()]
        started = time.monotonic()
        got = fetch_module_state(self.service, ms.module_id, numels, donors, self.manifest.sync)
        if got is None:
            logger.error(f"{ms.module_id}: no holder sent a confirmed state; going on with our own copy")
            return False
        sources, rounds, tensors, was_confirmed = got
        seconds, megabytes = time.monotonic() - started, 4 * sum(numels) / 1e6
        # the join's longest wait: how fast it went and from how many donors, for volunteers and benchmarks
        logger.info(
            f"{ms.module_id}: state of {megabytes:.1f} MB from {len(sources)} donor(s) in {seconds:.1f} s "
            f"({megabytes / max(seconds, 1e-9):.2f} MB/s)"
        )
        donor = sources[0]
        if confirmed_only and (not was_confirmed or sum(rounds) == 0):
            logger.warning(f"{ms.module_id}: {donor}'s state is unconfirmed or untrained; keeping ours")
            return False
        if not was_confirmed:
            # a swarm of two (a joiner and one holder) has nobody else to ask: not a fault, and nothing
            # the volunteer could act on; a state other holders contradict is refused (and warned of)
            logger.info(f"{ms.module_id}: {donor} is its only holder with standing; its state is unconfirmed")
        try:
            ms.load_state(dict(module=ms.module_id, fragment_rounds=rounds), tensors)
        except StateRejected as e:
            logger.warning(f"refused the state {donor} sent: {e}")
            self.metrics.bad_part("shape")
            return False
        self._track(ms)
        self.service.loop.call_soon_threadsafe(self.service.inbox.served_state, ms.module_id, sources)
        return True

    def fingerprints(self) -> dict[str, str]:
        """Each module's state digest (what the claim publishes; equal on holders in step)."""
        return {mid: ms.module_digest() for mid, ms in self.syncs.items()}

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
            self._track(ms)
        self.reset_tokens(tokens_total)
        self.align()

    def shutdown(self) -> None:
        if self.service is not None:
            self.service.shutdown()
