"""The grid model: parameter map, seeded module init, warm start, in-process DiPaCo sync, export and
single-path generation."""

from __future__ import annotations

import torch

from peer.config import InnerOptimizerConfig, OuterOptimizerConfig, RunManifest
from peer.model.grid import ModelConfig, all_paths, path_from_index, path_module_ids
from peer.model.route import prefix_features
from peer.model.router import fit_router
from peer.model.tokenizer import ByteTokenizer
from peer.model.transformer import GridModel, PathModel, build_module, parameter_map
from peer.offline.inference import export_path, generate, load_exported
from peer.offline.simulate import DipacoSim, SimConfig, dense_config, warm_start_modules

SMALL = dict(d_model=32, n_heads=2, d_ff=64, max_seq_len=64)


def _randomize(module: torch.nn.Module, seed: int = 1) -> None:
    """Moves weights off their init (LayerNorms and biases start constant) so equalities mean something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_parameter_map_covers_every_parameter_once():
    configs = [
        ModelConfig(**SMALL),
        ModelConfig(**SMALL, private_blocks_per_path=2, blocks_per_module=3),
        ModelConfig(
            **SMALL, n_levels=3, modules_per_level=3, blocks_per_module=2, fragment_layout="sequential"
        ),
    ]
    for cfg in configs:
        grid = GridModel(cfg)
        actual = {(name.removeprefix("grid."), tuple(p.shape)) for name, p in grid.named_parameters()}
        assert len(actual) == sum(1 for _ in grid.named_parameters())
        for n_fragments in (1, 2, 3):
            slots = parameter_map(cfg, n_fragments)
            listed = [(f"{s.module_id}.{s.name}", s.shape) for s in slots]
            assert len(listed) == len(set(listed)), "a parameter is listed twice"
            assert set(listed) == actual
            assert {s.fragment for s in slots} == set(range(n_fragments))
            assert sum(torch.Size(s.shape).numel() for s in slots) == sum(
                p.numel() for p in grid.parameters()
            )


def test_module_init_depends_only_on_seed_and_module_id():
    cfg = ModelConfig(**SMALL, private_blocks_per_path=1)
    torch.manual_seed(123)
    a = build_module(cfg, "l1m0", seed=7).state_dict()
    torch.manual_seed(999)
    torch.randn(1000)  # global RNG state and earlier draws must not matter
    b = build_module(cfg, "l1m0", seed=7).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Built inside a path or inside the whole grid (other modules built first), the module is the same.
    from_path = PathModel(cfg, (1, 0), seed=7).parts["l1m0"].state_dict()
    from_grid = GridModel(cfg, seed=7).grid["l1m0"].state_dict()
    assert all(torch.equal(a[k], from_path[k]) and torch.equal(a[k], from_grid[k]) for k in a)
    other_seed = build_module(cfg, "l1m0", seed=8).state_dict()
    other_module = build_module(cfg, "l1m1", seed=7).state_dict()
    assert not torch.equal(a["blocks.0.qkv.weight"], other_seed["blocks.0.qkv.weight"])
    assert not torch.equal(a["blocks.0.qkv.weight"], other_module["blocks.0.qkv.weight"])


def test_warm_start_makes_every_path_a_copy_of_the_base():
    cfg = ModelConfig(**SMALL, blocks_per_module=2, private_blocks_per_path=1)
    base = PathModel(dense_config(cfg), (0,), seed=3)
    _randomize(base)
    grid = GridModel(cfg)
    for mid, state in warm_start_modules(cfg, base).items():
        grid.grid[mid].load_state_dict(state)
    tokens = torch.randint(0, 256, (2, 20))
    expected = base(tokens)
    for path in all_paths(cfg):
        assert torch.allclose(grid.path_model(path)(tokens), expected, atol=1e-6)


def _docs(n: int) -> list[str]:
    return [f"document {i}: " + ("abc " if i % 2 else "xyz ") * 40 for i in range(n)]


def test_outer_sync_with_plain_averaging_gives_the_token_weighted_mean():
    # Outer SGD with lr 1 and no momentum makes θ̄ the (token-weighted) mean of the holders' copies.
    cfg = SimConfig(
        model=ModelConfig(**SMALL),
        seq_len=16,
        batch_size=2,
        inner_steps=3,
        inner=InnerOptimizerConfig(lr=1e-2, warmup_steps=0, total_steps=3),
        outer=OuterOptimizerConfig(lr=1.0, momentum=0.0),
    )
    docs = _docs(8)
    sim = DipacoSim(cfg, {p: docs for p in range(4)}, ByteTokenizer(), 3, progress=False)
    for state in sim.paths.values():
        for _ in range(3):
            state.loop.step()
    sim.paths[0].loop.tokens_since_sync *= 3  # path 0 processed 3x the tokens of the others
    locals_before = {
        i: {k: v.clone() for k, v in s.loop.model.state_dict().items()} for i, s in sim.paths.items()
    }
    sim.outer_sync()
    grid = sim.grid()
    # l0m0 is held by paths 0 = (0,0) and 1 = (0,1), with weights 3/4 and 1/4.
    for name, p in grid.grid["l0m0"].named_parameters():
        key = f"parts.l0m0.{name}"
        mean = 0.75 * locals_before[0][key] + 0.25 * locals_before[1][key]
        assert torch.allclose(p, mean, atol=1e-6)
    # After the sync every holder's local copy equals the global copy.
    for i, state in sim.paths.items():
        for mid in state.loop.model.module_ids:
            for a, b in zip(
                state.loop.model.parts[mid].parameters(), grid.grid[mid].parameters(), strict=True
            ):
                assert torch.equal(a, b), (i, mid)


def _manifest(cfg: ModelConfig) -> RunManifest:
    return RunManifest(name="unit-test", model=cfg, seq_len=32)


def test_export_round_trip_gives_identical_logits(tmp_path):
    cfg = ModelConfig(**SMALL, private_blocks_per_path=1)
    grid = GridModel(cfg, seed=5)
    _randomize(grid)
    out = export_path(grid, 2, tmp_path / "export", _manifest(cfg))
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    loaded = load_exported(out)
    assert loaded.path == path_from_index(cfg, 2)
    assert loaded.export_config["run_id"] == _manifest(cfg).run_id
    tokens = torch.randint(0, 256, (3, 40))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), grid.path_model(loaded.path)(tokens))


def test_generate_is_seeded_and_runs_one_path():
    cfg = ModelConfig(**SMALL)
    grid = GridModel(cfg, seed=2)
    _randomize(grid)
    tok = ByteTokenizer()
    # A real router on prefix features: the prompt is routed like a training document.
    features_model = PathModel(cfg, (0, 0), seed=2)
    docs = [[tok.bos_id, *tok.encode(t)] for t in _docs(40)]
    router = fit_router(prefix_features(features_model, docs), 2, 2, seed=0)
    ran: set[str] = set()
    for mid, module in grid.grid.items():
        for sub in module.modules():  # the trunk is used through embed()/head(), not forward()
            sub.register_forward_hook(lambda *_, mid=mid: ran.add(mid))
    kwargs = dict(max_new_tokens=60, temperature=1.0, top_k=20, feature_model=features_model)
    first = generate(grid, router, tok, "document 3: abc abc", seed=11, **kwargs)
    assert ran == set(path_module_ids(cfg, first.path))
    assert len(first.tokens) > 0
    again = generate(grid, router, tok, "document 3: abc abc", seed=11, **kwargs)
    assert again.tokens == first.tokens and again.text == first.text
    other = generate(grid, router, tok, "document 3: abc abc", seed=12, **kwargs)
    assert other.path == first.path and other.tokens != first.tokens
    # Generating past max_seq_len crops the context instead of failing.
    long = generate(grid.path_model(first.path), None, tok, "x" * 100, max_new_tokens=5, temperature=0)
    assert len(long.tokens) <= 5
