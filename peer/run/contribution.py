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

import functools
import time

import msgpack
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from dht.identity import peer_id_of_owner
from dht.schema import ContributionRecord


def _canonical(value):
    # sorted keys at every level: the same bytes for the same record on every peer and reader
    if isinstance(value, dict):
        return {k: _canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_canonical(x) for x in value]
    return value


def _body(record: ContributionRecord) -> bytes:
    """What the signature covers: every field but the signature (extra fields of newer peers too)."""
    return msgpack.packb(_canonical(record.model_dump(mode="json", exclude={"signature"})), use_bin_type=True)


def sign_contribution(record: ContributionRecord, key: RSAPrivateKey) -> ContributionRecord:
    """`record` with the public key of `key` and its signature (`record.peer_id` must be key's)."""
    unsigned = record.model_copy(
        update={"public_key": key.get_public_key().to_bytes().decode(), "signed_at": int(time.time())}
    )
    return unsigned.model_copy(update={"signature": key.sign(_body(unsigned)).decode()})


@functools.lru_cache(maxsize=4096)
def _key_of(public_key: str) -> tuple[str | None, RSAPublicKey | None]:
    try:
        return peer_id_of_owner(public_key.encode()), RSAPublicKey.from_bytes(public_key.encode())
    except Exception:  # not an RSA key in OpenSSH form
        return None, None


def check_contribution(record: ContributionRecord, run_id: str) -> str | None:
    """None if `record` is `record.peer_id`'s own signed record for run `run_id`, else why not."""
    if record.run_id != run_id:
        return "another run"
    owner, public = _key_of(record.public_key)
    if owner is None:
        return "no readable public key"
    if owner != record.peer_id:
        return "signed by another key"
    try:
        valid = public.verify(_body(record), record.signature.encode())
    except Exception:
        valid = False
    return None if valid else "signature does not match"
