"""Path claims: who trains which path, renewed by heartbeat, and the choice of a path to claim.

A claim is a `ClaimRecord` under the run's claims key and the claimant's owner subkey (so nobody
can overwrite another peer's claim), with a TTL of `CLAIM_TTL_SECONDS`: a peer that stops
heartbeating simply disappears from the swarm's view.
"""

from __future__ import annotations

import logging
from collections import Counter

import hivemind
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from dht.keys import CLAIM_TTL_SECONDS, MAX_CLAIMS_PER_RUN, claims_key
from dht.records import read_records, store_record
from dht.schema import ClaimRecord
from peer.model.grid import ModelConfig
from peer.seeding import stable_seed

logger = logging.getLogger(__name__)


def publish_claim(
    dht: hivemind.DHT,
    key: RSAPrivateKey,
    run_name: str,
    run_id: str,
    claim: ClaimRecord,
    ttl: float = CLAIM_TTL_SECONDS,
) -> bool:
    return store_record(dht, claims_key(run_name, run_id), key, claim, ttl)


def _read(dht: hivemind.DHT, run_name: str, run_id: str) -> dict[str, tuple[ClaimRecord, float]]:
    """Unexpired claims (leaving ones included) with their expiry, by peer id; one owner key must
    not speak for several peer ids, so the most advanced record per peer id wins."""
    out: dict[str, tuple[ClaimRecord, float]] = {}
    records = read_records(dht, claims_key(run_name, run_id), ClaimRecord)
    if len(records) > MAX_CLAIMS_PER_RUN:
        # a flood of keys can publish any number of claims: the view keeps a bounded, stable share
        logger.warning(f"{len(records)} claims in run {run_name}; keeping {MAX_CLAIMS_PER_RUN}")
        records = sorted(records, key=lambda r: r[0].peer_id)[:MAX_CLAIMS_PER_RUN]
    for claim, expiry in records:
        previous = out.get(claim.peer_id)
        if previous is None or claim.step >= previous[0].step:
            out[claim.peer_id] = (claim, expiry)
    return out


def live_claims(dht: hivemind.DHT, run_name: str, run_id: str) -> dict[str, ClaimRecord]:
    """Claims of peers that are present (unexpired, not leaving), by peer id."""
    return {pid: c for pid, (c, _) in _read(dht, run_name, run_id).items() if not c.leaving}


class ClaimView:
    """Claims as this peer last saw them. A record missing from one DHT read (a lookup that came
    back short) stays until its own expiry, so the view — and the groups planned from it — does not
    flicker; a peer that announced it is leaving goes at once."""

    def __init__(self, run_name: str, run_id: str):
        self.run_name, self.run_id = run_name, run_id
        self._entries: dict[str, tuple[ClaimRecord, float]] = {}

    def update(self, dht: hivemind.DHT) -> dict[str, ClaimRecord]:
        for pid, (claim, expiry) in _read(dht, self.run_name, self.run_id).items():
            if claim.leaving:
                self._entries.pop(pid, None)
            else:
                self._entries[pid] = (claim, expiry)
        now = get_dht_time()
        self._entries = {pid: e for pid, e in self._entries.items() if e[1] >= now}
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
