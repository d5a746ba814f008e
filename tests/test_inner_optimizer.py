"""The inner optimizer a run's manifest chooses: AdamW, or Muon on the linear layers (MuLoCo)."""

import pytest
import torch

from peer.config import InnerOptimizerConfig
from peer.model.grid import ModelConfig
from peer.model.transformer import PathModel
from peer.run.create import manifest_from_options
from peer.run.options import RunOptions
from peer.training.inner import cosine_lr, inner_step, make_inner_optimizer

pytestmark = pytest.mark.timeout(60)


def _model() -> PathModel:
    config = ModelConfig()
    return PathModel(config, (0,) * config.n_levels, seed=0)


def test_a_muon_run_gives_every_linear_weight_matrix_to_muon_and_every_other_parameter_to_adamw():
    model = _model()
    optimizer = make_inner_optimizer(model, InnerOptimizerConfig(muon=True))
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    assert in_muon == linear and linear
    assert not in_muon & in_adamw
    assert in_muon | in_adamw == {id(p) for p in model.parameters()}  # nothing left untrained


def test_an_adamw_run_keeps_one_adamw_over_every_parameter():
    model = _model()
    optimizer = make_inner_optimizer(model, InnerOptimizerConfig())
    assert isinstance(optimizer, torch.optim.AdamW)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}


def test_the_schedule_sets_muons_lr_and_adamws_alike_and_both_move_their_parameters():
    model = _model()
    inner = InnerOptimizerConfig(lr=1e-3, warmup_steps=4, total_steps=10, muon=True)
    optimizer = make_inner_optimizer(model, inner)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = torch.randint(0, 20, (2, 17), generator=torch.Generator().manual_seed(0))
    inner_step(model, optimizer, batch, inner, step=2)
    want = inner.lr * cosine_lr(2, inner.warmup_steps, inner.total_steps)
    assert [g["lr"] for o in optimizer.optimizers for g in o.param_groups] == [want, want]
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert "parts.l0m0.blocks.0.qkv.weight" in moved and "parts.trunk.tok_emb.weight" in moved
    assert all(p.grad is None for p in model.parameters())  # zeroed for the next step


def test_run_create_muon_flag_records_muon_in_the_manifests_inner_section(tmp_path):
    manifest = manifest_from_options(RunOptions(name="r", grid="1x2", muon=True))
    assert manifest.inner.muon is True
    assert manifest_from_options(RunOptions(name="r", grid="1x2")).inner.muon is False
