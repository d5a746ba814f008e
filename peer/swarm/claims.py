"""Path claims: who trains which path, renewed by heartbeat, and the choice of a path to claim.

A claim is a `ClaimRecord` under the claim shard of its path (`dht.keys.claims_key`) and the
claimant's owner subkey (so nobody can overwrite another peer's claim), with a TTL of
`CLAIM_TTL_SECONDS`: a peer that stops heartbeating simply disappears from the swarm's view.

A reader reads the shards of the paths it cares about (`shards_through`: every shard for a holder of
the trunk, which every path shares), each in its own bounded lookup, and keeps at most
`MAX_CLAIMS_PER_SHARD` claims of a shard: admitted peers' first (a creator's signature costs what a
key does not), then a sample by a hash of (reader, claimant), so that readers keep different samples
and no key is chosen first by all of them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import hivemind
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from dht.claim_choice import keep_of_shard
from dht.keys import CLAIM_TTL_SECONDS, MAX_CLAIMS_PER_SHARD, claim_shard, claim_shards, claims_key
from dht.records import read_keys, store_record
from dht.schema import ClaimRecord, ManifestRecord
from dht.shard_store import Admitted
from peer.config import RunManifest
from peer.model.grid import TRUNK, ModelConfig, is_path_of, path_from_index, path_module_ids
from peer.run.admission import AdmissionCheck
from peer.seeding import stable_seed
from peer.sync.standing import Standing

logger = logging.getLogger(__name__)


def publish_claim(
    dht: hivemind.DHT,
    key: RSAPrivateKey,
    run_name: str,
    run_id: str,
    claim: ClaimRecord,
    ttl: float = CLAIM_TTL_SECONDS,
) -> bool:
    return store_record(dht, claims_key(run_name, run_id, claim_shard(claim.path)), key, claim, ttl)


def shards_through(cfg: ModelConfig, modules: Iterable[str]) -> list[int]:
    """The claim shards of every path through any of `modules` (all of them for the trunk)."""
    wanted = set(modules)
    return sorted(
        {
            claim_shard(p)
            for p in range(cfg.n_paths)
            if wanted.intersection(path_module_ids(cfg, path_from_index(cfg, p)))
        }
    )


def read_shards(
    dht: hivemind.DHT,
    run_name: str,
    run_id: str,
    shards: Iterable[int],
    admitted: Admitted | None = None,
    only_admitted: bool = False,
) -> dict[str, tuple[ClaimRecord, float]]:
    """Unexpired claims (leaving ones included) in `shards`, with their expiry, by peer id. One owner
    key must not speak for several peer ids, and a peer that moved has a claim in its old shard
    until that expires: the most advanced record per peer id wins, the later one on a tie.
    `only_admitted`: claims whose admission `admitted` refuses are left out (an invite run)."""
    keys = [claims_key(run_name, run_id, s) for s in shards]
    out: dict[str, tuple[ClaimRecord, float]] = {}
    reader = str(dht.peer_id)
    for key, records in read_keys(dht, keys, ClaimRecord).items():
        if only_admitted:
            records = [r for r in records if admitted is not None and admitted(r[0].peer_id, r[0].admission)]
        if len(records) > MAX_CLAIMS_PER_SHARD:
            logger.info(f"{len(records)} claims under {key}; keeping {MAX_CLAIMS_PER_SHARD}")
        for claim, expiry in keep_of_shard(records, reader, admitted):
            previous = out.get(claim.peer_id)
            if previous is None or (claim.step, expiry) >= (previous[0].step, previous[1]):
                out[claim.peer_id] = (claim, expiry)
    return out


def steering_claims(
    claims: dict[str, ClaimRecord], standing: Standing, me: str | None = None
) -> dict[str, ClaimRecord]:
    """The claims whose step counts steer rotation (peer/swarm/rotation.py): admitted peers' where
    any claimant is admitted, else all (`Standing.voters`: every peer reaches the same set from the
    same view, so they agree on who moves), so that free keys cannot stop a rotation with made-up
    counts. `me`: our own claim counts with our token as it is now (`standing.own_token`), not as
    last read."""
    tokens = {pid: c.admission for pid, c in claims.items()}
    if me in tokens:
        tokens[me] = standing.own_token
    return {pid: claims[pid] for pid in standing.voters(tokens)}


def live_claims(
    dht: hivemind.DHT, run_name: str, run_id: str, n_paths: int, admitted: Admitted | None = None
) -> dict[str, ClaimRecord]:
    """Claims of peers that are present (unexpired, not leaving) in every shard of a run of
    `n_paths` paths, by peer id."""
    found = read_shards(dht, run_name, run_id, claim_shards(n_paths), admitted)
    return {pid: c for pid, (c, _) in found.items() if not c.leaving}


class ClaimView:
    """Claims as this peer last saw them, from `shards`. A record missing from one DHT read (a
    lookup that came back short) stays until its own expiry, so the view — and the groups planned
    from it — does not flicker; a peer that announced it is leaving goes at once. `only_admitted`
    keeps only claims that `admitted` accepts."""

    def __init__(
        self,
        run_name: str,
        run_id: str,
        shards: Iterable[int],
        admitted: Admitted | None = None,
        only_admitted: bool = False,
        model: ModelConfig | None = None,
    ):
        """`model`: the run's grid; a claim whose modules are not its path's is left out (None: kept)."""
        self.run_name, self.run_id = run_name, run_id
        self.model = model
        self.shards = list(shards)
        self.admitted, self.only_admitted = admitted, only_admitted
        self._entries: dict[str, tuple[ClaimRecord, float]] = {}

    @classmethod
    def of_run(cls, manifest: RunManifest, record: ManifestRecord) -> ClaimView:
        """The view of a peer, keeper or authority of the run of a verified manifest `record`: every
        path shares the trunk, so each of them reads every claim shard (`shards_through`), each one
        capped, admitted peers' claims first. In an invite run a key without admission takes part in
        nothing, so its claim is left out: a flood of such claims names no holder anyone waits for."""
        shards = shards_through(manifest.model, [TRUNK])
        invite = manifest.admission.mode == "invite"
        admitted = AdmissionCheck.of(record).admitted
        return cls(manifest.name, record.run_id, shards, admitted, invite, manifest.model)

    def update(self, dht: hivemind.DHT) -> dict[str, ClaimRecord]:
        found = read_shards(dht, self.run_name, self.run_id, self.shards, self.admitted, self.only_admitted)
        for pid, (claim, expiry) in found.items():
            # what a peer holds follows from its path, never from a list it writes
            if self.model is not None and not is_path_of(self.model, claim.path, claim.modules):
                continue
            if claim.leaving:
                self._entries.pop(pid, None)
            else:
                self._entries[pid] = (claim, expiry)
        now = get_dht_time()
        self._entries = {pid: e for pid, e in self._entries.items() if e[1] >= now}
        by_shard: dict[int, list[tuple[ClaimRecord, float]]] = {}
        for entry in self._entries.values():
            by_shard.setdefault(claim_shard(entry[0].path), []).append(entry)
        if any(len(entries) > MAX_CLAIMS_PER_SHARD for entries in by_shard.values()):
            # reads from different nodes return different samples of a flooded shard: the view
            # stays within the same cap per shard as one read
            reader = str(dht.peer_id)
            kept = [e for es in by_shard.values() for e in keep_of_shard(es, reader, self.admitted)]
            self._entries = {claim.peer_id: (claim, expiry) for claim, expiry in kept}
        return {pid: c for pid, (c, _) in self._entries.items()}


def holders_by_module(claims: dict[str, ClaimRecord], ready_only: bool = True) -> dict[str, list[str]]:
    """Peers holding each module; by default only those ready to average (see ClaimRecord.ready)."""
    holders: dict[str, list[str]] = {}
    for peer_id, claim in sorted(claims.items()):
        if ready_only and not claim.ready:
            continue
        for module in claim.modules:
            holders.setdefault(module, []).append(peer_id)
    return holders


def choose_path(cfg: ModelConfig, claims: dict[str, ClaimRecord], peer_id: str) -> int:
    """The least-covered path; ties are broken by a hash of (peer id, path), which is deterministic
    for a given peer yet spreads peers that join at the same moment over different paths."""
    coverage = Counter(c.path for pid, c in claims.items() if pid != peer_id and not c.client_mode)
    return min(range(cfg.n_paths), key=lambda p: (coverage[p], stable_seed(peer_id, p)))


def should_move(cfg: ModelConfig, claims: dict[str, ClaimRecord], peer_id: str, my_path: int) -> int | None:
    """After claims settle: if my path is doubled while another path is empty, the doubled peer with
    the highest tie-break hash moves (every peer computes the same answer, so exactly one moves)."""
    coverage = Counter(c.path for c in claims.values() if not c.client_mode)
    empty = [p for p in range(cfg.n_paths) if coverage[p] == 0]
    if not empty or coverage[my_path] < 2:
        return None
    sharers = sorted(pid for pid, c in claims.items() if c.path == my_path and not c.client_mode)
    if max(sharers, key=lambda pid: stable_seed(pid, my_path)) != peer_id:
        return None
    return min(empty, key=lambda p: stable_seed(peer_id, p))


def last_held(modules: list[str], holders: dict[str, list[str]], me: str, standing) -> list[str]:
    """Those of `modules` that no holder with standing but `me` holds (`holders`: module -> holders,
    from the claim view): we are their last holder and hand them to a keeper before we go. A claim
    of a key without standing does not count where admitted holders exist (a sybil listing every
    module must not spare the real last holder the hand-over)."""

    def others(module: str) -> list[str]:
        return [p for p in standing.trusted({*holders.get(module, []), me}) if p != me]

    return [m for m in modules if not others(m)]
