"""How a document becomes a path: prefix features of a feature model, scored by the run's Router.

A document (BOS + tokens + EOS, as `peer.data.batches.encode_document` makes it) is described by the
mean hidden state of a fixed feature model over its first `prefix_tokens` tokens; the `Router`
(`peer.model.router`) turns that into a path index. A `Route` is the whole function, token ids of
documents -> one path index each, and every place that routes (data shards, evaluation, generation,
the simulator) takes one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from peer.model.base import ModuleStates, base_model
from peer.model.grid import ModelConfig
from peer.model.router import Router
from peer.model.transformer import PathModel

Route = Callable[[list[list[int]]], list[int]]
"""Token ids of documents (as made by `encode_document`) -> one path index per document."""

#: documents routed per call: bounds the memory of one batch of prefix features
ROUTE_CHUNK = 256


@torch.no_grad()
def prefix_features(
    model: PathModel, token_lists: list[list[int]], prefix_tokens: int = 32, batch_size: int = 64
) -> torch.Tensor:
    """(n_docs, d_model) float32: the mean of `model.hidden` over each document's first tokens."""
    n = min(prefix_tokens, model.cfg.max_seq_len)
    if n < 1:
        raise ValueError(f"prefix_tokens must be >= 1, got {prefix_tokens}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        for start in range(0, len(token_lists), batch_size):
            prefixes = [list(t[:n]) for t in token_lists[start : start + batch_size]]
            width = max(1, max(len(p) for p in prefixes))
            # Attention is causal, so right padding cannot change the hidden states of real tokens.
            tokens = torch.zeros(len(prefixes), width, dtype=torch.long)
            mask = torch.zeros(len(prefixes), width, dtype=torch.float32)
            for i, p in enumerate(prefixes):
                tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
                mask[i, : len(p)] = 1.0
            hidden = model.hidden(tokens.to(device)).float().cpu()
            summed = (hidden * mask[:, :, None]).sum(1)
            out.append(summed / mask.sum(1, keepdim=True).clamp(min=1.0))
    finally:
        model.train(was_training)
    if not out:
        return torch.zeros(0, model.cfg.d_model, dtype=torch.float32)
    return torch.cat(out)


def feature_model(cfg: ModelConfig, seed: int, base: ModuleStates | None = None) -> PathModel:
    """Path 0 of a run as it starts: the run's base model when it has one (DiPaCo routes with the
    base's features), else the untrained model, whose weights follow from the run seed alone. Either
    way every peer rebuilds the identical feature extractor."""
    model = base_model(cfg, base) if base is not None else PathModel(cfg, (0,) * cfg.n_levels, seed=seed)
    model.eval()
    return model


def route_function(router: Router, model: PathModel) -> Route:
    """The `Route` of a router over the prefix features of `model`."""

    def route(token_lists: list[list[int]]) -> list[int]:
        return router.route(prefix_features(model, token_lists, router.prefix_tokens)).tolist()

    return route


def route_documents(route: Route, token_lists: list[list[int]], chunk: int = ROUTE_CHUNK) -> list[int]:
    """`route` over many documents, `chunk` at a time, checking that it answers once per document."""
    out: list[int] = []
    for lo in range(0, len(token_lists), chunk):
        part = [int(p) for p in route(token_lists[lo : lo + chunk])]
        if len(part) != len(token_lists[lo : lo + chunk]):
            raise ValueError(
                f"the route returned {len(part)} paths for {len(token_lists[lo : lo + chunk])} documents"
            )
        out += part
    return out
