"""The outer step of a fragment is computed off the training thread as soon as its round ends, and
installed at the due step only if it was computed from the state the fragment still holds."""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from monitoring.metrics import PeerMetrics
from peer.config import OuterOptimizerConfig, RunManifest, SyncConfig
from peer.model.grid import ModelConfig
from peer.model.transformer import PathModel
from peer.sync.module_sync import ModuleSync, state_digest
from peer.sync.outer import StreamingOuter
from tests.sync_members import advance, sync_group

pytestmark = pytest.mark.swarm

CFG = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=33, blocks_per_module=4)
OUTER = OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True)
MODULE = "l0m0"


def _pair(fragments: int = 2) -> tuple[ModuleSync, ModuleSync]:
    base = PathModel(CFG, (0, 0), seed=5)
    models = [copy.deepcopy(base) for _ in range(2)]
    return tuple(ModuleSync(CFG, MODULE, m.parts[MODULE], OUTER, fragments) for m in models)


def _local(ms: ModuleSync) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in ms.local_params])


def _state(ms: ModuleSync) -> list[torch.Tensor]:
    return [*ms.global_flats, *ms.momenta, _local(ms)]


def test_outer_step_prepared_on_another_thread_installs_the_same_bits_as_inline():
    inline, offloaded = _pair()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):  # momentum builds up over rounds
        for f in range(inline.n_fragments):
            delta = torch.randn(inline.fragment_size(f), generator=gen) * 1e-2
            inline.apply(f, delta, 0.5)
            with ThreadPoolExecutor(1) as pool:
                prepared = pool.submit(offloaded.prepare_step, f, delta).result(timeout=30)
            offloaded.apply(f, delta, 0.5, prepared)
            # installed, not recomputed: the training thread did none of the step's work
            assert offloaded.global_flats[f] is prepared.theta
            assert offloaded.digest(f) == state_digest(offloaded.global_flats[f], offloaded.momenta[f])
    for a, b in zip(_state(inline), _state(offloaded), strict=True):
        assert torch.equal(a, b)
    assert inline.module_digest() == offloaded.module_digest()


def test_prepared_step_is_not_installed_on_a_state_replaced_since():
    """A merge or a download between the round's end and the due step replaces θ̄: the step
    prepared from the old θ̄ would throw that away, so the step is computed again from the new one."""
    reference, replaced = _pair(fragments=1)
    delta = torch.full((replaced.fragment_size(0),), 1e-2)
    stale = replaced.prepare_step(0, delta)
    merged_theta = replaced.global_flats[0] + 0.25
    merged_momentum = torch.full_like(replaced.momenta[0], 0.1)
    for ms in (reference, replaced):
        ms.load_fragment_copy(0, merged_theta, merged_momentum)
    reference.apply(0, delta, 0.0)
    replaced.apply(0, delta, 0.0, stale)
    assert not torch.equal(replaced.global_flats[0], stale.theta)
    for a, b in zip(_state(reference), _state(replaced), strict=True):
        assert torch.equal(a, b)
    assert replaced.digest(0) == reference.digest(0)


def test_overlapped_rounds_outer_steps_run_off_the_training_thread(dht_factory):
    """Two holders, τ = 2: each round has ended well before its due step (the test waits for it),
    so every outer step of both holders is computed by the outer-step thread, and their copies
    stay the same bits."""
    h, rounds, tau = 8, 3, 2
    sync = SyncConfig(
        inner_steps=h, fragments=2, overlap_steps=tau, mixing_alpha=0.5, codec="fp32", aggregator="mean"
    )
    manifest = RunManifest(name="t", model=CFG, seq_len=32, sync=sync, outer=OUTER)
    syncs = _pair(fragments=2)
    models_params = [list(ms.local_params) for ms in syncs]
    threads_seen: list[str] = []
    for ms in syncs:
        plain = ms.prepare_step

        def recorded(fragment, delta, plain=plain):
            threads_seen.append(threading.current_thread().name)
            return plain(fragment, delta)

        ms.prepare_step = recorded
    numel = syncs[0].fragment_size(0)
    assert syncs[0].fragment_size(1) == numel
    with sync_group(dht_factory, 2, numel, fragments=2) as members:
        holders = {MODULE: [m.peer_id for m in members]}
        loops = []
        for m, ms in zip(members, syncs, strict=True):
            metrics = PeerMetrics("t", m.peer_id, "0", "test")
            loops.append(StreamingOuter({MODULE: ms}, manifest, m.peer_id, metrics, m.runner))
        errors: list[BaseException] = []

        def train(i: int) -> None:
            gen = torch.Generator().manual_seed(20 + i)
            try:
                for step in range(1, h * rounds + 1):
                    with torch.no_grad():
                        for p in models_params[i]:
                            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
                    _wait_prepared([p for p in loops[i].pending if p.due_step <= loops[i].clock + 1])
                    advance(loops[i], 100 * step, holders)
                _wait_prepared(loops[i].pending)
                advance(loops[i], 0, holders, drain=True)
            except BaseException as e:  # surfaced below, not lost in the thread
                errors.append(e)

        workers = [threading.Thread(target=train, args=(i,)) for i in range(2)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(timeout=90)
    assert not errors, errors
    a, b = syncs
    assert a.fragment_rounds == b.fragment_rounds == [rounds, rounds]
    assert len(threads_seen) == 2 * 2 * rounds
    assert all(name.startswith("outer-step") for name in threads_seen), threads_seen
    for f in range(2):
        assert torch.equal(a.global_flats[f], b.global_flats[f])
        assert torch.equal(a.momenta[f], b.momenta[f])


def _wait_prepared(pending) -> None:
    deadline = time.monotonic() + 10
    while any(MODULE not in p.prepared for p in pending) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_a_state_served_while_a_round_is_installed_has_that_rounds_tensors_with_that_rounds_count():
    """A joiner downloads a holder's state on the sync service's thread while the training thread
    installs a round: what it gets must be one round's tensors with that round's count, or it applies
    the round again and its copy splits from the group's. The install is held in the middle (while it
    writes the local parameters) and the state is read then."""
    ms, _ = _pair(fragments=1)
    before = ms.snapshot()
    delta = torch.full((ms.fragment_size(0),), 1e-2)
    entered, release = threading.Event(), threading.Event()
    scatter = ms.plan.scatter

    def held_scatter(*args, **kwargs):
        entered.set()
        release.wait(10)
        return scatter(*args, **kwargs)

    ms.plan.scatter = held_scatter
    installing = threading.Thread(target=ms.apply, args=(0, delta))
    installing.start()
    try:
        assert entered.wait(10)
        rounds, tensors = ms.snapshot()
    finally:
        release.set()
        installing.join(10)
    moved = not torch.equal(tensors[0], before[1][0])
    assert (rounds, moved) in (([0], False), ([1], True)), (rounds, moved)
