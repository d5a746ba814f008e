"""Creating a run (fitting its router, filling its manifest) and rebuilding what a manifest implies.

The router's features come from the run's *initial* path-0 model: its weights follow from the run
seed alone, so every peer rebuilds the identical feature extractor from the manifest and routes
every document to the same path without downloading anything.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from itertools import islice

import torch

from peer.config import InnerOptimizerConfig, OuterOptimizerConfig, RunManifest, SyncConfig
from peer.data import DatasetSpec, encode_document, load_documents, split_of
from peer.model import ModelConfig, PathModel
from peer.routing import Router, fit_router, prefix_features
from peer.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

Route = Callable[[list[list[int]]], list[int]]


def feature_model(manifest_model: ModelConfig, seed: int) -> PathModel:
    model = PathModel(manifest_model, (0,) * manifest_model.n_levels, seed=seed)
    model.eval()
    return model


def build_manifest(
    name: str,
    model: ModelConfig,
    dataset: DatasetSpec,
    *,
    seed: int = 0,
    seq_len: int = 64,
    inner_steps: int = 50,
    inner: InnerOptimizerConfig | None = None,
    outer: OuterOptimizerConfig | None = None,
    sync: SyncConfig | None = None,
    tokenizer: str = "bytes",
    router_docs: int = 1000,
    router_kind: str = "product_kmeans",
) -> RunManifest:
    """Fits the router on up to `router_docs` training documents and returns the full manifest."""
    tok = load_tokenizer(tokenizer)
    if tok.vocab_size > model.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens but model.vocab_size is {model.vocab_size}")
    docs = [d for d in islice(load_documents(dataset), router_docs * 2) if split_of(d, dataset) == "train"]
    docs = docs[:router_docs]
    if len(docs) < model.n_paths * 4:
        raise ValueError(f"only {len(docs)} training documents to fit a router for {model.n_paths} paths")
    started = time.monotonic()
    features = prefix_features(feature_model(model, seed), [encode_document(tok, d) for d in docs])
    kind = router_kind if model.n_levels > 1 else "kmeans"
    router = fit_router(features, model.n_levels, model.modules_per_level, kind=kind, seed=seed)
    logger.info(f"fitted a {kind} router on {len(docs)} documents in {time.monotonic() - started:.1f}s")
    return RunManifest(
        name=name,
        seed=seed,
        model=model,
        seq_len=seq_len,
        inner_steps=inner_steps,
        inner=inner or InnerOptimizerConfig(),
        outer=outer or OuterOptimizerConfig(),
        sync=sync or SyncConfig(),
        dataset=dataset,
        tokenizer=tokenizer,
        tokenizer_fingerprint=tok.fingerprint,
        router=json.loads(router.to_json()),
        created_at=time.time(),
    )


def router_of(manifest: RunManifest) -> Router:
    return Router.from_json(json.dumps(manifest.router))


def make_route(manifest: RunManifest) -> Route:
    """The routing function every peer of the run shares."""
    router = router_of(manifest)
    model = feature_model(manifest.model, manifest.seed)

    def route(token_lists: list[list[int]]) -> list[int]:
        return router.route(prefix_features(model, token_lists, router.prefix_tokens)).tolist()

    return route


def check_tokenizer(manifest: RunManifest):
    tok = load_tokenizer(manifest.tokenizer)
    if manifest.tokenizer_fingerprint and tok.fingerprint != manifest.tokenizer_fingerprint:
        raise ValueError(f"tokenizer {manifest.tokenizer!r} differs from the one the run was created with")
    return tok


def device_of(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return torch.device(name)
