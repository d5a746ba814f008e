"""DiLoCo state of one module on one peer: the global copy, its outer optimizer, its averager.

The global copy θ̄ lives on the CPU in fp32. The outer gradient is Δ = θ̄ − θ_local; after the
holders averaged their Δ, an SGD-Nesterov step on θ̄ gives the new global copy, which is loaded into
the local model. Every holder applies the same averaged Δ to the same θ̄ with the same momentum, so
the copies stay equal; a late joiner therefore downloads θ̄ *and* the momentum.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from peer.averaging import ModuleAverager
from peer.config import OuterOptimizerConfig

logger = logging.getLogger(__name__)


class StateRejected(ValueError):
    """A module state received from another peer failed validation; nothing was loaded."""


class ModuleSync:
    def __init__(self, module_id: str, local: nn.Module, outer: OuterOptimizerConfig, paths_through: int = 1):
        self.module_id = module_id
        self.names = [n for n, _ in local.named_parameters()]
        self.local_params = [p for _, p in local.named_parameters()]
        self.global_params = [
            nn.Parameter(p.detach().float().cpu().clone(), requires_grad=False) for p in self.local_params
        ]
        self.outer = torch.optim.SGD(
            self.global_params,
            lr=outer.lr,
            momentum=outer.momentum,
            nesterov=outer.nesterov and outer.momentum > 0,
        )
        self.delta_scale = math.sqrt(paths_through) if outer.sqrt_paths_scaling else 1.0
        self.averager: ModuleAverager | None = None
        self.outer_round = 0

    @property
    def shapes(self) -> list[torch.Size]:
        return [p.shape for p in self.global_params]

    def numel(self) -> int:
        return sum(p.numel() for p in self.global_params)

    @torch.no_grad()
    def outer_gradient(self) -> list[torch.Tensor]:
        return [
            g - p.detach().float().cpu() for g, p in zip(self.global_params, self.local_params, strict=True)
        ]

    @torch.no_grad()
    def apply(self, delta: list[torch.Tensor]) -> None:
        """Outer step with the (averaged) outer gradient, then local ← θ̄."""
        for g, d in zip(self.global_params, delta, strict=True):
            g.grad = d.to(g.dtype) * self.delta_scale
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self.load_local_from_global()
        self.outer_round += 1

    @torch.no_grad()
    def load_local_from_global(self) -> None:
        for g, p in zip(self.global_params, self.local_params, strict=True):
            p.copy_(g.to(device=p.device, dtype=p.dtype))

    def momentum(self) -> list[torch.Tensor]:
        out = []
        for g in self.global_params:
            buf = self.outer.state.get(g, {}).get("momentum_buffer")
            out.append(buf if buf is not None else torch.zeros_like(g))
        return out

    def state_tensors(self) -> list[torch.Tensor]:
        """What a late joiner downloads: θ̄ then the momentum buffers, in parameter order."""
        return [g.detach() for g in self.global_params] + [m.detach() for m in self.momentum()]

    def state_metadata(self) -> dict:
        return dict(module=self.module_id, outer_round=self.outer_round, n_params=len(self.global_params))

    @torch.no_grad()
    def load_state(self, metadata: object, tensors: list[torch.Tensor], max_abs: float = 1e6) -> None:
        """Loads a downloaded state after checking everything about it; raises StateRejected."""
        if not isinstance(metadata, dict) or metadata.get("module") != self.module_id:
            raise StateRejected(
                f"state for {self.module_id}: metadata names another module ({metadata!r:.80})"
            )
        n = len(self.global_params)
        if len(tensors) != 2 * n:
            raise StateRejected(f"state for {self.module_id}: {len(tensors)} tensors, expected {2 * n}")
        for i, t in enumerate(tensors):
            expected = self.global_params[i % n]
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != expected.shape:
                raise StateRejected(
                    f"state for {self.module_id}: tensor {i} is {getattr(t, 'dtype', type(t))} "
                    f"{tuple(getattr(t, 'shape', ()))}, expected float32 {tuple(expected.shape)}"
                )
            if not torch.isfinite(t).all():
                raise StateRejected(f"state for {self.module_id}: tensor {i} has NaN or inf")
            if t.abs().max() > max_abs:
                raise StateRejected(f"state for {self.module_id}: tensor {i} has values beyond {max_abs:g}")
        for g, t in zip(self.global_params, tensors[:n], strict=True):
            g.copy_(t)
        for g, m in zip(self.global_params, tensors[n:], strict=True):
            self.outer.state[g]["momentum_buffer"] = m.clone()
        self.outer_round = (
            int(metadata.get("outer_round", 0)) if str(metadata.get("outer_round", 0)).isdigit() else 0
        )
        self.load_local_from_global()

    def named_state(self) -> dict[str, torch.Tensor]:
        """For checkpoints."""
        out = {}
        for name, g, m in zip(self.names, self.global_params, self.momentum(), strict=True):
            out[f"{self.module_id}/global/{name}"] = g.detach()
            out[f"{self.module_id}/momentum/{name}"] = m.detach()
        return out

    def load_named_state(self, tensors: dict[str, torch.Tensor], outer_round: int) -> None:
        ordered = [tensors[f"{self.module_id}/global/{n}"] for n in self.names]
        ordered += [tensors[f"{self.module_id}/momentum/{n}"] for n in self.names]
        self.load_state(dict(module=self.module_id, outer_round=outer_round), [t.float() for t in ordered])
