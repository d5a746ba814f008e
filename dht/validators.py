"""DHT record validators: owner signatures, record schemas and an expiry cap.

hivemind's `RSASignatureValidator` makes records under an `[owner:...]` subkey writable only by the
holder of that key. `RecordSchemaValidator` adds what it does not check: a record under one of
pathswarm's keys must sit under an owner subkey, parse as its versioned schema, and not claim to
live longer than `MAX_RECORD_TTL_SECONDS`, and a record that names a peer (`peer_id`) must be
signed by that peer's own key. Both run inside the DHT process on every store and on
every record a get returns, so forged or malformed records never reach the peer.
"""

from __future__ import annotations

import logging
import re

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
