"""A peer's contribution over the whole run, counted as it trains and kept in its checkpoints.

Tokens and inner steps are the peer's own counters (`Peer.tokens_total`, `Peer.step`, already kept
across resumes); this ledger adds what they do not hold: the outer rounds in which the peer averaged
with at least one other holder, how many rounds it averaged with each partner (the partners' counts
confirm another peer's rounds, see monitoring/swarm/contributions.py), and its time online, summed
over every start of the peer with --resume. The totals belong to the key that earned them: a
checkpoint resumed under another identity (no --identity_path) starts this key's totals from zero, or
the leaderboard would count that work twice, under both keys. `record()` is the unsigned statement the
peer signs and publishes (peer/swarm/contribution.py); `meta()` is the same totals as its checkpoint
keeps them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dht.schema import MAX_CONTRIBUTION_PARTNERS, ContributionRecord
from peer.config import RunManifest
from peer.model.grid import ModelConfig, path_from_index, path_module_ids
from peer.swarm.contribution import ContributionPublisher
from peer.sync.pending import FragmentDone

logger = logging.getLogger(__name__)

#: partners whose counts the ledger keeps (a long run meets many; the least frequent are dropped)
MAX_KEPT_PARTNERS = 256


def modules_held(model: ModelConfig, path_steps: dict[int, int]) -> int:
    """Distinct modules over every path the peer trained (`path_steps`: path index -> steps)."""
    held: set[str] = set()
    # the training thread adds a path's entry when it rotates; readers (heartbeat, scrape) copy first
    for index, steps in list(path_steps.items()):
        if steps > 0 and 0 <= index < model.n_paths:
            held.update(path_module_ids(model, path_from_index(model, index)))
    return len(held)


def top_partners(counts: dict[str, int], limit: int) -> dict[str, int]:
    """The `limit` partners with the most rounds (ties by peer id, so the choice is stable)."""
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit])


class ContributionLedger:
    """Rounds averaged with others, per-partner counts and time online (its clock starts when the
    ledger is made), across resumes. `counters()` gives the peer's (inner steps, tokens, path index ->
    inner steps on that path) as they are now."""

    def __init__(self, counters: Callable[[], tuple[int, int, dict[int, int]]]) -> None:
        self.counters = counters
        self.model: ModelConfig | None = None  # the run's grid, once the peer joined (`publisher`)
        #: the counters (steps, tokens, path steps) a checkpoint of another key held: not ours
        self._not_ours: tuple[int, int, dict[int, int]] = (0, 0, {})
        self.rounds_averaged = 0
        self.averaged_with: dict[str, int] = {}
        self._online_before = 0.0  # seconds online in the starts this one resumed
        self._started = time.monotonic()

    @property
    def online_seconds(self) -> float:
        return self._online_before + time.monotonic() - self._started

    def end_round(self, done: FragmentDone, me: str) -> None:
        """At an outer round's end (fragment 0's sync): a round averaged with others if any module of
        it averaged with another holder; each such partner's count goes up once per round."""
        partners = {m for r in done.results.values() if r.outcome == "averaged" for m in r.members}
        partners.discard(me)
        if not partners:
            return
        self.rounds_averaged += 1
        # a new dict, swapped in whole: the heartbeat and the metrics read the old one meanwhile
        counts = dict(self.averaged_with)
        for peer in partners:
            counts[peer] = counts.get(peer, 0) + 1
        self.averaged_with = (
            top_partners(counts, MAX_KEPT_PARTNERS) if len(counts) > MAX_KEPT_PARTNERS else counts
        )

    def meta(self) -> dict:
        """The totals now, as a checkpoint keeps them (tokens and inner steps repeat the peer's
        counters, so that one dict says the whole contribution)."""
        step, tokens_total, path_steps = self.counters()
        steps_before, tokens_before, paths_before = self._not_ours
        step, tokens_total = step - steps_before, tokens_total - tokens_before
        path_steps = {p: n - paths_before.get(p, 0) for p, n in list(path_steps.items())}
        return dict(
            tokens=tokens_total,
            inner_steps=step,
            rounds_averaged=self.rounds_averaged,
            modules_held=modules_held(self.model, path_steps) if self.model is not None else 0,
            online_seconds=int(self.online_seconds),
            averaged_with=dict(self.averaged_with),
        )

    def restore(self, meta: dict, peer_id: str) -> None:
        """Takes the totals of a resumed checkpoint (one written before the ledger existed: none), if
        `peer_id` (this peer's key) wrote it."""
        kept = meta.get("contribution") or {}
        if meta.get("peer_id") != peer_id:
            logger.info(
                f"the checkpoint was written by peer {meta.get('peer_id')}, not this key: this peer's "
                "contribution counts from zero (keep --identity_path to carry it over restarts)"
            )
            paths = {int(p): int(n) for p, n in (meta.get("path_steps") or {}).items()}
            self._not_ours = (int(meta.get("step", 0)), int(meta.get("tokens_total", 0)), paths)
            kept = {}
        self.rounds_averaged = int(kept.get("rounds_averaged", 0))
        self.averaged_with = {str(p): int(n) for p, n in (kept.get("averaged_with") or {}).items()}
        self._online_before = float(kept.get("online_seconds", 0))
        self._started = time.monotonic()

    def record(self, run_id: str, peer_id: str) -> ContributionRecord:
        """The unsigned record of the totals now, its partners cut to the most frequent."""
        totals = self.meta()
        partners = top_partners(totals["averaged_with"], MAX_CONTRIBUTION_PARTNERS)
        return ContributionRecord(run_id=run_id, peer_id=peer_id, **{**totals, "averaged_with": partners})

    def publisher(self, manifest: RunManifest, run_id: str, peer_id: str) -> ContributionPublisher:
        """What the peer's heartbeat publishes this ledger with, in run `manifest`."""
        self.model = manifest.model
        return ContributionPublisher(manifest.name, run_id, lambda: self.record(run_id, peer_id))
