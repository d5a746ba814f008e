"""Each volunteer's contribution over the run, from the signed records peers publish.

A peer's record (`ContributionRecord`) is its own claim about itself: tokens trained, inner steps,
rounds averaged with others, modules held, time online, summed over its resumes. The board shows a
record only once it verified the peer's signature over it (`check_contribution`: the key whose peer
id is the record's, this run); a forged or tampered record is counted as rejected and never shown.
It keeps each peer's latest verified record after the peer left (its signature still holds), up to
`MAX_REMEMBERED_PEERS`, so the leaderboard covers the run, not only who is online now.

One number is cross-checked: a round averaged with others has witnesses, the partners. Each record
lists how many rounds its peer averaged with each of its most frequent partners; a peer's confirmed
rounds are the most that any one partner reports for it (a lower bound: rounds with different
partners are not added up, since one round can have several) and never more than its own count.
Partners count as witnesses by the project's rule for votes (as `Standing.voters` in peer/sync/):
the admitted ones, or all of them where none is admitted (an open run without an authority, where
keys that collude can vouch for each other: docs/threat-model.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dht.schema import ClaimRecord, ContributionRecord
from peer.run.admission import AdmissionCheck
from peer.run.contribution import check_contribution

#: peers whose latest record the board keeps, departed ones included (the most recently signed stay)
MAX_REMEMBERED_PEERS = 4096


@dataclass
class ContributionRow:
    """One volunteer's contribution over the run, as the page, the JSON and the metrics show it."""

    peer_id: str
    rank: int
    tokens: int
    inner_steps: int
    #: what the peer claims (signed); `rounds_confirmed` is what its partners confirm of it
    rounds_averaged: int
    rounds_confirmed: int
    modules_held: int
    online_seconds: int
    #: the peer has a live claim now (otherwise this is its last record before it left)
    online: bool
    #: unix seconds when the peer signed the record shown
    signed_at: int


class ContributionBoard:
    """Verified contribution records of one run, by peer, with their partners' confirmations."""

    def __init__(self, run_id: str, admission: AdmissionCheck | None, max_peers: int = MAX_REMEMBERED_PEERS):
        """`admission`: the run's check of admission tokens (None: nobody is admitted)."""
        self.run_id = run_id
        self.admission = admission
        self.max_peers = max_peers
        self.records: dict[str, ContributionRecord] = {}
        #: the admission token last seen in each peer's claim (whether its confirmations count)
        self.tokens: dict[str, str] = {}
        #: records refused in the last update, by reason
        self.rejected: Counter[str] = Counter()

    def update(
        self, records: list[ContributionRecord], claims: dict[str, ClaimRecord]
    ) -> list[ContributionRow]:
        """Takes in one poll's records and live claims; returns the leaderboard."""
        for peer_id, claim in claims.items():
            self.tokens[peer_id] = claim.admission
        self.rejected = Counter()
        for record in records:
            why = check_contribution(record, self.run_id)
            if why is not None:
                self.rejected[why] += 1
                continue
            previous = self.records.get(record.peer_id)
            if previous is None or record.signed_at >= previous.signed_at:
                self.records[record.peer_id] = record
        if len(self.records) > self.max_peers:
            newest = sorted(self.records.values(), key=lambda r: (-r.signed_at, r.peer_id))[: self.max_peers]
            self.records = {r.peer_id: r for r in newest}
        self.tokens = {p: t for p, t in self.tokens.items() if p in self.records or p in claims}
        return self.rows({p for p, c in claims.items() if not c.leaving})

    def witnesses(self) -> dict[str, dict[str, int]]:
        """peer -> partner -> rounds the partner says it averaged with that peer (at most
        MAX_CONTRIBUTION_PARTNERS per record: linear in the peers kept)."""
        out: dict[str, dict[str, int]] = {}
        for witness, record in self.records.items():
            for peer, rounds in record.averaged_with.items():
                if peer != witness:
                    out.setdefault(peer, {})[witness] = rounds
        return out

    def confirmed(self, peer_id: str, witnesses: dict[str, int]) -> int:
        """Rounds of `peer_id` averaged with others that a partner with standing confirms."""
        check = self.admission
        admitted = [w for w in witnesses if check is not None and check.admitted(w, self.tokens.get(w, ""))]
        counted = admitted or list(witnesses)
        own = self.records[peer_id].rounds_averaged
        return min(own, max((witnesses[w] for w in counted), default=0))

    def rows(self, live: set[str]) -> list[ContributionRow]:
        ranked = sorted(self.records.values(), key=lambda r: (-r.tokens, r.peer_id))
        witnesses = self.witnesses()
        return [
            ContributionRow(
                r.peer_id,
                i + 1,
                r.tokens,
                r.inner_steps,
                r.rounds_averaged,
                self.confirmed(r.peer_id, witnesses.get(r.peer_id, {})),
                r.modules_held,
                r.online_seconds,
                r.peer_id in live,
                r.signed_at,
            )  # fmt: skip
            for i, r in enumerate(ranked)
        ]
