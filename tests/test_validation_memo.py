"""The DHT node's remembered validation (dht.validators.RememberedValidation): a record that passed
is not checked again, and nothing that was not checked in full gets through."""

from __future__ import annotations

import dataclasses

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from dht.identity import peer_id_of_key
from dht.keys import claims_key
from dht.schema import ClaimRecord
from dht.validators import RecordSchemaValidator, RememberedValidation

RUN, RUN_ID = "memo", "cd" * 32


class CountingSignatures(RSASignatureValidator):
    """hivemind's signature check, counting how often it runs."""

    checked = 0

    def validate(self, record: DHTRecord) -> bool:
        CountingSignatures.checked += 1
        return super().validate(record)


def signed(memo: RememberedValidation, key: RSAPrivateKey, value: dict, expiry: float) -> DHTRecord:
    owner = RSASignatureValidator(key).local_public_key
    record = DHTRecord(
        key=DHTID.generate(source=claims_key(RUN, RUN_ID, 0)).to_bytes(),
        subkey=MSGPackSerializer.dumps(owner),
        value=MSGPackSerializer.dumps(value),
        expiration_time=expiry,
    )
    return dataclasses.replace(record, value=memo.sign_value(record))


def claim(key: RSAPrivateKey, path: int = 0) -> dict:
    return ClaimRecord(peer_id=peer_id_of_key(key), path=path, modules=["l0m0", "l1m0"]).model_dump()


def test_a_record_that_passed_is_not_checked_again_but_a_changed_one_is():
    key = RSAPrivateKey()
    memo = RememberedValidation([CountingSignatures(key), RecordSchemaValidator(RUN, RUN_ID)])
    record = signed(memo, key, claim(key), get_dht_time() + 20)
    CountingSignatures.checked = 0
    assert memo.validate(record)
    assert memo.validate(record) and memo.validate(record)
    assert CountingSignatures.checked == 1  # the same bytes are remembered

    # another value under the same owner's signature, or the same value living longer: both new
    # records, checked in full, and both refused (the signature covers value and expiry)
    other_value = dataclasses.replace(
        record,
        value=record.value.replace(
            MSGPackSerializer.dumps(claim(key)), MSGPackSerializer.dumps(claim(key, 1))
        ),
    )
    assert other_value.value != record.value
    assert not memo.validate(other_value)
    assert not memo.validate(dataclasses.replace(record, expiration_time=record.expiration_time + 100))
    assert CountingSignatures.checked == 3
    # the schema sees the value with its signature stripped, as hivemind's chain would give it
    assert memo.strip_value(record) == MSGPackSerializer.dumps(claim(key))


def test_a_validator_added_later_applies_to_records_that_passed_before():
    key = RSAPrivateKey()
    memo = RememberedValidation([RSASignatureValidator(key)])  # the run's id is not known yet
    malformed = signed(
        memo, key, {"peer_id": peer_id_of_key(key), "path": "not a number"}, get_dht_time() + 20
    )
    assert memo.validate(malformed)  # only the signature is checked so far
    assert memo.merge_with(RecordSchemaValidator(RUN, RUN_ID))  # as peer.py adds the run's schema
    assert not memo.validate(malformed)
    assert memo.validate(signed(memo, key, claim(key), get_dht_time() + 20))


def test_memory_of_passed_records_is_bounded():
    key = RSAPrivateKey()
    memo = RememberedValidation([CountingSignatures(key)], max_entries=4)
    records = [signed(memo, key, claim(key, path=i % 2), get_dht_time() + 20 + i) for i in range(6)]
    CountingSignatures.checked = 0
    for r in records:
        assert memo.validate(r)
    assert memo.validate(records[-1]) and CountingSignatures.checked == 6  # the newest is remembered
    assert memo.validate(records[0]) and CountingSignatures.checked == 7  # the oldest was forgotten
