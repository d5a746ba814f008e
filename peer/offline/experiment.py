"""One DiPaCo experiment end to end, in process: base model, router, shards, paths, re-routing.

The levers the DESIGN probe found decisive are options here: a warm start of every path from a
briefly trained dense base model (the paper starts from 24k of 88k dense steps), router features
from that trained base rather than from an untrained model, capacity-balanced routing, private
blocks per path (a `ModelConfig` field) and the optional discriminative re-routing phase.

Path-size dense baselines (`DipacoRun.dense_baseline`) get exactly the paths' treatment after the
base: the base model's weights, a fresh AdamW and a fresh warm-up and cosine over their own steps.
Neither side inherits the base's optimizer state or the rest of its schedule, as a peer joining
from a base checkpoint would not, so DiPaCo and the baselines share their first steps exactly and
differ only in what comes after.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from peer.data.batches import encode_document
from peer.model.grid import path_from_index
from peer.model.route import Route, feature_model, prefix_features, route_documents, route_function
from peer.model.router import Router, discriminative_relabel, fit_router
from peer.model.tokenizer import Tokenizer
from peer.model.transformer import GridModel, PathModel
from peer.offline.evaluation import PREFIX_TOKENS, score_documents
from peer.offline.simulate import DenseTrainer, DipacoSim, SimConfig, warm_start_modules
from peer.training.inner import device_of

logger = logging.getLogger(__name__)


class DipacoOptions(BaseModel):
    """The levers of one DiPaCo experiment (warm start, router, balance, re-routing)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: dense steps before the paths split off (0: every module starts from the seeded init)
    warm_start_steps: int = Field(0, ge=0)
    #: "base": prefix features of the trained base model; "init": of the untrained path-0 model, as
    #: `peer.run.rebuild.make_route` (what a swarm run without a base model can rebuild from the seed)
    router_features: Literal["base", "init"] = "base"
    router_kind: Literal["kmeans", "product_kmeans"] = "product_kmeans"
    balanced: bool = True
    router_docs: int = Field(1000, ge=1)
    #: re-route documents by the paths' own losses (DiPaCo's discriminative phase) after this
    #: fraction of the steps; 0 = never
    relabel_at: float = Field(0.0, ge=0.0, lt=1.0)
    relabel_docs: int = Field(400, ge=1)


@dataclass
class DipacoRun:
    """What an experiment produced: the trained grid, its router and shards, and the base run."""

    sim: DipacoSim
    router: Router
    features: PathModel
    shards: dict[int, list[str]]
    #: the dense path-size model after its first `warm_start_steps` (None without a warm start)
    base: PathModel | None
    #: the dense run that trained the base (its step and token counts are the warm start's)
    base_trainer: DenseTrainer
    routers: list[Router]
    train_docs: Sequence[str]

    @property
    def route(self) -> Route:
        return route_function(self.router, self.features)

    def grid(self) -> GridModel:
        return self.sim.grid()

    def dense_baseline(self, steps: int, desc: str = "dense", progress: bool = True) -> DenseTrainer:
        """A path-size dense model set up as every path was after the base: a copy of the base's
        weights (the seeded init without a warm start), a fresh AdamW, a warm-up and cosine over
        `steps`, and all training documents in a batch stream of its own (seeded by `desc`).
        `.train(steps)` trains it."""
        model = copy.deepcopy(self.base) if self.base is not None else None
        cfg, tok = self.sim.cfg, self.sim.tokenizer
        return DenseTrainer(cfg, self.train_docs, tok, steps, model=model, progress=progress, desc=desc)


def shard(documents: Sequence[str], route: Route, tokenizer: Tokenizer, n_paths: int) -> dict[int, list[str]]:
    paths = route_documents(route, [encode_document(tokenizer, t) for t in documents])
    shards: dict[int, list[str]] = {p: [] for p in range(n_paths)}
    for text, p in zip(documents, paths, strict=True):
        shards[p].append(text)
    return shards


def path_losses(sim: DipacoSim, token_lists: list[list[int]], context: int) -> torch.Tensor:
    """(n_docs, n_paths): mean NLL per token of every document under every path's global copy."""
    grid = sim.grid()
    cols = []
    for p in range(sim.cfg.model.n_paths):
        nll, count = score_documents(
            grid.path_model(path_from_index(sim.cfg.model, p)), token_lists, 1, context
        )
        cols.append(nll / count.clamp(min=1))
    return torch.stack(cols, 1)


def run_dipaco(
    cfg: SimConfig,
    train_docs: Sequence[str],
    tokenizer: Tokenizer,
    steps_per_path: int,
    options: DipacoOptions = DipacoOptions(),
    progress: bool = True,
) -> DipacoRun:
    """Trains DiPaCo on `train_docs` for `warm_start_steps` dense steps (the base, on a cosine as
    long as the warm start plus one path's steps), then `steps_per_path` steps on every path, each
    with a fresh AdamW and schedule. `run.dense_baseline(n).train(n)` gives a baseline treated alike."""
    mcfg, o = cfg.model, options
    total = o.warm_start_steps + steps_per_path
    base_trainer = DenseTrainer(cfg, train_docs, tokenizer, total, progress=progress, desc="base")
    base = None
    if o.warm_start_steps:
        base = copy.deepcopy(base_trainer.train(o.warm_start_steps))
    use_base = base is not None and o.router_features == "base"
    features = base if use_base else feature_model(mcfg, cfg.seed).to(device_of(cfg.device))
    router_tokens = [encode_document(tokenizer, t) for t in train_docs[: o.router_docs]]
    feats = prefix_features(features, router_tokens, PREFIX_TOKENS)
    kind = o.router_kind if mcfg.n_levels > 1 else "kmeans"
    router = fit_router(
        feats, mcfg.n_levels, mcfg.modules_per_level, kind=kind, seed=cfg.seed, balanced=o.balanced
    )
    shards = shard(train_docs, route_function(router, features), tokenizer, mcfg.n_paths)
    logger.info("shard sizes %s", {p: len(d) for p, d in shards.items()})
    init = warm_start_modules(mcfg, base) if base is not None else None
    sim = DipacoSim(cfg, shards, tokenizer, steps_per_path, init=init, progress=progress)
    routers = [router]
    if o.relabel_at:
        first = max(cfg.inner_steps, round(steps_per_path * o.relabel_at / cfg.inner_steps) * cfg.inner_steps)
        sim.train(min(first, steps_per_path))
        relabel_tokens = [encode_document(tokenizer, t) for t in train_docs[: o.relabel_docs]]
        losses = path_losses(sim, relabel_tokens, cfg.seq_len)
        relabel_feats = prefix_features(features, relabel_tokens, PREFIX_TOKENS)
        router = discriminative_relabel(router, relabel_feats, losses, seed=cfg.seed, balanced=o.balanced)
        routers.append(router)
        shards = shard(train_docs, route_function(router, features), tokenizer, mcfg.n_paths)
        logger.info("re-routed shard sizes %s", {p: len(d) for p, d in shards.items()})
        sim.reshard(shards)
        sim.train(steps_per_path - min(first, steps_per_path))
    else:
        sim.train(steps_per_path)
    return DipacoRun(sim, router, features, shards, base, base_trainer, routers, train_docs)
