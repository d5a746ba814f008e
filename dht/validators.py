"""DHT record validators: owner signatures, record schemas and an expiry cap.

hivemind's `RSASignatureValidator` makes records under an `[owner:...]` subkey writable only by the
holder of that key. `RecordSchemaValidator` adds what it does not check: a record under one of
pathswarm's keys must sit under an owner subkey, parse as its versioned schema, and not claim to
live longer than `MAX_RECORD_TTL_SECONDS`, and a record that names a peer (`peer_id`) must be
signed by that peer's own key. A claim has caps of its own, each checked before it is stored: at most
`MAX_CLAIM_BYTES` long, an owner key of at most `MAX_OWNER_SUBKEY_BYTES`, at most
`MAX_CLAIM_EXTRA_FIELDS` fields this release does not know, short module ids (the schema), a lifetime
of at most `MAX_CLAIM_TTL_SECONDS`, and stored under the shard of its own path; the validator also
caps how many claims a node keeps per shard, and in an invite run keeps none without admission
(dht/shard_store.py). A manifest copy is stored only if its creator's signature and hash check, and a
node keeps at most `MAX_MANIFEST_COPIES` of them per run name, its own run's first. Both run inside
the DHT process on every store and on every record a get returns, so forged or malformed records
never reach the peer.
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
from dht.keys import (
    MAX_CLAIM_BYTES,
    MAX_CLAIM_TTL_SECONDS,
    MAX_CLAIMS_PER_SHARD,
    MAX_MANIFEST_COPIES,
    MAX_OTHER_RUN_MANIFESTS,
    MAX_RECORD_TTL_SECONDS,
    MAX_UNADMITTED_CLAIMS_PER_SHARD,
    RECORD_LIMITS,
    claim_shard,
    run_keys,
)
from dht.schema import SCHEMAS, ClaimRecord, ManifestRecord, RouterRecord
from dht.shard_store import Admitted, SubkeyCap, cap_keys

logger = logging.getLogger(__name__)
_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)

#: an owner subkey holds the owner's public key: 2048-bit RSA (every peer's) takes about 390 bytes,
#: 3072-bit under 600; a larger key would pad every record it signs (and its signature) past the
#: shard's byte budget
MAX_OWNER_SUBKEY_BYTES = 640
#: fields a claim may carry that this release does not know (a newer peer's additions), counted
#: against MAX_CLAIM_BYTES like every other field
MAX_CLAIM_EXTRA_FIELDS = 4


class RecordSchemaValidator(RecordValidatorBase):
    """Refuses records under pathswarm's keys that are unowned, malformed, oversize or live too long.

    `admitted(peer_id, token)` (the run's `AdmissionCheck.admitted`, where the manifest is known)
    ranks claims from admitted peers first when a node must choose which claims of a shard it keeps
    (at most `max_claims_per_shard`: tests flood a smaller shard, as they do the other per-peer keys
    with `record_limits`; `max_claim_ttl_seconds`: the claims_scale benchmark publishes 100,000
    claims once, which two cores cannot renew every minute).
    `admitted_only` (an invite run): a node stores no claim whose admission `admitted` refuses.
    `creator_public_key` (the run's creator, where the manifest is known): a node stores no router
    version that key did not sign, so a flood cannot take the places of the genuine copies."""

    def __init__(
        self,
        run_name: str,
        run_id: str | None,
        max_ttl_seconds: float = MAX_RECORD_TTL_SECONDS,
        admitted: Admitted | None = None,
        max_claims_per_shard: int = MAX_CLAIMS_PER_SHARD,
        max_claim_ttl_seconds: float = MAX_CLAIM_TTL_SECONDS,
        admitted_only: bool = False,
        record_limits: dict[str, tuple[int, int]] = RECORD_LIMITS,
        creator_public_key: bytes | None = None,
    ):
        self.max_ttl_seconds = max_ttl_seconds
        self.max_claim_ttl_seconds = max_claim_ttl_seconds
        self.admitted = admitted
        self.admitted_only = admitted_only
        self.max_claims_per_shard = max_claims_per_shard
        self.run_id = run_id
        self.creator_public_key = creator_public_key
        self._schema_by_key = {}
        self._shard_by_key: dict[bytes, int] = {}
        #: the run's other per-peer keys: (records a node keeps, bytes of one record)
        self._limits_by_key: dict[bytes, tuple[int, int]] = {}
        self._manifest_key = DHTID.generate(source=run_keys(run_name, None)["manifest"]).to_bytes()
        for kind, key in run_keys(run_name, run_id).items():
            key_id = DHTID.generate(source=key).to_bytes()
            if kind.startswith("claim"):
                self._schema_by_key[key_id] = ClaimRecord
                self._shard_by_key[key_id] = int(kind[len("claim") :])
            else:
                self._schema_by_key[key_id] = SCHEMAS[kind]
            if kind in record_limits:
                self._limits_by_key[key_id] = record_limits[kind]
        self._cap_keys()

    def _cap_keys(self) -> None:
        """Registers this process's storage caps: the run's claim shards, its manifest key (copies of
        this run's manifest first, where the run is known) and its other per-peer keys."""
        run_id = self.run_id
        cap_keys(
            SubkeyCap(
                [self._manifest_key],
                MAX_MANIFEST_COPIES,
                first=None if run_id is None else (lambda record: record.get("run_id") == run_id),
                unadmitted_cap=MAX_OTHER_RUN_MANIFESTS if run_id is not None else None,
            )
        )
        for key_id, (records, _) in self._limits_by_key.items():
            cap_keys(SubkeyCap([key_id], records, self.admitted, unadmitted_cap=max(1, records // 4)))
        if self._shard_by_key:
            cap = SubkeyCap(
                list(self._shard_by_key),
                self.max_claims_per_shard,
                self.admitted,
                self.admitted_only,
                unadmitted_cap=MAX_UNADMITTED_CLAIMS_PER_SHARD,
            )
            cap_keys(cap)

    def __setstate__(self, state: dict) -> None:
        # sent to the DHT process by `add_validators`: its storage caps the run's keys there
        self.__dict__.update(state)
        self._cap_keys()

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
        shard = self._shard_by_key.get(record.key)
        if shard is not None and not self._claim_fits(record):
            return False
        limits = self._limits_by_key.get(record.key)
        if limits is not None and not self._fits(record, limits[1], schema.__name__):
            return False
        try:
            value = MSGPackSerializer.loads(record.value)
            parsed = schema.model_validate(value)
        except (ValidationError, ValueError, TypeError) as e:
            logger.debug(f"refused a malformed {schema.__name__}: {e}")
            return False
        if isinstance(parsed, ManifestRecord) and (unsigned := parsed.unsigned_because()) is not None:
            logger.debug(f"refused a manifest copy: {unsigned}")  # anyone can publish under a run name
            return False
        if isinstance(parsed, RouterRecord) and self.creator_public_key is not None:
            if parsed.run_id != self.run_id or not parsed.signed_by(self.creator_public_key):
                logger.debug("refused a router version the run's creator did not sign")
                return False
        claimed = getattr(parsed, "peer_id", None)
        if claimed is not None and claimed != owner_peer_id(record.subkey):
            logger.debug(f"refused a {schema.__name__} for {claimed} signed by another key")
            return False
        if shard is not None and not self._claim_in_shard(parsed, shard):
            return False
        return True

    @staticmethod
    def _fits(record: DHTRecord, max_bytes: int, kind: str) -> bool:
        """A record's length and its owner key's, which need no parsing."""
        if len(record.value) > max_bytes:
            logger.debug(f"refused a {kind} of {len(record.value)} bytes (cap {max_bytes})")
            return False
        if len(record.subkey) > MAX_OWNER_SUBKEY_BYTES:
            logger.debug(f"refused a {kind} whose owner key takes {len(record.subkey)} bytes")
            return False
        return True

    def _claim_fits(self, record: DHTRecord) -> bool:
        """A claim's caps that need no parsing: its length, its owner key's, its lifetime."""
        if not self._fits(record, MAX_CLAIM_BYTES, "claim"):
            return False
        if record.expiration_time > get_dht_time() + self.max_claim_ttl_seconds:
            logger.debug(f"refused a claim that lives longer than {self.max_claim_ttl_seconds:.0f} s")
            return False
        return True

    @staticmethod
    def _claim_in_shard(claim: ClaimRecord, shard: int) -> bool:
        if len(claim.model_extra or {}) > MAX_CLAIM_EXTRA_FIELDS:
            logger.debug(f"refused a claim with {len(claim.model_extra)} unknown fields")
            return False
        if claim_shard(claim.path) != shard:
            logger.debug(f"refused a claim on path {claim.path} stored under claim shard {shard}")
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
        self._shard_by_key.update(other._shard_by_key)
        self._limits_by_key.update(other._limits_by_key)
        self.run_id = other.run_id or self.run_id
        self.creator_public_key = other.creator_public_key or self.creator_public_key
        self.admitted = other.admitted or self.admitted
        self.admitted_only = other.admitted_only or self.admitted_only
        self.max_ttl_seconds = min(self.max_ttl_seconds, other.max_ttl_seconds)
        self.max_claim_ttl_seconds = min(self.max_claim_ttl_seconds, other.max_claim_ttl_seconds)
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
