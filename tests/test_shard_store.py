"""A storage node's cap on a claim shard (dht/shard_store.py), on hivemind's own DHTLocalStorage in
this process: which records it keeps at a full key, and what a store there costs."""

from __future__ import annotations

import random

from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import MSGPackSerializer, get_dht_time

from dht.keys import claim_shard, claims_key
from dht.shard_store import SubkeyCap, cap_keys

KEY = b"a claim shard"
CAP = 16


def record(peer: str, admitted: bool) -> bytes:
    return MSGPackSerializer.dumps({"peer_id": peer, "admission": "ok" if admitted else ""})


def storage_with_cap() -> tuple[DHTLocalStorage, SubkeyCap, DHTID]:
    key = DHTID.generate(source=KEY)
    cap = SubkeyCap([key.to_bytes()], CAP, admitted=lambda peer, token: token == "ok")
    cap_keys(cap)
    return DHTLocalStorage(), cap, key


def test_a_full_key_keeps_the_admitted_records_then_the_highest_salted_hashes_whatever_the_order():
    storage, cap, key = storage_with_cap()
    rng, expiry = random.Random(0), get_dht_time() + 600
    owners = [(f"owner{i}".encode(), f"Qm{i}", i % 20 == 0) for i in range(200)]
    rng.shuffle(owners)
    for subkey, peer, admitted in owners:
        storage.store_subkey(key, subkey, record(peer, admitted), expiry)
        # an owner already stored always renews its record
        if rng.random() < 0.2:
            assert storage.store_subkey(key, subkey, record(peer, admitted), expiry + 1) in (True, False)
    kept = {s for s, _ in storage.get(key).value.items()}
    expected = sorted(owners, key=lambda o: cap.rank(key, o[0], record(o[1], o[2])), reverse=True)[:CAP]
    assert kept == {s for s, _, _ in expected}
    assert sum(a for s, _, a in owners if s in kept) == min(CAP, sum(a for _, _, a in owners))
    # three kept strangers get admitted and renew: a flood of new strangers evicts none of them
    # (the lowest ranked of them first: a heap that kept their old rank would evict them first)
    strangers = [(s, p) for s, p, a in owners if s in kept and not a]
    raised = sorted(strangers, key=lambda o: cap.rank(key, o[0], record(o[1], False)))[:3]
    for subkey, peer in raised:
        assert storage.store_subkey(key, subkey, record(peer, True), expiry + 2)
    for i in range(100):
        storage.store_subkey(key, f"late{i}".encode(), record(f"Ql{i}", False), expiry)
    kept = {s for s, _ in storage.get(key).value.items()}
    assert len(raised) == 3 and all(s in kept for s, _ in raised)


def test_a_store_at_a_full_key_looks_up_a_few_ranks_not_every_records():
    storage, cap, key = storage_with_cap()
    expiry = get_dht_time() + 600
    lookups = 0
    known_rank = cap._known_rank

    def counting(*args):
        nonlocal lookups
        lookups += 1
        return known_rank(*args)

    cap._known_rank = counting
    for i in range(CAP):
        storage.store_subkey(key, f"first{i}".encode(), record(f"Qm{i}", False), expiry)
    lookups, stores = 0, 2000
    for i in range(stores):
        storage.store_subkey(key, f"flood{i}".encode(), record(f"Qf{i}", False), expiry)
    assert len(storage.get(key).value) == CAP
    # a scan of the key on each store would look up CAP ranks per store (16 here, 512 in a run)
    assert lookups < 4 * stores, lookups


def test_a_key_stored_anew_after_it_expired_keeps_its_highest_ranked_records():
    storage, cap, key = storage_with_cap()
    expiry = get_dht_time() + 600
    for i in range(CAP):
        storage.store_subkey(key, f"old{i}".encode(), record(f"Qo{i}", False), expiry)
    del storage[key]  # as if every record under the key had expired
    fresh = [(f"new{i}".encode(), f"Qn{i}") for i in range(4 * CAP)]
    # the lowest ranked newcomer is the key's first record again, then the rest
    fresh.sort(key=lambda o: cap.rank(key, o[0], record(o[1], False)))
    for subkey, peer in fresh:
        storage.store_subkey(key, subkey, record(peer, False), expiry)
    kept = {s for s, _ in storage.get(key).value.items()}
    assert kept == {s for s, _ in fresh[-CAP:]}


def test_a_nodes_storage_and_its_cache_under_one_cap_each_keep_their_own_best():
    storage, cap, key = storage_with_cap()
    cache = DHTLocalStorage()  # hivemind keeps cached values in a second storage of the same class
    expiry = get_dht_time() + 600
    owners = [(f"owner{i}".encode(), f"Qm{i}") for i in range(4 * CAP)]
    owners.sort(key=lambda o: cap.rank(key, o[0], record(o[1], False)))  # lowest ranked first

    def put(store: DHTLocalStorage, owner: tuple[bytes, str], later: float = 0.0) -> bool:
        return store.store_subkey(key, owner[0], record(owner[1], False), expiry + later)

    half = CAP // 2
    first = owners[:half] + owners[-half:]  # the storage: the lowest ranked and the highest
    for owner in first:
        assert put(storage, owner)
    for owner in owners[CAP : 2 * CAP + 1]:  # the cache fills past its cap, ranked above the lowest
        put(cache, owner)
    assert put(storage, first[-1], later=1.0)  # the storage's best renews its record
    # a newcomer ranked above the storage's lowest takes a lowest one's place there
    newcomer = owners[half + 1]
    assert put(storage, newcomer)
    kept = {s for s, _ in storage.get(key).value.items()}
    assert newcomer[0] in kept and owners[0][0] not in kept and len(kept) == CAP


def _key_with_a_strangers_share(share: int = 4):
    """A capped key whose records without admission ("ok" is the admitted token) take `share` places
    once it holds admitted ones, an empty storage and an expiry: (key, share, cap, storage, expiry)."""
    key = DHTID.generate(source=KEY)
    cap = SubkeyCap([key.to_bytes()], CAP, admitted=lambda peer, token: token == "ok", unadmitted_cap=share)
    cap_keys(cap)
    return key, share, cap, DHTLocalStorage(), get_dht_time() + 600


def test_strangers_take_only_their_share_of_a_key_that_holds_admitted_records_and_all_of_one_without():
    key, share, cap, storage, expiry = _key_with_a_strangers_share()
    # an open run whose creator runs no authority: nobody is admitted, the whole cap is theirs
    for i in range(2 * CAP):
        storage.store_subkey(key, f"free{i}".encode(), record(f"Qf{i}", False), expiry)
    assert len(storage.get(key).value) == CAP
    # a key with admitted records: a flood keeps `share` strangers' records there, the highest ranked
    storage, flood = DHTLocalStorage(), [(f"s{i}".encode(), f"Qs{i}") for i in range(10 * CAP)]
    assert storage.store_subkey(key, b"member0", record("Qm0", True), expiry)
    for subkey, peer in flood:
        storage.store_subkey(key, subkey, record(peer, False), expiry)
    kept = {s for s, _ in storage.get(key).value.items()}
    best = sorted(flood, key=lambda o: cap.rank(key, o[0], record(o[1], False)), reverse=True)[:share]
    assert kept == {b"member0"} | {s for s, _ in best}
    # admitted peers still get in past the strangers' share, up to the cap, evicting strangers last
    for i in range(1, CAP):
        assert storage.store_subkey(key, f"member{i}".encode(), record(f"Qm{i}", True), expiry)
    kept = {s for s, _ in storage.get(key).value.items()}
    assert len(kept) == CAP and sum(s.startswith(b"member") for s in kept) == CAP
    # a whole dictionary stored at once (a reader's cache) is cut the same way
    mixed = DictionaryDHTValue()
    mixed.store(b"member0", record("Qm0", True), expiry)
    for subkey, peer in flood:
        mixed.store(subkey, record(peer, False), expiry)
    cache = DHTLocalStorage()
    assert cache.store(key, mixed, expiry)
    assert {s for s, _ in cache.get(key).value.items()} == {b"member0"} | {s for s, _ in best}


def test_strangers_that_filled_a_key_before_it_held_admitted_records_cannot_renew_past_their_share():
    key, share, cap, storage, expiry = _key_with_a_strangers_share()
    strangers = [(f"s{i}".encode(), f"Qs{i}") for i in range(CAP)]
    for subkey, peer in strangers:  # before any admitted peer claims: the whole cap is theirs
        assert storage.store_subkey(key, subkey, record(peer, False), expiry)
    assert storage.store_subkey(key, b"member0", record("Qm0", True), expiry)
    # every stranger keeps renewing its claim (a flood's keys would): the key comes down to its share
    rng = random.Random(0)
    for later in range(1, 4):
        rng.shuffle(strangers)
        for subkey, peer in strangers:
            storage.store_subkey(key, subkey, record(peer, False), expiry + later)
    kept = {s for s, _ in storage.get(key).value.items()}
    best = sorted(strangers, key=lambda o: cap.rank(key, o[0], record(o[1], False)), reverse=True)[:share]
    assert kept == {b"member0"} | {s for s, _ in best}


def test_in_an_invite_run_a_node_keeps_no_record_whose_owner_it_does_not_admit():
    key = DHTID.generate(source=KEY)
    cap_keys(SubkeyCap([key.to_bytes()], CAP, admitted=lambda peer, token: token == "ok", admitted_only=True))
    storage, expiry = DHTLocalStorage(), get_dht_time() + 600
    # not as the first record of an empty key, not into a key with room
    assert not storage.store_subkey(key, b"stranger0", record("Qs0", False), expiry)
    assert storage.get(key) is None
    assert storage.store_subkey(key, b"member0", record("Qm0", True), expiry)
    assert not storage.store_subkey(key, b"stranger1", record("Qs1", False), expiry)
    assert {s for s, _ in storage.get(key).value.items()} == {b"member0"}
    # nor inside a whole dictionary stored at once (what a reader caches on a node)
    mixed = DictionaryDHTValue()
    mixed.store(b"member1", record("Qm1", True), expiry)
    mixed.store(b"stranger2", record("Qs2", False), expiry)
    cache = DHTLocalStorage()
    assert cache.store(key, mixed, expiry)
    assert {s for s, _ in cache.get(key).value.items()} == {b"member1"}
    strangers = DictionaryDHTValue()
    strangers.store(b"stranger3", record("Qs3", False), expiry)
    assert not DHTLocalStorage().store(key, strangers, expiry)


def test_an_invite_runs_nodes_keep_only_admitted_claims_and_an_open_runs_keep_every_claim():
    import pickle

    from hivemind.utils.crypto import RSAPrivateKey

    from dht.identity import peer_id_of_key
    from dht.schema import ClaimRecord
    from peer.config import AdmissionConfig, RunManifest
    from peer.model.grid import ModelConfig, path_from_index, path_module_ids
    from peer.run.admission import run_validator
    from peer.run.record import sign_manifest

    cfg, stranger = ModelConfig(n_levels=1, modules_per_level=1), RSAPrivateKey()
    claim = ClaimRecord(
        peer_id=peer_id_of_key(stranger), path=0, modules=path_module_ids(cfg, path_from_index(cfg, 0))
    )
    for mode, kept in (("invite", False), ("open", True)):
        manifest = RunManifest(
            name=f"only{mode}", model=cfg, seq_len=32, admission=AdmissionConfig(mode=mode)
        )
        record = sign_manifest(manifest, RSAPrivateKey())
        pickle.loads(pickle.dumps(run_validator(record, manifest.name)))  # as a DHT process receives it
        key = DHTID.generate(source=claims_key(manifest.name, record.run_id, claim_shard(0)))
        value = MSGPackSerializer.dumps(claim.model_dump())
        assert DHTLocalStorage().store_subkey(key, b"stranger", value, get_dht_time() + 60) is kept, mode
