"""Keeping the last copy of every module: a run outlives the peers that trained it.

A `Keeper` (`pathswarm bootstrap --manifest_path M --keep_state DIR`) holds no path. Every
`interval` it reads the run's claims and, for each module some ready holder has advanced past the
kept copy, downloads that holder's state and keeps it only once a holder with standing other than
its sender confirms its digest (`peer.sync.state_fetch`; the state of a module's only holder with
standing is kept unconfirmed). A leaving holder's request to keep its state now (`Kind.KEEP`) is
taken only from a holder of that module with standing (`peer.sync.standing`): a stranger, or a key
without admission where the module has admitted holders, is refused. Kept states are written
atomically to DIR (so a restarted keeper resumes), announced in a signed `StashRecord`, and served
like a holder's; a keeper keeps no more than its one stash record can name (`MAX_STASH_MODULES`,
within the record's bytes) and says so when full. A joiner that finds no live holder of a module
takes it from a keeper before it would ever start the module again from its initial weights.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import hivemind
import torch
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from dht.keys import RECORD_LIMITS, STASH_TTL_SECONDS, stash_key
from dht.records import read_records, store_record
from dht.schema import MAX_STASH_MODULES, ClaimRecord, KeptModule, ManifestRecord, StashRecord
from peer.checkpoint import load_latest_checkpoint, save_checkpoint
from peer.codecs.formats import make_codec
from peer.config import RunManifest
from peer.model.grid import all_module_ids
from peer.model.transformer import build_module_shape_only
from peer.run.admission import AdmissionCheck
from peer.swarm.claims import ClaimView, holders_by_module
from peer.sync import wire
from peer.sync.fragments import FragmentPlan
from peer.sync.inbox import Inbox
from peer.sync.module_sync import module_digest
from peer.sync.service import SyncService
from peer.sync.standing import Standing
from peer.sync.state_fetch import fetch_confirmed, fetch_module_state
from peer.sync.state_transfer import StateHistory, digests_of, install_state_handlers
from peer.sync.wire import Kind

logger = logging.getLogger(__name__)

#: bytes of one stash record a node stores (dht.keys.RECORD_LIMITS), less room for the validator's
#: signature (an RSA signature of up to 4096 bits and its marker) and for rounds that gain digits
STASH_RECORD_BUDGET_BYTES = RECORD_LIMITS["stash"][1] - 8 * 1024


def state_numels(manifest: RunManifest, module_id: str) -> list[int]:
    """Sizes of a module's state tensors: θ̄ per fragment, then momentum per fragment."""
    cfg, n = manifest.model, manifest.sync.fragments
    named = list(build_module_shape_only(cfg, module_id).named_parameters())
    plan = FragmentPlan(cfg, module_id, [k for k, _ in named], [p.shape for _, p in named], n)
    sizes = [plan.size(f) for f in range(n)]
    return sizes + sizes


def kept_modules(
    dht: hivemind.DHT, run_name: str, run_id: str, tokens: dict[str, str] | None = None
) -> dict[str, list[tuple[str, int]]]:
    """module -> (keeper peer id, total fragment rounds kept) from the keepers' stash records; the
    keepers themselves under the key "" (a keeper that holds nothing yet announces itself too).
    Each keeper's admission token goes into `tokens`, if given."""
    out: dict[str, list[tuple[str, int]]] = {"": []}
    for record, _ in read_records(dht, stash_key(run_name, run_id), StashRecord):
        out[""].append((record.peer_id, 0))
        if tokens is not None:
            tokens[record.peer_id] = record.admission
        for mid, kept in record.modules.items():
            out.setdefault(mid, []).append((record.peer_id, sum(kept.fragment_rounds)))
    return out


class Keeper:
    """Downloads, stores, announces and serves the latest confirmed state of every module."""

    def __init__(
        self,
        dht: hivemind.DHT,
        key: RSAPrivateKey,
        manifest: RunManifest,
        record: ManifestRecord,
        directory: Path,
        interval_seconds: float = 30.0,
        dht_lock: threading.Lock | None = None,
        admission: str = "",
    ):
        """`dht_lock`: held around every DHT call, shared with other threads using the same node
        (hivemind's DHT handle must not be called from two threads at once); `admission`: this
        keeper's token (none needed when it runs with the creator's key)."""
        self.dht, self.key, self.manifest, self.run_name = dht, key, manifest, manifest.name
        self.run_id = manifest.run_id
        self.admission = admission
        self.directory = Path(directory)
        self.interval = interval_seconds
        self.peer_id = str(dht.peer_id)
        self.numels = {mid: state_numels(manifest, mid) for mid in all_module_ids(manifest.model)}
        self.states: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        self.history = StateHistory()
        self._claims = ClaimView.of_run(manifest, record)
        #: the claims as last read (whose tokens give standing)
        self.claims: dict[str, ClaimRecord] = {}
        self._dht_lock = dht_lock or threading.Lock()
        self._stop = threading.Event()
        self._full = False  # the warning that the stash record has no room left was given
        self._entries: dict[str, KeptModule] = {}  # what the stash record says of each kept state
        self._load()
        self.standing = Standing(
            AdmissionCheck.of(record), manifest.admission.mode, self._token_of, self.peer_id
        )
        self.standing.own_token = admission
        inbox = Inbox({}, make_codec(manifest.sync.codec), lambda p, m: False, 1, 0.0, self.standing)
        self.service = SyncService(
            dht, self.run_id, inbox, manifest.sync.averaging_timeout_seconds + 30, key=key
        )
        install_state_handlers(self.service, self.states.get, self.history)
        self.service.extra_handlers[Kind.KEEP] = self._on_keep
        self._keeping: set[str] = set()  # modules being fetched on a leaving holder's request
        self._thread = threading.Thread(target=self._loop, name="keeper", daemon=True)

    def _load(self) -> None:
        for mid in all_module_ids(self.manifest.model):
            loaded = load_latest_checkpoint(self.directory / mid)
            if loaded is None:
                continue
            tensors, meta = loaded
            if meta.get("run_id") != self.run_id:
                continue
            self._keep(
                mid, list(meta["fragment_rounds"]), [tensors[f"t{i}"] for i in range(len(tensors))], False
            )
        if self.states:
            logger.info(f"keeper: resumed {len(self.states)} kept module states from {self.directory}")

    def _token_of(self, peer: str) -> str:
        claim = self.claims.get(peer)
        return claim.admission if claim is not None else ""

    def _read_claims(self) -> dict[str, ClaimRecord]:
        with self._dht_lock:
            self.claims = self._claims.update(self.dht)
        return self.claims

    def start(self) -> None:
        self.publish()  # peers learn there is a keeper even before it keeps anything
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as e:  # the keeper must keep going whatever one pass met
                logger.warning(f"keeper pass failed: {type(e).__name__}: {e}")
            self._stop.wait(self.interval)

    def refresh(self) -> int:
        """One pass over the modules; returns how many kept states advanced."""
        claims = self._read_claims()
        holders = holders_by_module({p: c for p, c in claims.items() if not c.client_mode})
        advanced = 0
        for mid, peers in sorted(holders.items()):
            kept = sum(self.states[mid][0]) if mid in self.states else -1
            ahead = [p for p in peers if sum(claims[p].module_rounds.get(mid, [0])) > kept]
            if not ahead:
                continue
            ahead.sort(key=lambda p: -sum(claims[p].module_rounds.get(mid, [0])))
            if not self._has_room(mid, claims[ahead[0]].module_rounds.get(mid, [0])):
                continue  # no transfer for a state that could not be announced
            got = fetch_module_state(self.service, mid, self.numels[mid], ahead, self.manifest.sync)
            if got is not None and sum(got[1]) > kept and self._keep(mid, got[1], got[2], True):
                advanced += 1
        if not self.publish():  # also renews the record's TTL
            logger.warning("keeper: could not publish what it keeps")
        return advanced

    def _may_keep_from(self, sender: str, module: str) -> bool:
        """Whether `sender` is a holder of `module` with standing (admitted where the module has
        admitted holders): only such a holder's state is taken on its word that it is leaving."""
        claims = self.claims if sender in self.claims else self._read_claims()
        holders = [p for p, c in claims.items() if module in c.modules]
        return sender in holders and sender in self.standing.trusted(holders)

    async def _on_keep(self, sender: str, body: bytes, reader, writer) -> None:
        """A leaving holder's request: fetch its state now (one such fetch per module at a time)."""
        request = wire.parse(wire.Keep, body)
        ok, loop = False, asyncio.get_running_loop()
        if (
            request.run == self.service.run
            and request.module in self.numels
            and request.module not in self._keeping
            and self._has_room(request.module, [0] * self.manifest.sync.fragments)
            and await loop.run_in_executor(None, self._may_keep_from, sender, request.module)
        ):
            self._keeping.add(request.module)
            try:
                sync = self.manifest.sync
                holders = [p for p, c in self.claims.items() if request.module in c.modules]
                try:  # a transfer that fails is "not kept", said to the asker (not a dropped stream)
                    got = await fetch_confirmed(
                        self.service, request.module, self.numels[request.module], [sender],
                        sync.averaging_timeout_seconds, sync.report_timeout_seconds, holders,
                    )  # fmt: skip
                except Exception as e:
                    logger.warning(
                        f"keeper: fetching {request.module} from {sender} failed: {type(e).__name__}: {e}"
                    )
                    got = None
                kept = sum(self.states[request.module][0]) if request.module in self.states else -1
                if got is not None and sum(got[1]) >= kept:

                    def keep_and_announce() -> bool:
                        kept_now = self._keep(request.module, got[1], got[2], True)
                        self.publish()
                        return kept_now

                    ok = await loop.run_in_executor(None, keep_and_announce)
            finally:
                self._keeping.discard(request.module)
        await wire.write(writer, wire.pack_header(Kind.ACK, wire.Ack(ok=ok, reason="" if ok else "not kept")))

    def _has_room(self, mid: str, rounds: list[int]) -> bool:
        """Whether the stash record still announces every kept module with `mid` kept at `rounds`:
        a state kept but not announced is served to nobody, and a record past the caps is stored
        nowhere, which would hide every module this keeper keeps."""
        if mid in self.states:
            return True
        if len(self.states) + 1 <= MAX_STASH_MODULES:
            entry = KeptModule(fragment_rounds=rounds, digest="0" * 64)
            record = self._record({**self._announced(), mid: entry})
            if len(MSGPackSerializer.dumps(record.model_dump())) <= STASH_RECORD_BUDGET_BYTES:
                return True
        if not self._full:
            self._full = True
            logger.warning(
                f"keeper: full at {len(self.states)} modules (a stash record names at most "
                f"{MAX_STASH_MODULES} in {STASH_RECORD_BUDGET_BYTES // 1024} KiB): {mid} and any other "
                "module new to it are not kept here; run another keeper for them"
            )
        return False

    def _keep(self, mid: str, rounds: list[int], tensors: list[torch.Tensor], save: bool) -> bool:
        if not all(torch.isfinite(t).all() for t in tensors):
            logger.warning(f"keeper: refused a state of {mid} with NaN or inf")
            return False
        if not self._has_room(mid, rounds):
            return False
        self.states[mid] = (rounds, tensors)
        digests = digests_of(tensors)
        self.history.record(mid, rounds, digests)
        self._entries[mid] = KeptModule(fragment_rounds=rounds, digest=module_digest(digests))
        logger.info(f"keeper: {mid} kept at fragment rounds {rounds}")
        if save:
            meta = dict(step=sum(rounds), run_id=self.run_id, module=mid, fragment_rounds=rounds)
            save_checkpoint(self.directory / mid, {f"t{i}": t for i, t in enumerate(tensors)}, meta, keep=1)
        return True

    def _announced(self) -> dict[str, KeptModule]:
        return dict(self._entries)

    def _record(self, modules: dict[str, KeptModule]) -> StashRecord:
        return StashRecord(peer_id=self.peer_id, modules=modules, admission=self.admission)

    def stash_record(self) -> StashRecord:
        """What `publish` stores: every kept state, by its fragment rounds and digest."""
        return self._record(self._announced())

    def publish(self) -> bool:
        record = self.stash_record()
        with self._dht_lock:
            return store_record(
                self.dht, stash_key(self.run_name, self.run_id), self.key, record, STASH_TTL_SECONDS
            )

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.service.shutdown()
