"""DHT records on real hivemind nodes: signatures, schemas, expiry, and run manifests."""

from __future__ import annotations

import tempfile
import threading
import time

import pytest
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from dht.identity import peer_id_of_key
from dht.keys import claims_key, manifest_key
from dht.node import owner_subkey
from dht.schema import ClaimRecord
from peer.config import RunManifest
from peer.errors import SwarmError
from peer.model.grid import ModelConfig
from peer.run.record import sign_manifest, verify_record
from peer.swarm.claims import choose_path, live_claims, publish_claim, should_move
from peer.swarm.manifest import creator_of, fetch_manifest, publish_record

pytestmark = pytest.mark.swarm

RUN = "testrun"
RUN_ID = "ab" * 32


def claim(peer_id: str, path: int = 0, **kw) -> ClaimRecord:
    return ClaimRecord(peer_id=peer_id, path=path, modules=["trunk", "l0m0", "l1m0"], **kw)


def test_a_peer_without_identity_path_leaves_no_private_key_file_once_its_node_runs(
    dht_factory, tmp_path, monkeypatch
):
    """The made-up key is deleted once p2pd read it, not at exit, which a killed peer never reaches;
    the node keeps its identity, and a user's own key file is never touched."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkstemp puts the made-up key
    node, key = dht_factory()
    assert str(node.peer_id) == peer_id_of_key(key)
    assert not list(tmp_path.glob("pathswarm-identity-*"))
    own = tmp_path / "own.key"
    dht_factory(identity_path=own)
    assert own.is_file()


def test_claims_round_trip_and_forgery_refused(dht_factory):
    a, key_a = dht_factory(run_name=RUN, run_id=RUN_ID)
    b, key_b = dht_factory(run_name=RUN, run_id=RUN_ID)
    reader, _ = dht_factory(run_name=RUN, run_id=RUN_ID)
    id_a = peer_id_of_key(key_a)
    assert id_a == str(a.peer_id)  # the record-signing key is the node's libp2p identity
    assert publish_claim(a, key_a, RUN, RUN_ID, claim(id_a, path=1))

    # B writes under A's owner subkey: its signature cannot verify against A's key.
    forged = claim(id_a, path=3).model_dump()
    ok = b.store(
        claims_key(RUN, RUN_ID, 3),
        subkey=owner_subkey(key_a),
        value=forged,
        expiration_time=get_dht_time() + 20,
    )
    assert not ok
    claims = live_claims(reader, RUN, RUN_ID, 4)
    assert set(claims) == {id_a} and claims[id_a].path == 1


def test_a_claim_that_speaks_for_another_peer_is_refused(dht_factory):
    """B signs, under its own key, a claim naming A as leaving: it must not make A vanish."""
    a, key_a = dht_factory(run_name=RUN, run_id=RUN_ID)
    b, key_b = dht_factory(run_name=RUN, run_id=RUN_ID)
    reader, _ = dht_factory(run_name=RUN, run_id=RUN_ID)
    id_a = peer_id_of_key(key_a)
    assert publish_claim(a, key_a, RUN, RUN_ID, claim(id_a, path=1))
    assert not publish_claim(b, key_b, RUN, RUN_ID, claim(id_a, path=2, leaving=True))
    # even a node without our validators that stored it anyway would not fool a reader
    rogue = b.store(
        claims_key(RUN, RUN_ID, 0),
        subkey=owner_subkey(key_b),
        value=claim(id_a, leaving=True).model_dump(),
        expiration_time=get_dht_time() + 20,
    )
    assert not rogue
    claims = live_claims(reader, RUN, RUN_ID, 4)
    assert set(claims) == {id_a} and not claims[id_a].leaving


def test_malformed_and_far_future_records_refused(dht_factory):
    a, key_a = dht_factory(run_name=RUN, run_id=RUN_ID)
    reader, _ = dht_factory(run_name=RUN, run_id=RUN_ID)
    key = claims_key(RUN, RUN_ID, 0)
    id_a = peer_id_of_key(key_a)
    bad = dict(version=3, peer_id=id_a, path=-5, modules=["trunk"])
    assert not a.store(key, subkey=owner_subkey(key_a), value=bad, expiration_time=get_dht_time() + 20)
    not_owned = claim(id_a).model_dump()
    assert not a.store(key, subkey=b"plain-subkey", value=not_owned, expiration_time=get_dht_time() + 20)
    far = claim(id_a).model_dump()
    assert not a.store(key, subkey=owner_subkey(key_a), value=far, expiration_time=get_dht_time() + 10_000)
    assert live_claims(reader, RUN, RUN_ID, 4) == {}


def test_expired_claims_disappear(dht_factory):
    a, key_a = dht_factory(run_name=RUN, run_id=RUN_ID)
    reader, _ = dht_factory(run_name=RUN, run_id=RUN_ID)
    id_a = peer_id_of_key(key_a)
    # a TTL long enough that a loaded machine still reads the claim before it expires
    published = get_dht_time()
    assert publish_claim(a, key_a, RUN, RUN_ID, claim(id_a), ttl=8.0)
    assert id_a in live_claims(reader, RUN, RUN_ID, 4)
    deadline = time.monotonic() + 30
    while id_a in live_claims(reader, RUN, RUN_ID, 4):
        assert time.monotonic() < deadline, "an expired claim is still read 20 s after its expiry"
        time.sleep(0.5)
    assert get_dht_time() >= published + 8.0 - 0.5  # gone because it expired, not earlier


def test_choose_path_prefers_least_covered_and_unique_mover():
    cfg = ModelConfig(n_levels=2, modules_per_level=2)
    claims = {"p1": claim("p1", 0), "p2": claim("p2", 1), "p3": claim("p3", 1)}
    assert choose_path(cfg, claims, "me") in (2, 3)
    claims = {"p1": claim("p1", 0), "p2": claim("p2", 0), "p3": claim("p3", 1)}
    movers = [pid for pid in ("p1", "p2") if should_move(cfg, claims, pid, 0) is not None]
    assert len(movers) == 1
    assert should_move(cfg, claims, movers[0], 0) in (2, 3)
    assert should_move(cfg, claims, "p3", 1) is None


def _manifest(seed: int = 0) -> RunManifest:
    return RunManifest(name=RUN, seed=seed)


def test_manifest_signature_and_tampering():
    key = RSAPrivateKey()
    record = sign_manifest(_manifest(), key)
    assert verify_record(record).run_id == record.run_id
    tampered = record.model_copy(
        update={"manifest_json": record.manifest_json.replace('"seed":0', '"seed":1')}
    )
    with pytest.raises(ValueError, match="hash"):
        verify_record(tampered)
    # Consistent hash, but signed by someone else's key than the one it names.
    other = sign_manifest(_manifest(1), RSAPrivateKey())
    forged = other.model_copy(update={"creator_public_key": record.creator_public_key})
    with pytest.raises(ValueError, match="signature"):
        verify_record(forged)


def test_fetch_manifest_pins_and_refuses_forgeries(dht_factory):
    a, key_a = dht_factory(run_name=RUN)
    b, key_b = dht_factory(run_name=RUN)
    good = sign_manifest(_manifest(0), key_a)
    assert publish_record(a, key_a, good)
    manifest, record = fetch_manifest(b, RUN, timeout_seconds=5)
    assert record.run_id == good.run_id and manifest.seed == 0

    # A forged manifest (valid record shape, wrong hash) is ignored; a second real run makes it ambiguous.
    forged = good.model_copy(update={"manifest_json": good.manifest_json.replace('"seed":0', '"seed":7')})
    b.store(
        manifest_key(RUN),
        subkey=owner_subkey(key_b),
        value=forged.model_dump(),
        expiration_time=get_dht_time() + 60,
    )
    assert fetch_manifest(b, RUN, timeout_seconds=2)[1].run_id == good.run_id
    second = sign_manifest(_manifest(5), key_b)
    assert publish_record(b, key_b, second)
    with pytest.raises(SwarmError, match="several runs"):
        fetch_manifest(a, RUN, timeout_seconds=2)
    assert fetch_manifest(a, RUN, pin=second.run_id[:10], timeout_seconds=2)[1].run_id == second.run_id
    # a pin no run matches: the runs of that name that do exist, with their hashes, in one sentence
    with pytest.raises(SwarmError, match=rf"has no run '{RUN}' with hash 0123456789 .*only with hash"):
        fetch_manifest(a, RUN, pin="0123456789", timeout_seconds=1)
    # the creator's key: a pin on it picks the run that key signed, whatever else shares the name
    by_b = fetch_manifest(a, RUN, creator=creator_of(second)[:16], timeout_seconds=2)[1]
    assert by_b.run_id == second.run_id
    with pytest.raises(SwarmError):
        fetch_manifest(a, RUN, creator="ab" * 8, timeout_seconds=1)


@pytest.mark.timeout(60)
def test_a_request_that_reaches_the_dht_process_in_parts_leaves_it_alive(dht_factory):
    # hivemind's DHT child reads requests from a non-blocking pipe: without dht.node's fix, a request
    # that arrives in parts (a big manifest record on a busy machine) kills the child. The parent's
    # writes are slowed here so that every request arrives in parts.
    dht, _ = dht_factory()
    pipe = dht._outer_pipe
    write = pipe._send

    def slow_write(buf, write_=write):
        half = len(buf) // 2
        write_(bytes(buf[:half]))
        time.sleep(0.3)
        write_(bytes(buf[half:]))

    pipe._send = slow_write
    try:
        dht.store("request-in-parts", b"x" * (1 << 20), get_dht_time() + 30, return_future=True).result(20)
        assert dht.store("small-request", b"y", get_dht_time() + 30, return_future=True).result(20)
    finally:
        del pipe._send
    assert dht.is_alive()
    assert dht.get("small-request", latest=True).value == b"y"


@pytest.mark.timeout(60)
def test_calls_from_many_threads_at_once_leave_the_dht_process_alive_and_answer_each(dht_factory):
    # hivemind writes each call into one pipe with no lock: two threads' requests written at once
    # interleave there (a request over 16 kB goes out as its length, then its body) and the DHT process
    # dies, leaving every caller waiting forever. A peer calls its DHT from its heartbeat, its training
    # loop and its services at once.
    dht, _ = dht_factory()
    failures: list[str] = []

    def calls(thread: int) -> None:
        try:
            for i in range(30):
                value = bytes([thread]) * (20_000 + i)
                key = f"threads-{thread}-{i}"
                assert dht.store(key, value, get_dht_time() + 60, return_future=True).result(10)
                assert dht.get(key, latest=True, return_future=True).result(10).value == value
        except BaseException as e:  # noqa: BLE001 - reported below, with the thread
            failures.append(f"thread {thread}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=calls, args=(t,), daemon=True) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert dht.is_alive()
    assert not failures, failures
    assert not any(t.is_alive() for t in threads)
