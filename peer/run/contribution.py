"""A peer's contribution record: signed by the peer's own key, and checked by readers.

The record (`dht.schema.ContributionRecord`) lives under the run's contributions key and the peer's
owner subkey, so the DHT's validators already tie it to the key that stored it. It also carries a
signature of its own over every field, with the public key that verifies it: a reader (the monitor)
checks that this key is the one whose peer id is `peer_id`, that the signature covers the numbers it
shows, and that the record is for this run, and it can keep a checked record after the peer left and
the record expired. A record that fails any check is never shown as anyone's contribution. The peer
publishes it with `peer.swarm.contribution.ContributionPublisher`.
"""

from __future__ import annotations

import time

from hivemind.utils.crypto import RSAPrivateKey

from dht.identity import canonical_bytes, signer_of
from dht.schema import ContributionRecord


def _body(record: ContributionRecord) -> bytes:
    """What the signature covers: every field but the signature (extra fields of newer peers too)."""
    return canonical_bytes(record.model_dump(mode="json", exclude={"signature"}))


def sign_contribution(record: ContributionRecord, key: RSAPrivateKey) -> ContributionRecord:
    """`record` with the public key of `key` and its signature (`record.peer_id` must be key's)."""
    unsigned = record.model_copy(
        update={"public_key": key.get_public_key().to_bytes().decode(), "signed_at": int(time.time())}
    )
    return unsigned.model_copy(update={"signature": key.sign(_body(unsigned)).decode()})


def check_contribution(record: ContributionRecord, run_id: str) -> str | None:
    """None if `record` is `record.peer_id`'s own signed record for run `run_id`, else why not."""
    if record.run_id != run_id:
        return "another run"
    owner, public = signer_of(record.public_key)
    if owner is None:
        return "no readable public key"
    if owner != record.peer_id:
        return "signed by another key"
    try:
        valid = public.verify(_body(record), record.signature.encode())
    except Exception:
        valid = False
    return None if valid else "signature does not match"
