"""A run's per-peer keys besides the claims (probes, keepers' stash, artifact servers, router
versions, contributions) over real DHT nodes: a flood of free keys fills each key up to a few records
per node at most, admitted owners' records stay, and a record padded past its kind's bound is refused.
Uncapped, every record under a key came back in each find: a few padded records blinded the key.
"""

from __future__ import annotations

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.claims_flood import FloodSwarm, reply_records
from dht.identity import peer_id_of_key
from dht.keys import RECORD_LIMITS, run_keys
from dht.schema import (
    ArtifactsRecord,
    ContributionRecord,
    KeptModule,
    ProbeRecord,
    Record,
    RouterRecord,
    StashRecord,
)
from dht.validators import MAX_OWNER_SUBKEY_BYTES, RecordSchemaValidator
from peer.run.admission import AdmissionCheck, sign_admission

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

RUN, RUN_ID = "limits", "e5" * 32
#: records per node in these tests (the real bounds: RECORD_LIMITS); the byte bounds are the real ones
KEPT = 3
SIGNATURE_BYTES = 600


def largest(
    kind: str, key: RSAPrivateKey, creator: RSAPrivateKey, pad: int = 0, admission: str = "t" * 2048
) -> Record:
    """The largest record of `kind` its schema allows (`pad` bytes more in an unknown field) that `key`
    may publish: of a router version, a copy of one `creator` signed; by default with a token as long
    as a token may be (that admits nobody)."""
    peer = peer_id_of_key(key)
    extra = {"pad": "x" * pad} if pad else {}
    if kind == "probe":
        links = {f"{i:0128d}": [0.5, 1e12] for i in range(64)}
        return ProbeRecord(
            peer_id=peer, tokens_per_second=1.0, memory_bytes=1, links=links, admission=admission, **extra
        )
    if kind == "stash":
        rounds = [2**39 + r for r in range(64)]
        modules = {
            f"l{i // 100}m{i % 100}": KeptModule(fragment_rounds=rounds, digest="a" * 64) for i in range(300)
        }
        return StashRecord(peer_id=peer, modules=modules, admission=admission, **extra)
    if kind == "artifacts":
        return ArtifactsRecord(
            peer_id=peer, sha256s=[f"{i:064x}" for i in range(16)], admission=admission, **extra
        )
    if kind == "router":
        return router_copy(creator, **extra)
    partners = {f"{i:0128d}": 1 for i in range(16)}
    return ContributionRecord(
        run_id=RUN_ID,
        peer_id=peer,
        averaged_with=partners,
        public_key="k" * 1024,
        signature="s" * 1024,
        admission=admission,
        **extra,
    )


def router_copy(signer: RSAPrivateKey, **extra) -> RouterRecord:
    payload = "p" * 4096
    signature = signer.sign(RouterRecord.payload_digest(payload))
    return RouterRecord(run_id=RUN_ID, router_version=1, payload_json=payload, signature=signature, **extra)


def publish(node, kind: str, key: RSAPrivateKey, record: Record) -> bool:
    return bool(
        node.store(
            run_keys(RUN, RUN_ID)[kind],
            subkey=RSASignatureValidator(key).local_public_key,
            value=record.model_dump(),
            expiration_time=get_dht_time() + 60,
        )
    )


@pytest.mark.parametrize("kind", sorted(RECORD_LIMITS))
def test_a_flood_of_free_keys_on_a_runs_key_keeps_each_reply_a_few_records_and_the_admitted_ones(kind):
    creator = RSAPrivateKey()  # the run's creator: admitted without a token (its keeper, its servers)
    check = AdmissionCheck(RUN_ID, creator.get_public_key().to_bytes())
    invited = RSAPrivateKey()  # admitted by the creator's token in its record
    token = sign_admission(creator, RUN_ID, peer_id_of_key(invited), "invite")
    flood = [RSAPrivateKey() for _ in range(3 * KEPT)]
    limits = {k: (KEPT, max_bytes) for k, (_, max_bytes) in RECORD_LIMITS.items()}
    schema = RecordSchemaValidator(
        RUN,
        RUN_ID,
        admitted=check.admitted,
        record_limits=limits,
        creator_public_key=check.creator_public_key,
    )
    with FloodSwarm(schema, [creator, invited, *flood]) as swarm:
        max_bytes = RECORD_LIMITS[kind][1]
        over = largest(kind, flood[0], creator, pad=max_bytes)  # a padded record, refused at an empty key
        assert not publish(swarm.flooder, kind, flood[0], over)
        assert publish(swarm.flooder, kind, creator, largest(kind, creator, creator))
        assert publish(swarm.flooder, kind, invited, largest(kind, invited, creator, admission=token))
        for key in flood:  # refused once the strangers' share is full
            publish(swarm.flooder, kind, key, largest(kind, key, creator))
        replies = reply_records(swarm.reader, run_keys(RUN, RUN_ID)[kind])
        assert len(replies) >= 2, replies  # the storage nodes and the flooder (a DHT node too)
        bound = KEPT * (max_bytes + MAX_OWNER_SUBKEY_BYTES + SIGNATURE_BYTES) + 4096
        # a router record names no peer: copies of the creator's version by anyone take every place
        # (a stranger's own version is refused, see below); elsewhere the admitted record stays and
        # strangers fill their share
        expected = KEPT if kind == "router" else min(KEPT, 2 + max(1, KEPT // 4))
        for size, records in replies:
            assert len(records) == expected and size <= bound, (len(records), size)
            if kind != "router":
                kept = {r["peer_id"] for r in records}
                assert {peer_id_of_key(creator), peer_id_of_key(invited)} <= kept


def test_a_router_version_its_runs_creator_did_not_sign_is_refused_by_storage_nodes():
    creator, stranger = RSAPrivateKey(), RSAPrivateKey()
    check = AdmissionCheck(RUN_ID, creator.get_public_key().to_bytes())
    schema = RecordSchemaValidator(
        RUN, RUN_ID, admitted=check.admitted, creator_public_key=check.creator_public_key
    )
    with FloodSwarm(schema, [stranger]) as swarm:
        assert not publish(swarm.flooder, "router", stranger, router_copy(stranger))  # its own "version"
        other_run = router_copy(creator).model_copy(update={"run_id": "f6" * 32})
        assert not publish(swarm.flooder, "router", stranger, other_run)  # signed, but named another run
        assert publish(swarm.flooder, "router", stranger, router_copy(creator))  # a copy of the creator's
