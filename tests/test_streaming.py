"""Streaming DiLoCo: fragments, schedule, equivalences, codecs, and bytes per fragment sync."""

from __future__ import annotations

import copy

import pytest
import torch

from monitoring.metrics import PeerMetrics
from peer.codecs.formats import make_codec
from peer.codecs.specs import CODEC_SPECS
from peer.config import OuterOptimizerConfig, RunManifest, SyncConfig
from peer.model.grid import ModelConfig, path_module_ids
from peer.model.transformer import PathModel
from peer.sync.fragments import FragmentPlan, fragments_due, sync_offsets
from peer.sync.module_sync import ModuleSync
from peer.sync.outer import StreamingOuter
from tests.sync_members import run_round, sync_group

CFG = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=33, blocks_per_module=4)


def test_fragment_plan_round_trip_and_equal_sizes():
    model = PathModel(CFG, (0, 1), seed=3)
    for mid in path_module_ids(CFG, (0, 1)):
        named = list(model.parts[mid].named_parameters())
        for n in (1, 2, 3, 4):
            plan = FragmentPlan(CFG, mid, [k for k, _ in named], [p.shape for _, p in named], n)
            flats = plan.split([p for _, p in named])
            sizes = [f.numel() for f in flats]
            assert sum(sizes) == sum(p.numel() for _, p in named)
            assert max(sizes) - min(sizes) < n
            for original, back in zip([p for _, p in named], plan.join(flats), strict=True):
                assert torch.equal(original.detach(), back)
    # 4 blocks, P=2, strided: fragment 0 is exactly blocks {0, 2}
    named = list(model.parts["l0m0"].named_parameters())
    plan = FragmentPlan(CFG, "l0m0", [k for k, _ in named], [p.shape for _, p in named], 2)
    blocks = {named[p.param][0].split(".")[1] for p in plan.pieces[0]}
    assert blocks == {"0", "2"}


def test_schedule_syncs_each_fragment_once_per_h_at_its_offset():
    h, p = 12, 4
    assert sync_offsets(h, p) == [0, 3, 6, 9]
    starts = {f: [s for s in range(1, 3 * h + 1) if f in fragments_due(s, h, p)] for f in range(p)}
    assert starts == {0: [12, 24, 36], 1: [3, 15, 27], 2: [6, 18, 30], 3: [9, 21, 33]}
    with pytest.raises(ValueError):
        sync_offsets(3, 4)


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, 33), generator=gen) for _ in range(n)]


def _train(model: PathModel, batches, after_step=None) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step, batch in enumerate(batches, start=1):
        loss = model.loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(step)


def _streaming(model: PathModel, h: int, sync: SyncConfig, outer: OuterOptimizerConfig):
    manifest = RunManifest(name="t", model=CFG, seq_len=32, inner_steps=h, sync=sync, outer=outer)
    syncs = {mid: ModuleSync(CFG, mid, model.parts[mid], outer, sync.fragments) for mid in model.module_ids}
    metrics = PeerMetrics("t", "me", "0", "test")
    loop = StreamingOuter(syncs, manifest, "me", metrics)
    return loop, syncs


def _params(model: PathModel) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("fragments", [1, 4])
def test_one_peer_with_outer_lr_1_and_no_momentum_equals_plain_training(fragments):
    base = PathModel(CFG, (0, 0), seed=1)
    plain, streamed = copy.deepcopy(base), copy.deepcopy(base)
    batches = _batches(24)
    _train(plain, batches)
    outer = OuterOptimizerConfig(lr=1.0, momentum=0.0, nesterov=False)
    loop, _ = _streaming(streamed, 8, SyncConfig(fragments=fragments), outer)
    _train(streamed, batches, lambda s: loop.after_step(s, 100 * s, {}))
    # θ̄ − (θ̄ − θ) equals θ up to fp32 rounding, which AdamW then carries along (~1e-5)
    assert float((_params(plain) - _params(streamed)).abs().max()) < 1e-4
    # ... while an outer step that does anything else is far off
    half = copy.deepcopy(base)
    loop, _ = _streaming(half, 8, SyncConfig(fragments=fragments), OuterOptimizerConfig(lr=0.5, momentum=0.0))
    _train(half, batches, lambda s: loop.after_step(s, 100 * s, {}))
    assert float((_params(plain) - _params(half)).abs().max()) > 1e-3


def test_alpha_one_equals_no_communication():
    base = PathModel(CFG, (0, 0), seed=2)
    plain, streamed = copy.deepcopy(base), copy.deepcopy(base)
    batches = _batches(24, seed=1)
    _train(plain, batches)
    loop, syncs = _streaming(
        streamed, 8, SyncConfig(fragments=4, overlap_steps=1, mixing_alpha=1.0), OuterOptimizerConfig()
    )
    _train(streamed, batches, lambda s: loop.after_step(s, 100 * s, {}))
    assert torch.equal(_params(plain), _params(streamed))
    assert all(r > 0 for ms in syncs.values() for r in ms.fragment_rounds)  # syncs did happen


def test_p1_tau0_reproduces_per_module_diloco():
    h, outer = 6, OuterOptimizerConfig(lr=0.7, momentum=0.9, nesterov=True)
    base = PathModel(CFG, (1, 0), seed=4)
    reference, streamed = copy.deepcopy(base), copy.deepcopy(base)
    batches = _batches(18, seed=2)

    # DiLoCo written out: per module, θ̄ ← SGD-Nesterov(θ̄, Δ = θ̄ − θ) every H steps, then θ ← θ̄.
    globals_ = {
        mid: [p.detach().clone() for p in reference.parts[mid].parameters()] for mid in reference.module_ids
    }
    momenta = {mid: [torch.zeros_like(p) for p in g] for mid, g in globals_.items()}

    def diloco(step):
        if step % h:
            return
        with torch.no_grad():
            for mid in reference.module_ids:
                for g, m, p in zip(
                    globals_[mid], momenta[mid], reference.parts[mid].parameters(), strict=True
                ):
                    delta = g - p
                    m.mul_(outer.momentum).add_(delta)
                    g.sub_(outer.lr * (delta + outer.momentum * m))
                    p.copy_(g)

    _train(reference, batches, diloco)
    loop, _ = _streaming(streamed, h, SyncConfig(fragments=1, overlap_steps=0), outer)
    _train(streamed, batches, lambda s: loop.after_step(s, 100 * s, {}))
    assert torch.allclose(_params(reference), _params(streamed), atol=1e-5)


@pytest.mark.parametrize("name", sorted(CODEC_SPECS))
def test_codecs_round_trip_within_their_error_and_refuse_bad_buffers(name):
    codec, spec = make_codec(name), CODEC_SPECS[name]
    x = torch.randn(10_001) * 0.01
    data = codec.encode(x)
    y = codec.decode(data, x.numel())
    assert y.shape == x.shape and y.dtype == torch.float32
    assert float((x - y).norm() / x.norm()) <= spec.error_bound
    # the table's size (what the receiver checks before reading, and planning counts) is exact
    assert len(data) == spec.wire_bytes(x.numel())
    with pytest.raises(ValueError):
        codec.decode(data[:-1], x.numel())
    with pytest.raises(ValueError):
        codec.decode(data, 2 * x.numel())


def test_bytes_per_fragment_sync_are_one_pth_of_a_full_sync(dht_factory):
    """Two holders of a real module sync it whole (P = 1) and by fragments of the plan (P = 4)."""
    p = 4
    cfg = ModelConfig(d_model=96, n_heads=4, d_ff=384, max_seq_len=33, blocks_per_module=4)
    model = PathModel(cfg, (0, 0), seed=5)
    sizes = {
        n: [
            ModuleSync(cfg, "l0m0", model.parts["l0m0"], OuterOptimizerConfig(), n).fragment_size(f)
            for f in range(n)
        ]
        for n in (1, p)
    }
    assert sum(sizes[p]) == sizes[1][0] and max(sizes[p]) - min(sizes[p]) < p
    sent = {}
    for n in (1, p):
        numel = sizes[n][0]
        with sync_group(dht_factory, 2, numel, codec="nf4") as members:
            results = run_round(members, [torch.randn(numel) * 0.01 for _ in members], [1.0, 1.0])
        assert [r.outcome for r in results] == ["averaged", "averaged"], [r.detail for r in results]
        sent[n] = sum(r.bytes_sent for r in results)
    assert sent[p] / sent[1] == pytest.approx(1 / p, rel=0.05)
