"""A run's claims over real DHT nodes when a shard is flooded: bounded replies, admitted claims kept,
a reader of one module reading only its shards, the monitor reading every shard.

Each test floods a shard capped at a few claims (`RecordSchemaValidator(max_claims_per_shard=...)`)
from a node that signs with many keys (benchmarks/claims_flood.py): the stores, signature checks and
storage caps on the receiving nodes are hivemind's and ours, as in a run.
"""

from __future__ import annotations

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.claims_flood import FloodSwarm, reply_sizes
from benchmarks.monitor_cost import manifest as small_run
from dht.identity import peer_id_of_key
from dht.keys import CLAIM_TTL_SECONDS, MAX_CLAIM_BYTES, claim_shard, claims_key
from dht.schema import ClaimRecord
from dht.validators import MAX_OWNER_SUBKEY_BYTES, RecordSchemaValidator
from monitoring.swarm.exporter import SwarmCollector
from monitoring.swarm.poller import SwarmPoller
from peer.model.grid import ModelConfig, path_from_index, path_module_ids
from peer.run.admission import AdmissionCheck, sign_admission
from peer.swarm.claims import ClaimView, live_claims, shards_through

pytestmark = pytest.mark.swarm

CAP = 8
GRID = ModelConfig(n_levels=2, modules_per_level=2)
#: a reply's bound: CAP records of at most a claim's bytes, its owner key and a signature as long
SIGNATURE_BYTES = 600
REPLY_CAP_BYTES = CAP * (MAX_CLAIM_BYTES + MAX_OWNER_SUBKEY_BYTES + SIGNATURE_BYTES) + 4096


def claim(key: RSAPrivateKey, path: int, admission: str = "", cfg: ModelConfig = GRID) -> ClaimRecord:
    modules = path_module_ids(cfg, path_from_index(cfg, path))
    return ClaimRecord(peer_id=peer_id_of_key(key), path=path, modules=modules, admission=admission)


def publish(node, run: str, run_id: str, key: RSAPrivateKey, record: ClaimRecord) -> bool:
    return bool(
        node.store(
            claims_key(run, run_id, claim_shard(record.path)),
            subkey=RSASignatureValidator(key).local_public_key,
            value=record.model_dump(),
            expiration_time=get_dht_time() + CLAIM_TTL_SECONDS,
        )
    )


def test_a_reader_of_one_modules_claims_never_gets_a_reply_over_the_cap_even_when_its_shard_is_flooded():
    run, run_id = "shardcap", "a1" * 32
    honest = [RSAPrivateKey() for _ in range(3)]
    flood = [RSAPrivateKey() for _ in range(3 * CAP)]
    schema = RecordSchemaValidator(run, run_id, max_claims_per_shard=CAP)
    with FloodSwarm(schema, honest + flood) as swarm:
        # honest claims on paths 1 (modules l0m0, l1m1) and 2 (l0m1, l1m0); the flood on path 0 (l1m0)
        assert publish(swarm.flooder, run, run_id, honest[0], claim(honest[0], 1))
        assert publish(swarm.flooder, run, run_id, honest[1], claim(honest[1], 2))
        for key in flood:
            publish(swarm.flooder, run, run_id, key, claim(key, 0))
        shards = shards_through(GRID, ["l1m0"])
        assert shards == [0, 2]
        seen = ClaimView(run, run_id, shards).update(swarm.reader)
        # the holder of l1m0 reads the claims of paths 0 and 2 only, and at most CAP of the flooded one
        assert peer_id_of_key(honest[1]) in seen and peer_id_of_key(honest[0]) not in seen
        assert sum(c.path == 0 for c in seen.values()) <= CAP
        replies = reply_sizes(swarm.reader, claims_key(run, run_id, 0))
        assert replies and all(records <= CAP for _, records in replies), replies
        assert max(size for size, _ in replies) <= REPLY_CAP_BYTES
        assert max(records for _, records in replies) == CAP  # the flood did fill the shard


def test_a_flood_of_free_key_claims_in_one_shard_does_not_hide_the_admitted_claims():
    run, creator = "shardflood", RSAPrivateKey()
    run_id = "b2" * 32
    check = AdmissionCheck(run_id, creator.get_public_key().to_bytes())
    honest = [RSAPrivateKey() for _ in range(3)]
    flood = [RSAPrivateKey() for _ in range(4 * CAP)]
    schema = RecordSchemaValidator(run, run_id, admitted=check.admitted, max_claims_per_shard=CAP)
    with FloodSwarm(schema, honest + flood) as swarm:
        # free keys fill the shard first, the admitted peers arrive at a full shard, more keys follow
        for key in flood[: 2 * CAP]:
            publish(swarm.flooder, run, run_id, key, claim(key, 0))
        for key in honest:
            token = sign_admission(creator, run_id, peer_id_of_key(key), "invite")
            assert publish(swarm.flooder, run, run_id, key, claim(key, 0, token))
        for key in flood[2 * CAP :]:
            publish(swarm.flooder, run, run_id, key, claim(key, 0))
        seen = live_claims(swarm.reader, run, run_id, GRID.n_paths, check.admitted)
        assert {peer_id_of_key(k) for k in honest} <= set(seen)
        assert max(records for _, records in reply_sizes(swarm.reader, claims_key(run, run_id, 0))) == CAP


def test_in_an_invite_run_a_peers_claim_view_holds_no_claim_of_a_key_without_admission():
    run, creator = "shardinvite", RSAPrivateKey()
    run_id = "c3" * 32
    check = AdmissionCheck(run_id, creator.get_public_key().to_bytes())
    honest = [RSAPrivateKey() for _ in range(2)]
    flood = [RSAPrivateKey() for _ in range(CAP - 2)]
    schema = RecordSchemaValidator(run, run_id, admitted=check.admitted, max_claims_per_shard=CAP)
    with FloodSwarm(schema, honest + flood) as swarm:
        for key in flood:
            publish(swarm.flooder, run, run_id, key, claim(key, 0))
        for key in honest:
            token = sign_admission(creator, run_id, peer_id_of_key(key), "invite")
            assert publish(swarm.flooder, run, run_id, key, claim(key, 0, token))
        # these nodes do not know the run admits invited keys only (as a node without its manifest),
        # so the flood's claims are stored (the shard has room): the reader leaves them out, as a
        # peer of an invite run does (ClaimView.of_run), so no averaging group waits for them
        assert len(live_claims(swarm.reader, run, run_id, GRID.n_paths, check.admitted)) == CAP
        invite_view = ClaimView(run, run_id, range(GRID.n_paths), check.admitted, only_admitted=True)
        assert set(invite_view.update(swarm.reader)) == {peer_id_of_key(k) for k in honest}


def test_in_an_invite_run_storage_nodes_refuse_every_claim_without_its_owners_admission():
    run, creator = "shardinviteonly", RSAPrivateKey()
    run_id = "d4" * 32
    check = AdmissionCheck(run_id, creator.get_public_key().to_bytes())
    honest = [RSAPrivateKey() for _ in range(2)]
    flood = [RSAPrivateKey() for _ in range(2 * CAP)]
    schema = RecordSchemaValidator(
        run, run_id, admitted=check.admitted, max_claims_per_shard=CAP, admitted_only=True
    )
    with FloodSwarm(schema, honest + flood) as swarm:
        assert not any(publish(swarm.flooder, run, run_id, key, claim(key, 0)) for key in flood)
        tokens = [sign_admission(creator, run_id, peer_id_of_key(key), "invite") for key in honest]
        for key, token in zip(honest, tokens, strict=True):
            assert publish(swarm.flooder, run, run_id, key, claim(key, 0, token))
        # an admitted peer's token names that peer: a stranger carrying it is still a stranger
        assert not publish(swarm.flooder, run, run_id, flood[0], claim(flood[0], 0, tokens[0]))
        seen = live_claims(swarm.reader, run, run_id, GRID.n_paths, check.admitted)
        assert set(seen) == {peer_id_of_key(k) for k in honest}
        replies = reply_sizes(swarm.reader, claims_key(run, run_id, 0))
        assert replies and max(records for _, records in replies) == len(honest)


def test_the_monitor_reads_every_claim_shard_of_its_run():
    m, record = small_run()  # a 2x8 grid: 64 paths, 64 shards
    keys = [RSAPrivateKey() for _ in range(m.model.n_paths)]
    schema = RecordSchemaValidator(m.name, record.run_id, max_claims_per_shard=CAP)
    with FloodSwarm(schema, keys) as swarm:
        for path, key in enumerate(keys):
            assert publish(swarm.flooder, m.name, record.run_id, key, claim(key, path, cfg=m.model))
        collector = SwarmCollector(100)
        view = SwarmPoller(swarm.reader, m, record, collector).poll()
        assert {p.peer_id for p in view.peers} == {peer_id_of_key(k) for k in keys}
        # each shard, the stash, contributions, probes (the plan's measurements)
        assert collector.stats.dht_reads == m.model.n_paths + 3


def test_a_claim_listing_modules_off_its_path_is_left_out_of_a_peers_view():
    run, run_id = "shardmodules", "c4" * 32
    honest, liar = RSAPrivateKey(), RSAPrivateKey()
    schema = RecordSchemaValidator(run, run_id, max_claims_per_shard=CAP)
    with FloodSwarm(schema, [honest, liar]) as swarm:
        assert publish(swarm.flooder, run, run_id, honest, claim(honest, 0))
        # path 0 runs through trunk, l0m0, l1m0; the liar says it holds every module of the grid
        every = ["trunk", "l0m0", "l0m1", "l1m0", "l1m1"]
        lie = ClaimRecord(peer_id=peer_id_of_key(liar), path=0, modules=every)
        assert publish(swarm.flooder, run, run_id, liar, lie)
        assert len(live_claims(swarm.reader, run, run_id, GRID.n_paths)) == 2  # stored and readable
        view = ClaimView(run, run_id, range(GRID.n_paths), model=GRID).update(swarm.reader)
        assert set(view) == {peer_id_of_key(honest)}
