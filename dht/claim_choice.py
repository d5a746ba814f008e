"""Which claims of a shard a reader keeps, when a shard holds more than `MAX_CLAIMS_PER_SHARD`.

A reader merges the replies of several DHT nodes, each of which kept its own sample of a full shard
(dht/shard_store.py), so it may hold more claims of a shard than it keeps. It keeps admitted peers'
claims first (a key costs nothing, the run creator's signature on it does), then the rest by a hash of
(reader, claimant): every reader keeps a different sample, so a flood of keys cannot pick ids that
every reader keeps, and no reader's choice depends on the order replies came in.
"""

from __future__ import annotations

import hashlib

from dht.keys import MAX_CLAIMS_PER_SHARD
from dht.schema import ClaimRecord
from dht.shard_store import Admitted


def keep_of_shard(
    records: list[tuple[ClaimRecord, float]],
    reader: str,
    admitted: Admitted | None = None,
    cap: int = MAX_CLAIMS_PER_SHARD,
) -> list[tuple[ClaimRecord, float]]:
    """At most `cap` of one shard's records: admitted claimants first, then by a hash of (reader,
    claimant), which a flood of keys cannot choose for every reader at once."""
    if len(records) <= cap:
        return records

    def rank(record: tuple[ClaimRecord, float]) -> tuple[bool, bytes]:
        claim = record[0]
        sample = hashlib.blake2b(f"{reader}/{claim.peer_id}".encode(), digest_size=8).digest()
        return (admitted is not None and admitted(claim.peer_id, claim.admission), sample)

    return sorted(records, key=rank, reverse=True)[:cap]
