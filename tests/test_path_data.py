"""A peer's data across its moves (`PathData`): a path it comes back to goes on where its stream
stopped, a new router version starts the stream again, only the latest few streams are kept, a
path visited for the first time routes only what no earlier pass read nor the run's routing index
covers, and the next batches are made ahead of the loop without changing which batches it gets."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch

from peer.artifacts.store import ArtifactStore
from peer.data.batches import PathBatches, encode_document
from peer.data.prefetch import PrefetchedBatches
from peer.data.routed import RECORD, RoutedDocuments, build_index
from peer.data.sources import load_documents, split_of
from peer.errors import ConfigError
from peer.run.rebuild import check_tokenizer, make_route
from peer.run.record import load_verified_manifest
from peer.seeding import stable_seed
from peer.training.path_data import PathData
from tests.swarm_harness import write_manifest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def run(tmp_path):
    path, _ = write_manifest(tmp_path, grid=(2, 2))
    manifest, _ = load_verified_manifest(path)
    return manifest, check_tokenizer(manifest), make_route(manifest)


def fresh_stream(manifest, tokenizer, route, index: int, step: int) -> PathBatches:
    """What a peer built at every move before PathData: a new stream of the path, seeded by the step."""
    return PathBatches(
        load_documents(manifest.dataset), route, index, tokenizer, manifest.seq_len, 4,
        seed=stable_seed("me", step), eval_fraction=manifest.dataset.eval_fraction,
    )  # fmt: skip


def take(stream, n: int) -> list[torch.Tensor]:
    return [next(stream) for _ in range(n)]


def test_a_path_the_peer_comes_back_to_goes_on_where_its_stream_stopped(run):
    manifest, tokenizer, route = run
    data = PathData(manifest, tokenizer, 4, None, "me")
    first_visit = take(data.batches(0, route, [], step=0), 3)
    take(data.batches(1, route, [], step=3), 2)  # a move to path 1 and back
    back = take(data.batches(0, route, [], step=5), 2)
    reference = take(fresh_stream(manifest, tokenizer, route, 0, step=0), 5)
    for got, want in zip(first_visit + back, reference, strict=True):
        assert torch.equal(got, want)
    # before, a path visited again started over at the top of its shard: the data repeated
    assert not torch.equal(back[0], take(fresh_stream(manifest, tokenizer, route, 0, step=5), 1)[0])


def test_a_new_route_starts_the_paths_stream_again_and_only_the_latest_streams_are_kept(run, monkeypatch):
    manifest, tokenizer, route = run
    data = PathData(manifest, tokenizer, 4, None, "me")
    take(data.batches(0, route, [], step=0), 3)
    rerouted = make_route(manifest)  # a router version: another route object
    again = take(data.batches(0, rerouted, [], step=7), 1)[0]
    assert torch.equal(again, take(fresh_stream(manifest, tokenizer, rerouted, 0, step=7), 1)[0])
    monkeypatch.setattr(PathData, "KEPT_PATHS", 2)
    take(data.batches(1, route, [], step=8), 1)
    take(data.batches(2, route, [], step=9), 1)  # path 0's stream, the least recent, is dropped
    restarted = take(data.batches(0, route, [], step=10), 1)[0]
    assert torch.equal(restarted, take(fresh_stream(manifest, tokenizer, route, 0, step=10), 1)[0])


def test_a_resumed_peers_data_goes_on_where_its_streams_stood_before_the_restart(run):
    manifest, tokenizer, route = run
    before = PathData(manifest, tokenizer, 4, None, "me")
    take(before.batches(0, route, [], step=3), 7)
    take(before.batches(1, route, [], step=10), 2)  # a move: both streams are in the checkpoint
    saved = before.positions(router_version=0)
    assert saved["streams"] == [dict(path=0, seed=stable_seed("me", 3), batches=7),
                                dict(path=1, seed=stable_seed("me", 10), batches=2)]  # fmt: skip
    after = PathData(manifest, tokenizer, 4, None, "me")  # the next life of the peer
    after.resume_from(saved)
    assert after.positions(router_version=0) == saved  # a checkpoint before the data starts keeps them
    resumed = take(after.batches(1, route, [], step=12), 3)
    reference = take(fresh_stream(manifest, tokenizer, route, 1, step=10), 5)
    for got, want in zip(resumed, reference[2:], strict=True):
        assert torch.equal(got, want)
    back = take(after.batches(0, route, [], step=15), 1)[0]
    assert torch.equal(back, take(fresh_stream(manifest, tokenizer, route, 0, step=3), 8)[7])
    # before, a restart began the shard at the top: the first batches over again
    assert not torch.equal(resumed[0], reference[0])


def test_positions_of_another_router_version_or_not_a_record_start_the_data_again(run, caplog):
    manifest, tokenizer, route = run
    before = PathData(manifest, tokenizer, 4, None, "me")
    take(before.batches(0, route, [], step=3), 7)
    saved = before.positions(router_version=1)
    switched = PathData(manifest, tokenizer, 4, None, "me")
    switched.resume_from(saved)
    top = take(fresh_stream(manifest, tokenizer, route, 0, step=20), 1)[0]
    assert torch.equal(take(switched.batches(0, route, [], step=20, router_version=2), 1)[0], top)
    for bad in ({"streams": []}, {"router_version": 0, "streams": [{"path": 9, "seed": 1, "batches": 2}]},
                {"router_version": 0, "streams": [{"path": 0, "seed": 1, "batches": -2}]}, "x"):  # fmt: skip
        data = PathData(manifest, tokenizer, 4, None, "me")
        data.resume_from(bad)
        assert torch.equal(take(data.batches(0, route, [], step=20), 1)[0], top)
    assert caplog.text.count("data positions are not a record of streams") == 4


def counting(route, calls: list[int]):
    """`route`, counting the documents it is asked to route."""

    def counted(token_lists):
        calls.append(len(token_lists))
        return route(token_lists)

    return counted


def test_a_path_visited_first_routes_only_documents_no_earlier_pass_read_and_trains_on_the_same(run):
    manifest, tokenizer, route = run
    calls: list[int] = []
    route = counting(route, calls)
    data = PathData(manifest, tokenizer, 4, None, "me")
    first = data.batches(0, route, [], step=0)
    while data._streams[0].stream.epoch == 0:  # path 0's whole first pass: every document routed once
        next(first)
    read = sum(calls)
    assert read > 0
    moved = take(data.batches(1, route, [], step=9), 5)
    assert sum(calls) == read  # before, a move to a path not visited yet routed the corpus again
    reference = take(fresh_stream(manifest, tokenizer, route, 1, step=9), 5)
    for got, want in zip(moved, reference, strict=True):
        assert torch.equal(got, want)
    assert sum(calls) > read  # the fresh stream, on its own, routes what its batches need


def test_a_restarted_peer_routes_none_of_the_documents_its_last_life_routed(run, tmp_path):
    manifest, tokenizer, route = run
    calls: list[int] = []
    # no batches made ahead: the documents read are those the batches taken needed, counted exactly
    before = PathData(manifest, tokenizer, 4, None, "me", index_dir=tmp_path, prefetch=0)
    first = before.batches(0, counting(route, calls), [], step=0)
    for _ in range(3):  # part of the first pass: the index on disk covers what was read
        next(first)
    read, covered = sum(calls), before._streams[0].stream.docs_seen
    assert 0 < read <= covered < 400  # the corpus's 400 documents: some are left to read
    index = next((tmp_path / "routes").iterdir())
    with open(index, "ab") as f:
        f.write(b"\x01\x02\x03")  # a record torn by the kill
    calls.clear()
    after = PathData(manifest, tokenizer, 4, None, "me", index_dir=tmp_path, prefetch=0)  # the next life
    after.resume_from(before.positions(router_version=0))
    resumed = take(after.batches(0, counting(route, calls), [], step=3), 3)
    assert sum(calls) == 0  # before, the whole way to the position was routed again
    reference = take(fresh_stream(manifest, tokenizer, route, 0, step=0), 6)
    for got, want in zip(resumed, reference[3:], strict=True):
        assert torch.equal(got, want)
    stream = after.batches(1, counting(route, calls), [], step=6)
    moved = take(stream, 40)
    for got, want in zip(moved, take(fresh_stream(manifest, tokenizer, route, 1, step=6), 40), strict=True):
        assert torch.equal(got, want)
    while after._streams[1].stream.epoch == 0:  # a whole first pass: what the index did not cover is routed
        next(stream)
    assert 0 < sum(calls) <= 400 - covered
    assert index.stat().st_size % 16 == 0


def test_a_document_that_changed_at_its_position_is_routed_again(run):
    manifest, tokenizer, route = run
    calls: list[int] = []
    routed = RoutedDocuments(counting(route, calls), eval_fraction=0.0)
    texts = [d for _, d in zip(range(40), load_documents(manifest.dataset), strict=False)]
    encode = functools.partial(encode_document, tokenizer)
    before = routed.paths(0, texts, encode, wanted=1)
    assert sum(calls) == 40 and [t is not None for _, t in before] == [p == 1 for p, _ in before]
    changed = [*texts[:7], texts[30], *texts[8:]]  # position 7 holds another document now
    after = routed.paths(0, changed, encode, wanted=1)
    assert sum(calls) == 41
    assert after[7][0] == before[30][0] and [p for p, _ in after[8:]] == [p for p, _ in before[8:]]
    assert all(t == encode(changed[i]) for i, (p, t) in enumerate(after) if p == 1)


def test_documents_past_the_index_cap_are_routed_again_by_every_pass(run):
    manifest, tokenizer, route = run
    calls: list[int] = []
    routed = RoutedDocuments(counting(route, calls), eval_fraction=0.0, max_documents=30)
    texts = [d for _, d in zip(range(40), load_documents(manifest.dataset), strict=False)]
    encode = functools.partial(encode_document, tokenizer)
    first = routed.paths(0, texts, encode, wanted=0)
    assert len(routed) == 30 and sum(calls) == 40
    assert routed.paths(0, texts, encode, wanted=0) == first and sum(calls) == 50


def test_a_peer_given_the_runs_routing_index_routes_only_the_documents_it_does_not_cover(run, tmp_path):
    manifest, tokenizer, route = run
    texts = [d for _, d in zip(range(60), load_documents(manifest.dataset), strict=False)]
    encode, eval_fraction = functools.partial(encode_document, tokenizer), manifest.dataset.eval_fraction
    made: list[int] = []
    assert build_index(counting(route, made), eval_fraction, texts, encode, tmp_path / "run.idx", 40) == 40
    assert 0 < sum(made) <= 40 and (tmp_path / "run.idx").stat().st_size == 40 * RECORD.itemsize
    calls: list[int] = []
    peer = RoutedDocuments(counting(route, calls), eval_fraction, file=tmp_path / "own.idx",
                           run_index=tmp_path / "run.idx")  # fmt: skip
    changed = [*texts[:7], texts[50], *texts[8:]]  # position 7 holds another document here
    got = peer.paths(0, changed, encode, wanted=1)
    assert got == RoutedDocuments(route, eval_fraction).paths(0, changed, encode, wanted=1)
    # routed here: the changed document and those past the index's 40, nothing else
    assert sum(calls) == _train(texts[50], manifest) + len([t for t in changed[40:] if _train(t, manifest)])
    positions = sorted(int(p) for p in np.fromfile(tmp_path / "own.idx", RECORD)["position"])
    assert positions == [7, *range(40, 60)]  # the peer keeps what it routed, not what it was given


def _train(text: str, manifest) -> bool:
    return split_of(text, manifest.dataset) == "train"


def test_path_data_reads_the_run_index_the_manifest_names_and_its_batches_are_the_same(run, tmp_path):
    manifest, tokenizer, route = run
    encode = functools.partial(encode_document, tokenizer)
    documents, index = load_documents(manifest.dataset), tmp_path / "routing_index.bin"
    build_index(route, manifest.dataset.eval_fraction, documents, encode, index, 10_000)
    store = ArtifactStore(tmp_path / "artifacts")
    indexed = manifest.model_copy(update={"routing_index": store.add_file(index, index.name)})
    calls: list[int] = []
    data = PathData(indexed, tokenizer, 4, None, "me", prefetch=0, artifact_folders=[store.root])
    got = take(data.batches(2, counting(route, calls), [], step=0), 30)
    assert sum(calls) == 0
    for a, b in zip(got, take(fresh_stream(manifest, tokenizer, route, 2, step=0), 30), strict=True):
        assert torch.equal(a, b)
    # a file of the index's name that is not the run's is not believed: the peer routes for itself
    store.path(indexed.routing_index.sha256).write_bytes(b"\0" * indexed.routing_index.size_bytes)
    data = PathData(indexed, tokenizer, 4, None, "me", prefetch=0, artifact_folders=[store.root])
    take(data.batches(2, counting(route, calls), [], step=0), 3)
    assert sum(calls) > 0


def settles(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


def producers(*streams: PrefetchedBatches) -> list[str]:
    """The names of the producer threads of `streams` that run."""
    return [s._thread.name for s in streams if s._thread is not None and s._thread.is_alive()]


def test_the_next_batches_are_made_ahead_on_a_thread_and_come_in_the_streams_order(run):
    manifest, tokenizer, route = run
    data = PathData(manifest, tokenizer, 4, None, "me", prefetch=2)
    stream = data.batches(0, route, [], step=0)
    got = take(stream, 3)
    made = data._streams[0]
    settles(lambda: made.pending == 2, "two batches made while the loop asked for none")
    assert made.stream.batches_yielded == 5 and producers(made) == ["prefetch-path0"]
    got += take(stream, 4)
    for a, b in zip(got, take(fresh_stream(manifest, tokenizer, route, 0, step=0), 7), strict=True):
        assert torch.equal(a, b)
    data.shutdown()
    assert producers(made) == []


def test_a_checkpoint_counts_the_batches_the_loop_took_not_those_made_ahead(run):
    manifest, tokenizer, route = run
    before = PathData(manifest, tokenizer, 4, None, "me", prefetch=3)
    take(before.batches(0, route, [], step=3), 4)
    settles(lambda: before._streams[0].pending == 3, "three batches made ahead")
    saved = before.positions(router_version=0)
    assert saved["streams"] == [dict(path=0, seed=stable_seed("me", 3), batches=4)]
    after = PathData(manifest, tokenizer, 4, None, "me", prefetch=3)  # the next life of the peer
    after.resume_from(saved)
    resumed = take(after.batches(0, route, [], step=9), 2)
    reference = take(fresh_stream(manifest, tokenizer, route, 0, step=3), 6)
    for a, b in zip(resumed, reference[4:], strict=True):  # the batches made ahead are not skipped
        assert torch.equal(a, b)
    settles(lambda: after._streams[0].pending == 3, "three batches made ahead again")
    went_on = dict(path=0, seed=stable_seed("me", 3), batches=6)  # the 4 before, the 2 taken since
    assert after.positions(router_version=0)["streams"] == [went_on]
    before.shutdown()
    after.shutdown()


def test_a_move_stops_the_old_paths_producer_and_what_it_made_ahead_comes_first_on_return(run):
    manifest, tokenizer, route = run
    data = PathData(manifest, tokenizer, 4, None, "me", prefetch=2)
    first = take(data.batches(0, route, [], step=0), 1)
    settles(lambda: data._streams[0].pending == 2, "path 0's next batches made")
    take(data.batches(1, route, [], step=1), 1)
    kept = list(data._streams.values())
    assert producers(*kept) == ["prefetch-path1"]  # one producer: the streams share what they route
    assert data._streams[0].stream.batches_yielded == 3 and data._streams[0].pending == 2
    back = take(data.batches(0, route, [], step=2), 3)
    for a, b in zip(first + back, take(fresh_stream(manifest, tokenizer, route, 0, step=0), 4), strict=True):
        assert torch.equal(a, b)
    data.shutdown()
    assert producers(*kept) == []


def test_a_stream_that_cannot_make_a_batch_raises_its_error_where_the_loop_asks_every_time():
    def failing():
        yield torch.zeros(1)
        yield torch.ones(1)
        raise ConfigError("no training documents are routed to path 3")

    batches = PrefetchedBatches(failing(), depth=2, name="failing")
    assert torch.equal(next(batches), torch.zeros(1)) and torch.equal(next(batches), torch.ones(1))
    for _ in range(2):
        with pytest.raises(ConfigError, match="no training documents are routed to path 3"):
            next(batches)
    assert batches.handed == 2
    batches.pause()
    assert producers(batches) == []
