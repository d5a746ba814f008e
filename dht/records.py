"""Storing and reading pathswarm's signed, schema-checked records under a DHT key.

Every record lives under its owner's subkey (only that owner can write it, see dht/validators.py)
and expires; readers get the unexpired ones that parse as their schema, with their expiry. The
validators already refused malformed records inside the DHT; readers parse again anyway, because
another peer is never trusted.
"""

from __future__ import annotations

import asyncio
import dataclasses
from functools import partial
from typing import TypeVar

import hivemind
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import ValidationError

from dht.identity import owner_peer_id
from dht.node import owner_subkey
from dht.schema import Record

R = TypeVar("R", bound=Record)

#: Nodes a store or a read keeps in its search beam (hivemind's default: `bucket_size`, 20). A
#: record goes to the 5 nodes nearest its key (`num_replicas`); a `latest=True` read asks every node
#: of its beam, each answering with every record under the key, each answer validated, and a store
#: visits its whole beam before it stores: in a swarm of 20 or more nodes both cost about three times
#: the RPCs and bytes they need. Stores and reads use the same beam, so they find the same nearest
#: nodes.
SEARCH_BEAM_SIZE = 8


def store_record(
    dht: hivemind.DHT, key: str, owner: RSAPrivateKey, record: Record, ttl_seconds: float
) -> bool:
    """Stores `record` under `owner`'s subkey of `key` on the nodes nearest the key; True if one took it."""
    expiration = get_dht_time() + ttl_seconds
    return bool(
        dht.run_coroutine(partial(_store_near, key, owner_subkey(owner), record.model_dump(), expiration))
    )


def _probe_id(key_id: DHTID) -> DHTID:
    """An id no record is stored under whose nearest nodes are `key_id`'s: the lowest bit flipped
    changes every node's XOR distance by one, which keeps their order (two node ids would have to
    differ in that bit alone to swap)."""
    return DHTID(int(key_id) ^ 1)


async def _store_near(key: str, subkey: bytes, value: dict, expiration: float, _dht, node: DHTNode) -> bool:
    """Runs in the DHT process. hivemind's store finds the key's nearest nodes with finds of the key
    itself, and a find answers with every record under it: each heartbeat's claim store carried its
    whole shard back from every node of the beam (and checked each record of it), as many bytes as
    the run's claim reads. The same nodes are found by a find of `_probe_id`, under which nothing is
    stored; then the signed record goes to the `num_replicas` nearest that answer (ourselves
    included), as hivemind's store does: a node that does not answer is replaced by the next."""
    key_id = DHTID.generate(source=key)
    probe = _probe_id(key_id)
    found = await node.find_nearest_nodes([probe], k_nearest=SEARCH_BEAM_SIZE, beam_size=SEARCH_BEAM_SIZE)
    candidates = list(found.get(probe, {}).items())  # nearest first
    protocol = node.protocol
    signed = DHTRecord(
        key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value), expiration
    )
    if protocol.record_validator is not None:
        signed = dataclasses.replace(signed, value=protocol.record_validator.sign_value(signed))

    async def one(node_id: DHTID, peer_id) -> bool | None:
        """Whether the node stored it; None if it did not answer."""
        if node_id == node.node_id:
            if protocol.record_validator is not None and not protocol.record_validator.validate(signed):
                return False
            return bool(protocol.storage.store(key_id, signed.value, expiration, subkey=subkey))
        stored = await protocol.call_store(peer_id, [key_id], [signed.value], [expiration], subkeys=[subkey])
        return None if stored is None else bool(stored[0])

    answered, ok = 0, False
    while candidates and answered < node.num_replicas:
        batch, candidates = (
            candidates[: node.num_replicas - answered],
            candidates[node.num_replicas - answered :],
        )
        for result in await asyncio.gather(*(one(n, p) for n, p in batch), return_exceptions=True):
            if result is not None and not isinstance(result, BaseException):
                answered += 1
                ok = ok or result
    return ok


def read_records(dht: hivemind.DHT, key: str, schema: type[R]) -> list[tuple[R, float]]:
    """Unexpired records under `key` that parse as `schema`, each with its expiration time."""
    return _parsed(dht.get(key, latest=True, beam_size=SEARCH_BEAM_SIZE), schema)


def read_keys(dht: hivemind.DHT, keys: list[str], schema: type[R]) -> dict[str, list[tuple[R, float]]]:
    """`read_records` of each of `keys`, all looked up at once. One lookup per key, never one request
    for several keys: a node answers a request in one message, and each key's records are capped to
    fit one (the claim shards, dht/shard_store.py), not several together."""

    found = dht.run_coroutine(partial(_lookup_each, keys)) if keys else []
    return {
        key: [] if isinstance(item, BaseException) else _parsed(item, schema)
        for key, item in zip(keys, found, strict=True)
    }


async def _lookup_each(keys: list[str], _dht, node) -> list:
    """Runs in the DHT process (sent there pickled: a module-level function)."""
    return await asyncio.gather(
        *(node.get(key, latest=True, beam_size=SEARCH_BEAM_SIZE) for key in keys), return_exceptions=True
    )


def _parsed(found, schema: type[R]) -> list[tuple[R, float]]:
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
