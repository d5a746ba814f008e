"""The caps a claim must meet before any DHT node stores it (dht/validators.py), each one alone:
a record within every cap passes, the same record over exactly one cap is refused."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from dht.identity import peer_id_of_key
from dht.keys import CLAIM_TTL_SECONDS, MAX_CLAIM_BYTES, MAX_CLAIM_TTL_SECONDS, claims_key
from dht.schema import ClaimRecord
from dht.validators import MAX_CLAIM_EXTRA_FIELDS, RecordSchemaValidator

RUN, RUN_ID = "capsrun", "ef" * 32
KEY = RSAPrivateKey()
VALIDATOR = RecordSchemaValidator(RUN, RUN_ID)


def record(
    value: dict, shard: int = 0, key: RSAPrivateKey = KEY, ttl: float = CLAIM_TTL_SECONDS
) -> DHTRecord:
    """A claim as the schema validator sees it: owner subkey, value with its signature stripped."""
    return DHTRecord(
        key=DHTID.generate(source=claims_key(RUN, RUN_ID, shard)).to_bytes(),
        subkey=MSGPackSerializer.dumps(RSASignatureValidator(key).local_public_key),
        value=MSGPackSerializer.dumps(value),
        expiration_time=get_dht_time() + ttl,
    )


def claim(key: RSAPrivateKey = KEY, **kw) -> dict:
    return ClaimRecord(peer_id=peer_id_of_key(key), path=0, modules=["trunk", "l0m0"], **kw).model_dump()


def test_a_claim_within_every_cap_is_stored():
    assert VALIDATOR.validate(record(claim()))


def test_a_claim_longer_than_its_byte_cap_is_refused():
    # padding in a field the schema allows (software_version is capped at 64 characters, loss is one
    # float: an unknown field is the room an attacker has)
    fits = {**claim(), "note": "x" * (MAX_CLAIM_BYTES - len(MSGPackSerializer.dumps(claim())) - 16)}
    assert VALIDATOR.validate(record(fits))
    assert not VALIDATOR.validate(record({**fits, "note": fits["note"] + "x" * 64}))


def test_a_claim_with_more_unknown_fields_than_its_cap_is_refused():
    extra = {f"f{i}": i for i in range(MAX_CLAIM_EXTRA_FIELDS)}
    assert VALIDATOR.validate(record({**claim(), **extra}))
    assert not VALIDATOR.validate(record({**claim(), **extra, "one_more": 1}))


@pytest.mark.parametrize("padded", ["l00000000m0", "l0m00000000", "p00000000", "trunk\n"])
def test_a_claim_naming_a_padded_module_id_is_refused(padded: str):
    assert VALIDATOR.validate(record({**claim(), "modules": ["trunk", "l7m63", "p4095"]}))
    assert not VALIDATOR.validate(record({**claim(), "modules": ["trunk", padded]}))
    assert not VALIDATOR.validate(record({**claim(), "digests": {padded: "0" * 64}}))


def test_a_claim_that_lives_longer_than_its_lifetime_cap_is_refused():
    assert VALIDATOR.validate(record(claim(), ttl=MAX_CLAIM_TTL_SECONDS - 1))
    # other records may live up to MAX_RECORD_TTL_SECONDS (600 s); a claim is renewed every heartbeat
    assert not VALIDATOR.validate(record(claim(), ttl=MAX_CLAIM_TTL_SECONDS + 5))


def test_a_claim_signed_by_an_oversize_owner_key_is_refused():
    big = RSAPrivateKey.__new__(RSAPrivateKey)
    big._private_key = rsa.generate_private_key(public_exponent=65537, key_size=4096)
    assert not VALIDATOR.validate(record(claim(big), key=big))


def test_a_claim_stored_under_another_paths_shard_is_refused():
    assert VALIDATOR.validate(record({**claim(), "path": 3}, shard=3))
    assert not VALIDATOR.validate(record({**claim(), "path": 3}, shard=0))
