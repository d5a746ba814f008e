"""Evaluation of a DiPaCo model as the paper does it.

Each held-out document is routed by its first 32 tokens with the run's router and scored by that one
path on the tokens after those 32 (the router saw them, so scoring them would flatter the routed
path). Long documents are scored with a sliding window of the training context: every target token
is scored exactly once, and all but the first window give it at least half a context of history.
Perplexity is exp(total NLL / total scored tokens) over all documents, so long documents weigh by
their length; per path the same sums are kept for the documents routed there. Perplexity is per
token: with the byte tokenizer a token is a byte (and each document's end-of-text token). Bits per
byte, total NLL in bits over the UTF-8 bytes of the scored text, compares runs whatever their
tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from peer.data.batches import encode_document
from peer.model.grid import path_from_index
from peer.model.route import Route, route_documents
from peer.model.tokenizer import ByteTokenizer, Tokenizer
from peer.model.transformer import GridModel, PathModel

#: tokens the router reads: never scored (DiPaCo scores what follows them)
PREFIX_TOKENS = 32


@dataclass
class PathStats:
    """Summed NLL and scored tokens of the documents routed to one path."""

    docs: int = 0
    tokens: int = 0
    nll: float = 0.0
    #: UTF-8 bytes of the scored text (special tokens have none)
    text_bytes: int = 0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    @property
    def bits_per_byte(self) -> float:
        return self.nll / math.log(2) / self.text_bytes if self.text_bytes else float("nan")


@dataclass
class EvalResult:
    """Composite sums over all documents, and the same sums per path the documents were routed to."""

    per_path: dict[int, PathStats] = field(default_factory=dict)

    @property
    def docs(self) -> int:
        return sum(s.docs for s in self.per_path.values())

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.per_path.values())

    @property
    def nll(self) -> float:
        return sum(s.nll for s in self.per_path.values())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    @property
    def bits_per_byte(self) -> float:
        return PathStats(self.docs, self.tokens, self.nll, self.text_bytes).bits_per_byte

    @property
    def text_bytes(self) -> int:
        return sum(s.text_bytes for s in self.per_path.values())

    def to_dict(self) -> dict[str, Any]:
        return dict(
            ppl=self.ppl,
            bits_per_byte=self.bits_per_byte,
            docs=self.docs,
            tokens=self.tokens,
            text_bytes=self.text_bytes,
            per_path={
                str(p): dict(docs=s.docs, tokens=s.tokens, ppl=s.ppl, bits_per_byte=s.bits_per_byte)
                for p, s in sorted(self.per_path.items())
            },
        )


def windows(n_tokens: int, skip: int, context: int) -> list[tuple[int, int, int]]:
    """(start, first, last): the model reads tokens[start : start + context] and the targets at document
    positions first..last (inclusive) are scored. Positions below `skip` are never scored."""
    if context < 2:
        raise ValueError(f"context must be >= 2, got {context}")
    stride = max(1, context // 2)
    out, done = [], max(skip, 1) - 1  # every position <= done is scored or excluded
    start = max(0, done + 1 - context)
    while done < n_tokens - 1:
        last = min(start + context, n_tokens - 1)
        if last > done:
            out.append((start, done + 1, last))
            done = last
        start += stride
    return out


Job = tuple[int, tuple[int, int, int]]
"""(document index, window (start, first, last) as `windows` makes them)."""


@torch.no_grad()
def score_windows(
    model: PathModel, token_lists: Sequence[Sequence[int]], jobs: Sequence[Job], batch_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(nll sums float64, scored token counts int64), one entry per job."""
    nll = torch.zeros(len(jobs), dtype=torch.float64)
    count = torch.zeros(len(jobs), dtype=torch.int64)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for lo in range(0, len(jobs), batch_size):
            batch = jobs[lo : lo + batch_size]
            width = max(last - start for _, (start, _, last) in batch)
            inputs = torch.zeros(len(batch), width, dtype=torch.long)
            targets = torch.full((len(batch), width), -100, dtype=torch.long)
            for row, (d, (start, first, last)) in enumerate(batch):
                toks = torch.as_tensor(token_lists[d][start : last + 1], dtype=torch.long)
                inputs[row, : len(toks) - 1] = toks[:-1]
                # Target j of the window is document position start + j + 1.
                targets[row, first - start - 1 : last - start] = toks[first - start :]
            # Causal attention: right padding does not change the logits of real positions.
            logits = model(inputs.to(device)).float()
            losses = F.cross_entropy(
                logits.transpose(1, 2), targets.to(device), ignore_index=-100, reduction="none"
            )
            nll[lo : lo + len(batch)] = losses.double().sum(1).cpu()
            count[lo : lo + len(batch)] = (targets != -100).sum(1)
    finally:
        model.train(was_training)
    return nll, count


def score_documents(
    model: PathModel,
    token_lists: Sequence[Sequence[int]],
    skip: int = PREFIX_TOKENS,
    context: int | None = None,
    batch_size: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(nll sums float64, scored token counts int64), one entry per document."""
    context = min(context or model.cfg.max_seq_len, model.cfg.max_seq_len)
    jobs = [(d, w) for d, toks in enumerate(token_lists) for w in windows(len(toks), skip, context)]
    per_job_nll, per_job_count = score_windows(model, token_lists, jobs, batch_size)
    rows = torch.tensor([d for d, _ in jobs], dtype=torch.long)
    nll = torch.zeros(len(token_lists), dtype=torch.float64).index_add_(0, rows, per_job_nll)
    count = torch.zeros(len(token_lists), dtype=torch.int64).index_add_(0, rows, per_job_count)
    return nll, count


def evaluate(
    models: GridModel | Mapping[int, PathModel] | PathModel,
    documents: Iterable[str],
    tokenizer: Tokenizer,
    route: Route | None = None,
    *,
    context: int | None = None,
    skip: int = PREFIX_TOKENS,
    batch_size: int = 32,
    routed: Sequence[int] | None = None,
) -> EvalResult:
    """Routes every document with `route` and scores it with its path. `models` is the grid, a map
    path index -> model, or one dense `PathModel` that scores every document; with a dense model a
    `route` only splits the result by path (for side-by-side tables). `context` should be the run's
    seq_len: positions past the training window were never trained. `routed` gives the documents'
    paths when the caller already routed them with `route`."""
    token_lists = [encode_document(tokenizer, t) for t in documents]
    if route is None:
        if not isinstance(models, PathModel):
            raise ValueError("a grid needs a route function to evaluate")
        paths = [0] * len(token_lists)
    elif routed is not None:
        if len(routed) != len(token_lists):
            raise ValueError(f"{len(routed)} routed paths for {len(token_lists)} documents")
        paths = list(routed)
    else:
        paths = route_documents(route, token_lists)
    result = EvalResult()
    for p in sorted(set(paths)):
        if isinstance(models, PathModel):
            model = models
        elif isinstance(models, GridModel):
            model = models.path_model(path_from_index(models.cfg, p))
        elif p in models:
            model = models[p]
        else:
            raise ValueError(f"documents are routed to path {p}, which has no model")
        docs = [t for t, q in zip(token_lists, paths, strict=True) if q == p]
        nll, count = score_documents(model, docs, skip, context, batch_size)
        text_bytes = sum(scored_bytes(tokenizer, d[max(skip, 1) :]) for d in docs)
        result.per_path[p] = PathStats(len(docs), int(count.sum()), float(nll.sum()), text_bytes)
    return result


def scored_bytes(tokenizer: Tokenizer, ids: Sequence[int]) -> int:
    """UTF-8 bytes of the text the scored ids spell."""
    if isinstance(tokenizer, ByteTokenizer):
        return sum(1 for i in ids if 0 <= i < 256)  # exact, even where a window cuts a character
    return len(tokenizer.decode(list(ids)).encode("utf-8"))


def evaluate_rerouted(
    grid: GridModel,
    documents: Iterable[str],
    tokenizer: Tokenizer,
    route: Route,
    *,
    context: int | None = None,
    skip: int = PREFIX_TOKENS,
    batch_size: int = 32,
) -> EvalResult:
    """Finer-grained routing at evaluation (DiPaCo's re-routing every few tokens at test time): every
    scoring window of a document (`windows`) goes to the path that `route` picks from the `skip`
    tokens just before the window's first scored one, tokens already read and never scored by that
    window. The first window's choice is `evaluate`'s (the document's first `skip` tokens), so the two
    differ only on documents longer than one window. Sums are kept per path the windows went to; a
    document counts under the path of its first window."""
    context = min(context or grid.cfg.max_seq_len, grid.cfg.max_seq_len)
    token_lists = [encode_document(tokenizer, t) for t in documents]
    jobs = [(d, w) for d, toks in enumerate(token_lists) for w in windows(len(toks), skip, context)]
    keys = [list(token_lists[d][max(0, first - skip) : first]) for d, (_, first, _) in jobs]
    paths = route_documents(route, keys)
    first_path = {}
    for (d, _), p in zip(jobs, paths, strict=True):
        first_path.setdefault(d, p)
    result = EvalResult()
    for p in sorted(set(paths)):
        mine = [j for j, q in zip(jobs, paths, strict=True) if q == p]
        nll, count = score_windows(
            grid.path_model(path_from_index(grid.cfg, p)), token_lists, mine, batch_size
        )
        text_bytes = sum(
            scored_bytes(tokenizer, token_lists[d][first : last + 1]) for d, (_, first, last) in mine
        )
        docs = sum(1 for q in first_path.values() if q == p)
        result.per_path[p] = PathStats(docs, int(count.sum()), float(nll.sum()), text_bytes)
    return result
