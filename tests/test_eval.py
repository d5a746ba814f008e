"""Evaluation: routed scoring against a hand computation, sliding windows, grid assembly from
checkpoints, and DiPaCo's claim (composite beats the dense path-size model at equal steps)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from peer.checkpoint import save_checkpoint
from peer.config import InnerOptimizerConfig, RunManifest
from peer.data.batches import encode_document
from peer.data.corpus import generate_documents
from peer.data.sources import split_of
from peer.model.grid import ModelConfig, all_module_ids, path_from_index
from peer.model.tokenizer import ByteTokenizer
from peer.model.transformer import GridModel, PathModel
from peer.offline.evaluation import evaluate, evaluate_rerouted, score_documents, score_windows, windows
from peer.offline.experiment import DipacoOptions, run_dipaco
from peer.offline.grid_checkpoints import assemble_grid
from peer.offline.simulate import SimConfig

SMALL = dict(d_model=32, n_heads=2, d_ff=64, max_seq_len=64)


def _full_nll(model: PathModel, tokens: list[int], skip: int) -> tuple[float, int]:
    """NLL of the targets at positions >= skip, from one forward pass over the whole document."""
    t = torch.tensor([tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(t[:, :-1]).double(), -1)[0]
    picked = logp[torch.arange(len(tokens) - 1), t[0, 1:]]
    return float(-picked[skip - 1 :].sum()), len(tokens) - skip


def test_rerouting_at_evaluation_scores_each_window_with_the_path_its_preceding_tokens_pick():
    tok = ByteTokenizer()
    grid = GridModel(ModelConfig(**SMALL), seed=4)
    # A route that reads a document's first 32 tokens, as the run's router does: a "b" picks path 3.
    b = tok.encode("b")[0]

    def route(token_lists):
        return [3 if b in t[:32] else 0 for t in token_lists]

    # The "b"s start at the first target of a window (position 129; BOS is 0): only a route that
    # peeked at what it scores would send that window to path 3.
    texts = ["a" * 128 + "b" * 112, "a" * 60]
    rerouted = evaluate_rerouted(grid, texts, tok, route, context=64)
    prefix = evaluate(grid, texts, tok, route, context=64)
    assert set(prefix.per_path) == {0} and set(rerouted.per_path) == {0, 3}
    assert rerouted.tokens == prefix.tokens and rerouted.text_bytes == prefix.text_bytes
    # By hand: a window goes to path 3 when the 32 tokens before its first target hold a "b".
    token_lists = [encode_document(tok, t) for t in texts]
    jobs = [(d, w) for d, toks in enumerate(token_lists) for w in windows(len(toks), 32, 64)]
    by_path = {0: [], 3: []}
    for d, (start, first, last) in jobs:
        by_path[3 if b in token_lists[d][first - 32 : first] else 0].append((d, (start, first, last)))
    assert by_path[3] and by_path[0]
    for p, mine in by_path.items():
        nll, count = score_windows(grid.path_model(path_from_index(grid.cfg, p)), token_lists, mine)
        assert rerouted.per_path[p].tokens == int(count.sum())
        assert rerouted.per_path[p].nll == pytest.approx(float(nll.sum()), rel=1e-9)
    assert rerouted.per_path[0].docs == 2 and rerouted.per_path[3].docs == 0


def test_composite_perplexity_matches_a_hand_computation():
    tok = ByteTokenizer()
    grid = GridModel(ModelConfig(**SMALL), seed=4)
    texts = ["alpha beta gamma delta epsilon zeta eta", "x" * 50, "short", "0123456789" * 5]
    assigned = {texts[0]: 0, texts[1]: 3, texts[2]: 3, texts[3]: 0}

    def route(token_lists):
        return [assigned[tok.decode(t)] for t in token_lists]

    result = evaluate(grid, texts, tok, route, context=64)
    total_nll, total_tokens, per_path = 0.0, 0, {}
    for text in texts:
        p = assigned[text]
        tokens = encode_document(tok, text)
        if len(tokens) <= 32:
            nll, n = 0.0, 0  # nothing after the routing prefix to score
        else:
            nll, n = _full_nll(grid.path_model(path_from_index(grid.cfg, p)), tokens, 32)
        total_nll, total_tokens = total_nll + nll, total_tokens + n
        a, b = per_path.get(p, (0.0, 0))
        per_path[p] = (a + nll, b + n)
    assert result.tokens == total_tokens and result.docs == 4
    assert result.ppl == pytest.approx(math.exp(total_nll / total_tokens), rel=1e-6)
    for p, (nll, n) in per_path.items():
        assert result.per_path[p].tokens == n
        assert result.per_path[p].ppl == pytest.approx(math.exp(nll / n), rel=1e-6)
    assert {p: s.docs for p, s in result.per_path.items()} == {0: 2, 3: 2}


def test_sliding_windows_score_every_target_once():
    for n, context in [(10, 4), (200, 64), (65, 64), (66, 64), (33, 64), (20, 64)]:
        scored = [i for _, first, last in windows(n, 32, context) for i in range(first, last + 1)]
        assert scored == list(range(32, n)), (n, context)
        for start, first, last in windows(n, 32, context):
            assert last - start <= context and first > start
    model = PathModel(ModelConfig(**SMALL), (0, 0), seed=1)
    doc = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    nll, count = score_documents(model, [doc], skip=32, context=64)
    assert int(count[0]) == 150 - 32
    # The first window sees the whole history, so its targets match a full forward pass.
    head_nll, _ = score_documents(model, [doc[:65]], skip=32, context=64)
    assert float(head_nll[0]) == pytest.approx(_full_nll(model, doc[:65], 32)[0], rel=1e-6)


def _manifest(cfg: ModelConfig) -> RunManifest:
    return RunManifest(name="unit-test", model=cfg, seq_len=32)


def _save_peer(directory, manifest, grid: GridModel, path, outer_round: int, modules=None):
    modules = modules or grid.path_model(path).module_ids
    tensors = {
        f"{mid}/global/{name}": p.detach().clone()
        for mid in modules
        for name, p in grid.grid[mid].named_parameters()
    }
    meta = dict(step=outer_round * 10, outer_round=outer_round, run_id=manifest.run_id, path=list(path))
    save_checkpoint(directory, tensors, meta)


def test_assemble_grid_takes_the_most_advanced_copy_and_names_missing_modules(tmp_path):
    cfg = ModelConfig(**SMALL)
    manifest = _manifest(cfg)
    old, new = GridModel(cfg, seed=10), GridModel(cfg, seed=20)
    _save_peer(tmp_path / "a", manifest, old, (0, 0), outer_round=3)
    _save_peer(tmp_path / "b", manifest, new, (0, 1), outer_round=5)
    dirs = [tmp_path / "a", tmp_path / "b"]
    with pytest.raises(ValueError, match="l0m1"):
        assemble_grid(manifest, dirs)
    grid = assemble_grid(manifest, dirs, paths=[(0, 0), (0, 1)])
    # trunk and l0m0 are held by a (round 3) and b (round 5): b's copies win.
    for mid, source in [("trunk", new), ("l0m0", new), ("l1m0", old), ("l1m1", new)]:
        for p, q in zip(grid.grid[mid].parameters(), source.grid[mid].parameters(), strict=True):
            assert torch.equal(p, q), mid
    _save_peer(tmp_path / "c", manifest, old, (1, 1), outer_round=4)
    dirs.append(tmp_path / "c")
    full = assemble_grid(manifest, dirs)
    assert set(full.grid.keys()) == set(all_module_ids(cfg))
    assert torch.equal(full.grid["trunk"].tok_emb.weight, new.grid["trunk"].tok_emb.weight)
    assert torch.equal(full.grid["l0m1"].blocks[0].fc.weight, old.grid["l0m1"].blocks[0].fc.weight)
    other_run = RunManifest(name="other-run", model=cfg, seq_len=32)
    with pytest.raises(ValueError, match="not of this manifest's run"):
        assemble_grid(other_run, dirs)
    with pytest.raises(ValueError, match="no valid checkpoint"):
        assemble_grid(manifest, [tmp_path / "empty"])


def test_dipaco_composite_beats_the_dense_path_size_model_at_equal_steps():
    """The DiPaCo claim on the built-in multi-domain corpus, 2x2 grid. Both sides take the same
    number of inner steps of the same batch shape (each path and the dense model), and both start
    alike from the base: its weights, a fresh AdamW and a fresh warm-up and cosine."""
    torch.manual_seed(0)
    tok = ByteTokenizer()
    docs = [d["text"] for d in generate_documents(1000, seed=0)]
    train = [t for t in docs if split_of(t, 0.05) == "train"]
    held_out = [t for t in docs if split_of(t, 0.05) == "eval"]
    cfg = SimConfig(
        model=ModelConfig(**SMALL, n_levels=2, modules_per_level=2),
        seq_len=32,
        batch_size=8,
        inner_steps=25,
        inner=InnerOptimizerConfig(lr=3e-3, warmup_steps=20, total_steps=1000),
    )
    steps = 150
    run = run_dipaco(
        cfg, train, tok, steps, DipacoOptions(warm_start_steps=50, router_docs=400), progress=False
    )
    baseline_trainer = run.dense_baseline(steps, progress=False)
    start = baseline_trainer.model.state_dict()
    assert all(torch.equal(v, start[k]) for k, v in run.base.state_dict().items())
    assert not baseline_trainer.loop.opt.state  # the base's AdamW moments are not carried over
    dense = baseline_trainer.train(steps)
    assert run.base_trainer.loop.step_count == 50
    assert baseline_trainer.loop.step_count == steps
    assert all(s.loop.step_count == steps for s in run.sim.paths.values())
    batch_sizes = {s.loop.batches.batch_size for s in run.sim.paths.values()}
    assert batch_sizes == {baseline_trainer.loop.batches.batch_size}
    dipaco = evaluate(run.grid(), held_out, tok, run.route, context=cfg.seq_len)
    baseline = evaluate(dense, held_out, tok, run.route, context=cfg.seq_len)
    assert dipaco.tokens == baseline.tokens > 10_000
    assert dipaco.ppl < 0.95 * baseline.ppl, (dipaco.ppl, baseline.ppl)


def test_dipaco_benchmark_reports_three_baselines_at_their_stated_budgets(tmp_path):
    """A tiny run of `python -m benchmarks.dipaco`: every key the README quotes is written, and each
    baseline took the batch-steps and tokens its docstring states (same tokens: the grid's warm
    start + n_paths x steps_per_path, the base counted once; all params: as many parameters as the
    grid, from scratch)."""
    from benchmarks import dipaco

    warm, per_path = 6, 10
    argv = f"--out {tmp_path} --builtin_docs 400 --steps_per_path {per_path} --warm_start_steps {warm}"
    argv += " --d_model 32 --seq_len 32 --batch_size 4 --inner_steps 5 --max_eval_docs 20"
    argv += " --budgets 1 --seeds 1 --device cpu"
    assert dipaco.main(argv.split()) == 0
    r = json.loads((tmp_path / "dipaco.json").read_text())
    for key in ("composite_ppl", "dense_ppl", "dense_same_tokens_ppl", "dense_all_params_ppl"):
        assert math.isfinite(r[key]) and r[key] > 1
    assert r["ratio"] == r["composite_ppl"] / r["dense_ppl"]
    assert r["ratio_same_tokens"] == r["composite_ppl"] / r["dense_same_tokens_ppl"]
    assert r["ratio_all_params"] == r["composite_ppl"] / r["dense_all_params_ppl"]
    models, tokens_per_step = r["models"], 4 * 32
    grid, same = models["dipaco 2x2"], models["dense same tokens"]
    assert (grid["steps"], grid["base_steps"], grid["steps_after_base"]) == (
        warm + 4 * per_path,
        warm,
        4 * per_path,
    )
    assert (same["steps"], same["base_steps"], same["steps_after_base"]) == (
        warm + 4 * per_path,
        warm,
        4 * per_path,
    )
    assert same["tokens"] == grid["tokens"] == (warm + 4 * per_path) * tokens_per_step
    assert (models["dense"]["steps"], models["dense"]["tokens"]) == (
        warm + per_path,
        (warm + per_path) * tokens_per_step,
    )
    everything = models["dense all params"]
    assert (everything["base_steps"], everything["steps"]) == (0, warm + 4 * per_path)
    assert everything["params"] == r["dense_all_params_params"] == r["grid_params"] == grid["params"]
    assert same["params"] == r["path_params"] == grid["params_per_path"] < r["grid_params"]
    table = (tmp_path / "dipaco.md").read_text()
    assert "dense same tokens" in table and "dense all params" in table
    assert (tmp_path / "dipaco.png").stat().st_size > 10_000
