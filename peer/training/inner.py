"""The inner step every trainer shares: the peer, the in-process simulator and the hivemind baseline.

One step is: set the learning rate from the cosine schedule, forward (bf16 autocast on CUDA), refuse a
non-finite loss before it reaches the optimizer, backward, clip, step, zero the gradients. The
optimizer is whatever the caller built (`make_inner_optimizer`, or hivemind's `Optimizer`), so all
three train their models exactly alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch

from peer.config import InnerOptimizerConfig
from peer.model.transformer import PathModel


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf: stopping before the bad values reach the weights."""


def cosine_lr(step: int, warmup: int, total: int) -> float:
    """Factor on the peak inner lr after `step` steps: linear warmup, then cosine down to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def device_of(name: str) -> torch.device:
    """ "auto" (CUDA when there is one), "cpu" or "cuda[:N]"; the config tree already refused CUDA
    names on a machine without CUDA."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_for(device: torch.device) -> AbstractContextManager:
    """bf16 autocast on CUDA; full precision on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


#: Muon's momentum (Keller Jordan's and torch's default); Moonlight's RMS match carries AdamW's lr over
MUON_MOMENTUM = 0.95


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the weight matrices of the model's linear layers, AdamW on every other parameter
    (embeddings, norms, biases): one optimizer to the inner step, which sets every group's lr."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.optimizers = (muon, adamw)
        super().__init__([p for o in self.optimizers for g in o.param_groups for p in g["params"]], {})
        # the two optimizers' groups themselves (dicts), so that a lr set on them reaches both
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def make_inner_optimizer(
    model: torch.nn.Module, inner: InnerOptimizerConfig, kind: str = "adamw"
) -> torch.optim.Optimizer:
    """AdamW with the run's settings; "adamw8bit" is bitsandbytes' 8-bit AdamW (CUDA only). With the
    run's `inner.muon`, Muon takes the linear layers' weight matrices and that AdamW the rest."""
    betas = (inner.beta1, inner.beta2)

    def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if kind == "adamw8bit":
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, lr=inner.lr, betas=betas, weight_decay=inner.weight_decay)
        return torch.optim.AdamW(params, lr=inner.lr, betas=betas, weight_decay=inner.weight_decay)

    if not inner.muon:
        return adamw(list(model.parameters()))
    matrices = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    muon = torch.optim.Muon(
        matrices, lr=inner.lr, weight_decay=inner.weight_decay, momentum=MUON_MOMENTUM,
        nesterov=True, adjust_lr_fn="match_rms_adamw",
    )  # fmt: skip
    return MuonWithAdamW(muon, adamw(rest))


def inner_step(
    model: PathModel,
    optimizer: torch.optim.Optimizer,
    batch: torch.Tensor,
    inner: InnerOptimizerConfig,
    step: int,
    total_steps: int | None = None,
    autocast: AbstractContextManager | None = None,
    lr_groups: Iterable[dict] | None = None,
) -> float:
    """One inner step on `batch` ((batch, seq_len + 1) token ids); `step` counts the steps taken before
    this one and places it on the cosine of `total_steps` (default: the run's `inner.total_steps`).
    `lr_groups` are the parameter groups the schedule sets (default: the optimizer's; hivemind's
    `Optimizer.param_groups` hands out copies, so its caller passes the wrapped optimizer's).
    Returns the loss; raises NonFiniteLoss without touching the weights."""
    for group in optimizer.param_groups if lr_groups is None else lr_groups:
        group["lr"] = inner.lr * cosine_lr(step, inner.warmup_steps, total_steps or inner.total_steps)
    with autocast or nullcontext():
        loss = model.loss(batch)
    if not torch.isfinite(loss):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLoss(f"loss became {loss.item()} at step {step}; stopping before it spreads")
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def tokens_in(batch: torch.Tensor) -> int:
    """Predicted positions in a batch of (seq_len + 1)-token windows."""
    return batch.shape[0] * (batch.shape[1] - 1)
