"""DHT record validators: owner signatures, record schemas and an expiry cap.

hivemind's `RSASignatureValidator` makes records under an `[owner:...]` subkey writable only by the
holder of that key. `RecordSchemaValidator` adds what it does not check: a record under one of
pathswarm's keys must sit under an owner subkey, parse as its versioned schema, and not claim to
live longer than `MAX_RECORD_TTL_SECONDS`, and a record that names a peer (`peer_id`) must be
signed by that peer's own key. Both run inside the DHT process on every store and on
every record a get returns, so forged or malformed records never reach the peer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import struct
from collections import OrderedDict

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from pydantic import ValidationError

from dht.identity import owner_peer_id
from dht.keys import MAX_RECORD_TTL_SECONDS, run_keys
from dht.schema import SCHEMAS

logger = logging.getLogger(__name__)
_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)


class RecordSchemaValidator(RecordValidatorBase):
    """Refuses records under pathswarm's keys that are unowned, malformed or live too long."""

    def __init__(self, run_name: str, run_id: str | None, max_ttl_seconds: float = MAX_RECORD_TTL_SECONDS):
        self.max_ttl_seconds = max_ttl_seconds
        self._schema_by_key = {
            DHTID.generate(source=key).to_bytes(): SCHEMAS[kind]
            for kind, key in run_keys(run_name, run_id).items()
        }

    def validate(self, record: DHTRecord) -> bool:
        if record.expiration_time > get_dht_time() + self.max_ttl_seconds:
            logger.debug("refused a record that expires too far in the future")
            return False
        schema = self._schema_by_key.get(record.key)
        if schema is None:
            return True  # not one of our keys (e.g. hivemind's matchmaking records)
        if not record.subkey or not _OWNER_RE.search(record.subkey):
            logger.debug("refused a record without an owner subkey")
            return False
        try:
            value = MSGPackSerializer.loads(record.value)
            parsed = schema.model_validate(value)
        except (ValidationError, ValueError, TypeError) as e:
            logger.debug(f"refused a malformed {schema.__name__}: {e}")
            return False
        claimed = getattr(parsed, "peer_id", None)
        if claimed is not None and claimed != owner_peer_id(record.subkey):
            logger.debug(f"refused a {schema.__name__} for {claimed} signed by another key")
            return False
        return True

    @property
    def priority(self) -> int:
        # Below RSASignatureValidator (10): we see the value after its signature is checked and stripped.
        return 0

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, RecordSchemaValidator):
            return False
        self._schema_by_key.update(other._schema_by_key)
        self.max_ttl_seconds = min(self.max_ttl_seconds, other.max_ttl_seconds)
        return True


class RememberedValidation(RecordValidatorBase):
    """The validators of one DHT node, run in hivemind's order, remembering records that passed.

    A read of a key with every claim under it returns the same records from every node it asks
    (about 20 with `latest=True`), and a record does not change between its owner's heartbeats, so
    the DHT process checked each signature and schema many times over: 42% of a light node's busy
    time in a 24-node swarm (benchmarks/dht_scale.py, py-spy). A record is remembered by a digest of
    everything validation reads (key, subkey, signed value, expiry), so a changed or forged record is
    a different entry and is checked in full. Only passes are remembered: a refused record that
    becomes acceptable later (a far expiry coming within the cap) is checked again. Adding a
    validator (a run's schema once its id is known) forgets everything remembered.
    """

    def __init__(self, validators: list[RecordValidatorBase], max_entries: int = 16384):
        self._validators: list[RecordValidatorBase] = []
        self._passed: OrderedDict[bytes, None] = OrderedDict()
        self.max_entries = max_entries
        for v in validators:
            self.merge_with(v)

    @staticmethod
    def _digest(record: DHTRecord) -> bytes:
        h = hashlib.blake2b(digest_size=20)
        for part in (record.key, record.subkey or b"", record.value):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        h.update(struct.pack("<d", record.expiration_time))
        return h.digest()

    def validate(self, record: DHTRecord) -> bool:
        digest = self._digest(record)
        if digest in self._passed:
            self._passed.move_to_end(digest)
            return True
        # hivemind's order (CompositeValidator): decreasing priority, each validator seeing the value
        # stripped by the ones before it
        for i, validator in enumerate(reversed(self._validators)):
            if not validator.validate(record):
                return False
            if i < len(self._validators) - 1:
                record = dataclasses.replace(record, value=validator.strip_value(record))
        self._passed[digest] = None
        if len(self._passed) > self.max_entries:
            self._passed.popitem(last=False)
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        for validator in self._validators:
            record = dataclasses.replace(record, value=validator.sign_value(record))
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        for validator in reversed(self._validators):
            record = dataclasses.replace(record, value=validator.strip_value(record))
        return record.value

    @property
    def priority(self) -> int:
        return max((v.priority for v in self._validators), default=0)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Takes in every validator added to the node, so that all of them are remembered."""
        if isinstance(other, RememberedValidation):
            return all(self.merge_with(v) for v in other._validators)
        if not any(existing.merge_with(other) for existing in self._validators):
            self._validators.append(other)
            self._validators.sort(key=lambda v: v.priority)
        self._passed.clear()
        return True
