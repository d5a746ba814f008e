"""The DiPaCo router: prefix features, (product) k-means with balancing, JSON, cross-process agreement."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from peer.data.batches import encode_document, shard_documents
from peer.data.corpus import generate_documents
from peer.model.grid import ModelConfig, all_paths, path_index
from peer.model.route import prefix_features, route_function
from peer.model.router import Router, balance_bias, discriminative_relabel, fit_router, rebalance, share_ratio
from peer.model.tokenizer import ByteTokenizer
from peer.model.transformer import PathModel

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig()  # tiny: 2x2 grid, d_model 64, byte vocabulary


@cache
def builtin_features(n_docs: int = 2000) -> torch.Tensor:
    tok = ByteTokenizer()
    model = PathModel(CFG, (0, 0), seed=0)
    return prefix_features(model, [encode_document(tok, d["text"]) for d in generate_documents(n_docs, 0)])


ROUTE_SCRIPT = """
import json
from peer.data.corpus import generate_documents
from peer.data.batches import encode_document
from peer.model.grid import ModelConfig
from peer.model.transformer import PathModel
from peer.model.route import prefix_features
from peer.model.router import fit_router
from peer.model.tokenizer import ByteTokenizer

tok = ByteTokenizer()
model = PathModel(ModelConfig(), (0, 0), seed=0)
feats = prefix_features(model, [encode_document(tok, d["text"]) for d in generate_documents(600, 5)])
router = fit_router(feats[:400], 2, 2, seed=11)
print(json.dumps({"fingerprint": router.fingerprint, "paths": router.route(feats).tolist()}))
"""


def test_prefix_features_ignore_padding_and_suffix():
    model = PathModel(CFG, (1, 0), seed=0)
    short, long = [256, 10, 20, 30], [256, *range(40, 140)]
    feats = prefix_features(model, [short, long], prefix_tokens=32)
    assert feats.shape == (2, CFG.d_model) and feats.dtype == torch.float32
    alone = prefix_features(model, [short])
    assert torch.allclose(feats[0], alone[0], atol=1e-5)  # padding next to a longer doc changes nothing
    # Only the first prefix_tokens tokens count.
    assert torch.allclose(feats[1], prefix_features(model, [long[:32] + [7] * 50])[0], atol=1e-5)
    with torch.no_grad():
        manual = model.hidden(torch.tensor([long[:32]])).mean(1)[0]
    assert torch.allclose(feats[1], manual, atol=1e-5)
    assert model.training  # mode restored


def test_balanced_kmeans_on_builtin_corpus():
    feats = builtin_features()
    train, held = feats[:1500], feats[1500:]
    for kind in ("product_kmeans", "kmeans"):
        router = fit_router(train, CFG.n_levels, CFG.modules_per_level, kind=kind, seed=0)
        for part in (train, held):
            share = torch.bincount(router.route(part), minlength=CFG.n_paths).double() / len(part)
            assert (share - 1 / CFG.n_paths).abs().max() <= 0.2 / CFG.n_paths, (kind, share.tolist())
    # Unbalanced k-means is visibly lopsided on the same features, which is why balancing exists.
    plain = fit_router(train, CFG.n_levels, CFG.modules_per_level, kind="kmeans", seed=0, balanced=False)
    share = torch.bincount(plain.route(train), minlength=CFG.n_paths).double() / len(train)
    assert share.max() > 1.3 / CFG.n_paths


def test_routing_groups_domains():
    # Documents of one domain share their first bytes, so routing should mostly keep them together.
    feats = builtin_features()
    domains = [d["domain"] for d in generate_documents(2000, 0)]
    paths = fit_router(feats, 2, 2, seed=0).route(feats).tolist()
    for dom in set(domains):
        counts = torch.bincount(torch.tensor([p for p, d in zip(paths, domains, strict=True) if d == dom]))
        assert counts.max() / counts.sum() >= 0.4, (dom, counts.tolist())


def test_router_json_round_trip():
    feats = builtin_features()
    for kind in ("product_kmeans", "kmeans"):
        router = fit_router(feats[:500], 2, 2, kind=kind, seed=3)
        text = router.to_json()
        again = Router.from_json(text)
        assert again == router and again.fingerprint == router.fingerprint and again.to_json() == text
        assert torch.equal(again.route(feats), router.route(feats))
        json.loads(text)  # plain JSON
    other = fit_router(feats[:500], 2, 2, seed=4)
    assert other.fingerprint != fit_router(feats[:500], 2, 2, seed=3).fingerprint


def test_router_rejects_bad_shapes():
    router = fit_router(builtin_features()[:300], 2, 2, seed=0)
    data = json.loads(router.to_json())
    with pytest.raises(ValueError, match="one per path"):
        Router.model_validate({**data, "bias": [0.0]})
    with pytest.raises(ValueError, match="centroid set"):
        Router.model_validate({**data, "centroids": data["centroids"][:1]})
    with pytest.raises(ValueError, match="version"):
        Router.model_validate({**data, "version": 99})
    with pytest.raises(ValueError, match="features of shape"):
        router.route(torch.zeros(3, 5))


def test_product_kmeans_indices_and_radix():
    feats = builtin_features()[:800]
    cfg = ModelConfig(n_levels=2, modules_per_level=3)
    router = fit_router(feats, cfg.n_levels, cfg.modules_per_level, kind="product_kmeans", seed=1)
    paths = router.route(feats)
    assert paths.dtype == torch.long and int(paths.min()) >= 0 and int(paths.max()) < cfg.n_paths
    assert len(set(paths.tolist())) == cfg.n_paths

    # Without balancing, the path is the mixed-radix number of the per-level nearest centroids.
    plain = fit_router(
        feats, cfg.n_levels, cfg.modules_per_level, kind="product_kmeans", seed=1, balanced=False
    )
    z = plain._standardize(feats)
    digits = []
    for (lo, hi), cs in zip(plain.level_dims, plain.centroids, strict=True):
        diff = z[:, lo:hi, None] - torch.tensor(cs, dtype=torch.float64).t()[None]
        digits.append((diff**2).sum(1).argmin(1))
    expected = [path_index(cfg, tuple(int(d[i]) for d in digits)) for i in range(len(feats))]
    assert plain.route(feats).tolist() == expected
    assert sorted({path_index(cfg, p) for p in all_paths(cfg)}) == list(range(cfg.n_paths))


@pytest.mark.swarm
def test_routing_identical_across_processes():
    outs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", ROUTE_SCRIPT],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
                timeout=90,
            ).stdout
        )
        for _ in range(2)
    ]
    assert outs[0] == outs[1]
    # And the same as in this process.
    tok = ByteTokenizer()
    model = PathModel(CFG, (0, 0), seed=0)
    feats = prefix_features(model, [encode_document(tok, d["text"]) for d in generate_documents(600, 5)])
    router = fit_router(feats[:400], 2, 2, seed=11)
    assert router.route(feats).tolist() == outs[0]["paths"] and router.fingerprint == outs[0]["fingerprint"]


def test_router_as_data_route_function():
    # The router plugs into data.shard_documents as a token-lists -> path-indices function.
    tok = ByteTokenizer()
    model = PathModel(CFG, (0, 0), seed=0)
    texts = [d["text"] for d in generate_documents(400, 0)]
    router = fit_router(builtin_features()[:400], 2, 2, seed=0)
    shards = shard_documents(texts, route_function(router, model), tok)
    assert sorted(i for ids in shards.values() for i in ids) == list(range(400))
    assert set(shards) == set(range(CFG.n_paths))
    # Routing the tokens directly matches routing the precomputed features of the same documents.
    paths = router.route(builtin_features()[:400]).tolist()
    assert all(paths[i] == p for p, ids in shards.items() for i in ids)


def test_balance_bias_handles_skew():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(4000, 8, generator=gen, dtype=torch.float64)
    scores[:, 0] += 3.0  # nearly everything prefers column 0
    bias = balance_bias(scores, tolerance=0.05)
    share = torch.bincount((scores + bias).argmax(1), minlength=8).double() * 8 / 4000
    assert (share - 1).abs().max() <= 0.05


def test_discriminative_relabel():
    feats = builtin_features()[:600]
    router = fit_router(feats, 2, 2, seed=0)
    # Synthetic losses: each document is best served by the path the k-means router already picks,
    # except that path 3 is poor for everyone; the classifier should follow, balanced.
    base = router.route(feats)
    losses = torch.full((600, 4), 2.0)
    losses[torch.arange(600), base] = 1.0
    linear = discriminative_relabel(router, feats, losses, seed=0, steps=100)
    assert linear.kind == "linear" and len(linear.weights) == 4
    routed = linear.route(feats)
    assert (routed == base).double().mean() > 0.8
    share = torch.bincount(routed, minlength=4).double() / 600
    assert (share - 0.25).abs().max() <= 0.05
    assert torch.equal(Router.from_json(linear.to_json()).route(feats), routed)
    with pytest.raises(ValueError, match="path_losses"):
        discriminative_relabel(router, feats, losses[:, :3])


def test_a_router_rebalanced_on_held_out_documents_keeps_both_sets_within_1_5x():
    feats = builtin_features()
    router = fit_router(feats[:1000], CFG.n_levels, CFG.modules_per_level, seed=0)
    # held-out documents that lean towards one path: balanced on the training ones alone, that path
    # takes about twice its share of them
    held = feats[1000:]
    lean = torch.bincount(router.route(held), minlength=4).argmax()
    held = torch.cat([held[:180], held[180:][router.route(held[180:]) == lean][:40]])
    assert share_ratio(router, held) > 1.8
    balanced = rebalance(router, [feats[:1000], held])
    assert share_ratio(balanced, held) <= 1.5 and share_ratio(balanced, feats[:1000]) <= 1.5
