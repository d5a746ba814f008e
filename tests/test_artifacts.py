"""Content-addressed artifacts between real peers: fetched by hash from whoever serves them, in
verified chunks from several sources, resumed after a crash, and refused when tampered with; the
run's routing index, a speed-up, never stops a peer that cannot get it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from peer.artifacts.ref import ArtifactRef
from peer.artifacts.store import ArtifactError, ArtifactStore
from peer.artifacts.transfer import ArtifactService, providers
from tests.swarm_harness import RUN

RUN_ID = "ab" * 32
CHUNK = 64 * 1024
pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


@pytest.fixture
def original(tmp_path) -> Path:
    path = tmp_path / "base.safetensors"
    path.write_bytes(os.urandom(20 * CHUNK + 1234))  # 21 chunks, the last one short
    return path


@pytest.fixture
def swarm(dht_factory, tmp_path):
    """make(name) -> (dht, key, ArtifactService) on a fresh node of one run; all shut down after."""
    services = []

    def make(name: str, limits=None):
        dht, key = dht_factory(run_name=RUN, run_id=RUN_ID)
        service = ArtifactService(dht, ArtifactStore(tmp_path / name), limits)
        services.append(service)
        return dht, key, service

    try:
        yield make
    finally:
        for s in services:
            s.shutdown()


def _tampered(store: ArtifactStore, ref: ArtifactRef, original: Path, chunk: int) -> None:
    """A source that holds the true chunk list but a file with one chunk altered."""
    honest = ArtifactStore(store.root.parent / "honest-copy")
    honest.add_file(original, ref.name, CHUNK)
    data = bytearray(original.read_bytes())
    data[chunk * CHUNK + 7] ^= 0xFF
    store.root.mkdir(parents=True, exist_ok=True)
    store.path(ref.sha256).write_bytes(bytes(data))
    for suffix in (".json", ".chunks"):
        (store.root / f"{ref.sha256}{suffix}").write_bytes(
            (honest.root / f"{ref.sha256}{suffix}").read_bytes()
        )


def test_a_late_joiner_fetches_an_artifact_by_hash_from_a_peer_that_is_not_its_creator(swarm, original):
    creator_dht, creator_key, creator = swarm("creator")
    ref = creator.store.add_file(original, "base", CHUNK)
    creator.offer(ref)
    creator.publish(creator_dht, creator_key, RUN, RUN_ID)

    dht_b, key_b, b = swarm("b")
    assert providers(dht_b, RUN, RUN_ID, ref.sha256) == [creator.peer_id]
    path_b = b.fetch(ref, providers(dht_b, RUN, RUN_ID, ref.sha256), progress=False)
    assert path_b.read_bytes() == original.read_bytes() and b.chunks_fetched == ref.n_chunks == 21
    b.offer(ref)
    b.publish(dht_b, key_b, RUN, RUN_ID)
    creator.shutdown()  # the creator is gone; its record still names it until it expires

    dht_c, _, c = swarm("c")
    sources = providers(dht_c, RUN, RUN_ID, ref.sha256)
    assert set(sources) == {creator.peer_id, b.peer_id}
    path_c = c.fetch(ref, sources, progress=False)
    assert hashlib.sha256(path_c.read_bytes()).hexdigest() == ref.sha256
    assert b.chunks_served >= ref.n_chunks and c.chunks_fetched == ref.n_chunks
    assert c.fetch(ref, [], progress=False) == path_c  # already here: nothing asked


def test_a_partial_download_resumes_with_only_the_chunks_it_lacks(swarm, original):
    dht_a, key_a, a = swarm("a")
    ref = a.store.add_file(original, "base", CHUNK)
    a.offer(ref)
    _, _, c = swarm("c")
    # what a crash left: the first 12 chunks written, chunk 5 of them torn
    c.store.root.mkdir(parents=True)
    partial = bytearray(original.read_bytes()[: 12 * CHUNK])
    partial[5 * CHUNK] ^= 1
    (c.store.root / f"{ref.sha256}.part").write_bytes(bytes(partial))
    path = c.fetch(ref, [a.peer_id], progress=False)
    assert path.read_bytes() == original.read_bytes()
    assert c.chunks_fetched == 21 - 11 and a.chunks_served == 10


def test_a_tampered_source_is_dropped_at_its_first_bad_chunk_and_an_honest_one_completes(swarm, original):
    _, _, honest = swarm("honest")
    ref = honest.store.add_file(original, "base", CHUNK)
    honest.offer(ref)
    _, _, evil = swarm("evil")
    _tampered(evil.store, ref, original, chunk=0)
    evil.offer(ref)
    _, _, c = swarm("c")
    path = c.fetch(ref, [evil.peer_id, honest.peer_id], progress=False)
    assert path.read_bytes() == original.read_bytes()
    # the evil source was asked for a chunk or two at most before it was dropped
    assert evil.chunks_served <= 4 and honest.chunks_served >= ref.n_chunks - 4


def test_an_artifact_offered_only_tampered_is_refused_in_one_line_and_never_stored(swarm, original):
    _, _, honest = swarm("honest")
    ref = honest.store.add_file(original, "base", CHUNK)
    _, _, evil = swarm("evil")
    _tampered(evil.store, ref, original, chunk=3)
    evil.offer(ref)
    _, _, c = swarm("c")
    with pytest.raises(ArtifactError) as refused:
        c.fetch(ref, [evil.peer_id], progress=False)
    assert "\n" not in str(refused.value) and "could not be fetched" in str(refused.value)
    assert "does not match its digest" in str(refused.value)
    assert not c.store.has(ref)

    # a chunk list that is not the manifest's is refused before any chunk is asked for
    other = ref.model_copy(update={"chunks_sha256": "0" * 64})
    with pytest.raises(ArtifactError, match="no source sent its chunk list"):
        c.fetch(other, [honest.peer_id], progress=False)
    with pytest.raises(ArtifactError, match="no peer offers it"):
        c.fetch(ref, [], progress=False)


def test_a_reference_whose_chunk_list_cannot_travel_in_one_message_is_refused():
    fields = dict(name="base", sha256="a" * 64, chunks_sha256="b" * 64)
    assert ArtifactRef(size_bytes=64 << 30, chunk_bytes=1 << 20, **fields).n_chunks == 65536
    with pytest.raises(ValueError, match="would not fit one message"):
        ArtifactRef(size_bytes=1 << 30, chunk_bytes=4096, **fields)  # 262,144 chunks: an 8 MiB list


def test_a_source_over_its_upload_limits_answers_busy_and_the_fetcher_waits_its_turn(swarm, original):
    """Chunks go out at the source's rate for the asker (here 4 chunks a second): a fetcher that
    asks faster is told "busy" (nothing uploaded), waits and asks again, and gets the whole artifact."""
    import time

    from dht.serve_limits import ServeLimits, ServeLimitSettings

    limits = ServeLimits(ServeLimitSettings(1e9, 8, 4 * CHUNK, 4, 1.0))
    creator_dht, creator_key, creator = swarm("creator", limits)
    ref = creator.store.add_file(original, "base", CHUNK)
    creator.offer(ref)
    _, _, b = swarm("b")
    started = time.monotonic()
    path = b.fetch(ref, [creator.peer_id], progress=False)
    assert path.read_bytes() == original.read_bytes()
    assert limits.refused.get("asker_rate", 0) > 0 and creator.chunks_served == ref.n_chunks
    assert time.monotonic() - started > (21 - 4) / 4 * 0.8  # the rate held: 21 chunks, 4 a second


def test_a_peer_that_finds_no_source_of_the_routing_index_starts_without_it_and_adopts_a_local_copy(
    dht_factory, tmp_path, monkeypatch, caplog
):
    from dht.serve_limits import ServeLimits
    from peer.config import PeerConfig, RunManifest
    from peer.run.routing_index import run_index_file
    from peer.swarm import base_model

    index = tmp_path / "index.bin"
    index.write_bytes(os.urandom(16 * 100))
    ref = ArtifactStore(tmp_path / "described").add_file(index, "routing_index.bin")
    manifest = RunManifest(name=RUN, routing_index=ref)
    monkeypatch.setattr(base_model, "INDEX_SOURCES_SECONDS", 0.5)
    dht, key = dht_factory(run_name=RUN, run_id=RUN_ID)
    joined = [str(m) for m in dht.get_visible_maddrs()]
    config = PeerConfig(run=RUN, initial_peers=joined, checkpoint_dir=tmp_path / "peer")
    service, base = base_model.start_artifact_service(dht, key, config, manifest, RUN_ID, ServeLimits())
    try:  # nobody serves it: a warning and a start, not the minute-long wait and error of a base model
        assert base is None and run_index_file(manifest, [service.store.root]) is None
        assert (
            "could not get the run's routing index" in caplog.text
            and "routing every document here" in caplog.text
        )
    finally:
        service.shutdown()
    # beside the manifest (where run create writes it), it is taken in and read
    ArtifactStore(tmp_path / "run" / "artifacts").add_file(index, "routing_index.bin")
    config = PeerConfig(run=RUN, initial_peers=joined, checkpoint_dir=tmp_path / "peer",
                        manifest_path=tmp_path / "run" / "manifest.json")  # fmt: skip
    service, _ = base_model.start_artifact_service(dht, key, config, manifest, RUN_ID, ServeLimits())
    try:
        assert run_index_file(manifest, [service.store.root]) == service.store.path(ref.sha256)
        assert service.store.path(ref.sha256).read_bytes() == index.read_bytes()
    finally:
        service.shutdown()
