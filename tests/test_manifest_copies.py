"""A run name's manifest key over real DHT nodes: every peer re-publishes the manifest under its own
subkey, and anyone can publish under a run name, so storage nodes keep a few copies (their own run's
first) and refuse a copy whose creator signature or hash does not check. Uncapped, a find of the key
carried every peer's copy: a flood of free keys re-publishing it made it unreadable (hivemind's 4 MiB).
"""

from __future__ import annotations

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.claims_flood import FloodSwarm, reply_records
from dht.keys import MANIFEST_TTL_SECONDS, MAX_MANIFEST_COPIES, MAX_OTHER_RUN_MANIFESTS, manifest_key
from dht.schema import ManifestRecord
from dht.validators import RecordSchemaValidator
from peer.config import RunManifest
from peer.run.record import sign_manifest
from peer.swarm.manifest import fetch_manifest

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

RUN = "copies"


def publish(node, key: RSAPrivateKey, record: ManifestRecord) -> bool:
    return bool(
        node.store(
            manifest_key(RUN),
            subkey=RSASignatureValidator(key).local_public_key,
            value=record.model_dump(),
            expiration_time=get_dht_time() + MANIFEST_TTL_SECONDS,
        )
    )


def test_a_flood_of_free_keys_under_a_run_name_leaves_each_node_a_few_copies_its_own_runs_first():
    ours = sign_manifest(RunManifest(name=RUN, seed=0), RSAPrivateKey())
    honest = [RSAPrivateKey() for _ in range(3)]
    # free keys: some create runs of the same name (each its own valid, signed manifest), the rest
    # re-publish our run's genuine record under their own subkeys
    impostors = [RSAPrivateKey() for _ in range(3 * MAX_MANIFEST_COPIES)]
    copiers = [RSAPrivateKey() for _ in range(3 * MAX_MANIFEST_COPIES)]
    with FloodSwarm(RecordSchemaValidator(RUN, ours.run_id), honest + impostors + copiers) as swarm:
        for key in honest:
            assert publish(swarm.flooder, key, ours)
        for seed, key in enumerate(impostors, start=1):
            publish(swarm.flooder, key, sign_manifest(RunManifest(name=RUN, seed=seed), key))
        for key in copiers:
            publish(swarm.flooder, key, ours)
        replies = reply_records(swarm.reader, manifest_key(RUN))
        assert len(replies) >= 2, replies  # the storage nodes (and the flooder, a DHT node too) answered
        for size, records in replies:
            others = [r for r in records if r["run_id"] != ours.run_id]
            assert len(records) == MAX_MANIFEST_COPIES, (size, len(records))  # the flood filled it
            assert len(others) <= MAX_OTHER_RUN_MANIFESTS, [r["run_id"][:8] for r in others]
        # a joiner that pinned the run reads it, however many keys publish under its name
        assert fetch_manifest(swarm.reader, RUN, pin=ours.run_id[:16], timeout_seconds=10)[1] == ours


def test_a_manifest_copy_whose_hash_or_creator_signature_does_not_check_is_refused_by_storage_nodes():
    creator, stranger = RSAPrivateKey(), RSAPrivateKey()
    ours = sign_manifest(RunManifest(name=RUN, seed=0), creator)
    altered = ours.model_copy(update={"manifest_json": ours.manifest_json.replace('"seed":0', '"seed":7')})
    # the stranger's key in place of the creator's: a signature that does not verify with the key named
    resigned = ours.model_copy(update={"creator_public_key": stranger.get_public_key().to_bytes()})
    garbage = ours.model_copy(update={"creator_public_key": b"not a key"})
    with FloodSwarm(RecordSchemaValidator(RUN, ours.run_id), [stranger]) as swarm:
        for forged in (altered, resigned, garbage):
            assert not publish(swarm.flooder, stranger, forged)
        assert publish(swarm.flooder, stranger, ours)  # the same key with the genuine record
        replies = reply_records(swarm.reader, manifest_key(RUN))
        assert replies and all(records == [ours.model_dump()] for _, records in replies), replies
