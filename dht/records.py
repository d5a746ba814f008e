"""Storing and reading pathswarm's signed, schema-checked records under a DHT key.

Every record lives under its owner's subkey (only that owner can write it, see dht/validators.py)
and expires; readers get the unexpired ones that parse as their schema, with their expiry. The
validators already refused malformed records inside the DHT; readers parse again anyway, because
another peer is never trusted.
"""

from __future__ import annotations

from typing import TypeVar

import hivemind
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import ValidationError

from dht.identity import owner_peer_id
from dht.node import owner_subkey
from dht.schema import Record

R = TypeVar("R", bound=Record)


def store_record(
    dht: hivemind.DHT, key: str, owner: RSAPrivateKey, record: Record, ttl_seconds: float
) -> bool:
    return bool(
        dht.store(
            key,
            subkey=owner_subkey(owner),
            value=record.model_dump(),
            expiration_time=get_dht_time() + ttl_seconds,
        )
    )


def read_records(dht: hivemind.DHT, key: str, schema: type[R]) -> list[tuple[R, float]]:
    """Unexpired records under `key` that parse as `schema`, each with its expiration time."""
    found = dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    now = get_dht_time()
    out = []
    for subkey, item in found.value.items():
        if item.expiration_time < now:
            continue
        try:
            record = schema.model_validate(item.value)
        except ValidationError:
            continue
        claimed = getattr(record, "peer_id", None)
        if claimed is not None and claimed != owner_peer_id(subkey):
            continue  # the validators refuse these; a reader checks again (another peer is never trusted)
        out.append((record, item.expiration_time))
    return out
