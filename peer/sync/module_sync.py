"""DiLoCo state of one module on one peer: global copy, outer optimizers, averager, per fragment.

The global copy θ̄ lives on the CPU in fp32, as one flat vector per fragment (peer/sync/fragments.py) with
its own SGD-Nesterov outer optimizer. A fragment's outer gradient is Δ = θ̄ − θ_local. After the
holders averaged their Δ, the outer step gives θ̃ and the local fragment is merged:
θ_local ← α·θ_local + (1−α)·θ̃ when the sync overlapped τ > 0 inner steps (Streaming DiLoCo), or
replaced by θ̃ when τ = 0 (DiLoCo: no local steps happened meanwhile). Every holder applies the same
averaged Δ to the same θ̄ with the same momentum, so the copies stay equal; a late joiner therefore
downloads θ̄ *and* the momentum.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from peer.config import OuterOptimizerConfig
from peer.model.grid import ModelConfig
from peer.sync.averager import ModuleAverager
from peer.sync.fragments import FragmentPlan

logger = logging.getLogger(__name__)


class StateRejected(ValueError):
    """A module state received from another peer failed validation; nothing was loaded."""


class ModuleSync:
    """θ̄ of one module per fragment, its outer optimizers, its fragment rounds and its averager."""

    def __init__(
        self,
        cfg: ModelConfig,
        module_id: str,
        local: nn.Module,
        outer: OuterOptimizerConfig,
        n_fragments: int = 1,
        paths_through: int = 1,
    ):
        self.module_id = module_id
        named = list(local.named_parameters())
        self.names = [n for n, _ in named]
        self.local_params = [p for _, p in named]
        self.plan = FragmentPlan(
            cfg, module_id, self.names, [p.shape for p in self.local_params], n_fragments
        )
        self.global_flats = [
            nn.Parameter(self.plan.gather(self.local_params, f), requires_grad=False)
            for f in range(n_fragments)
        ]
        nesterov = outer.nesterov and outer.momentum > 0
        self.outers = [
            torch.optim.SGD([g], lr=outer.lr, momentum=outer.momentum, nesterov=nesterov)
            for g in self.global_flats
        ]
        self.delta_scale = math.sqrt(paths_through) if outer.sqrt_paths_scaling else 1.0
        self.fragment_rounds = [0] * n_fragments
        self.averager: ModuleAverager | None = None

    @property
    def n_fragments(self) -> int:
        return self.plan.n_fragments

    @property
    def outer_round(self) -> int:
        """Completed syncs of fragment 0 (the one that syncs at H, 2H, ...)."""
        return self.fragment_rounds[0]

    def fragment_size(self, fragment: int) -> int:
        return self.global_flats[fragment].numel()

    @torch.no_grad()
    def outer_gradient(self, fragment: int) -> torch.Tensor:
        return self.global_flats[fragment].detach() - self.plan.gather(self.local_params, fragment)

    @torch.no_grad()
    def apply(self, fragment: int, delta: torch.Tensor, alpha: float | None = None) -> None:
        """Outer step on θ̄ of the fragment with the (averaged) Δ, then merge into the local model:
        replace when `alpha` is None, else θ_local ← α·θ_local + (1−α)·θ̃."""
        g = self.global_flats[fragment]
        g.grad = delta.to(g.dtype).reshape(g.shape) * self.delta_scale
        self.outers[fragment].step()
        self.outers[fragment].zero_grad(set_to_none=True)
        if alpha is None:
            self.plan.scatter(g, self.local_params, fragment)
        else:
            local = self.plan.gather(self.local_params, fragment)
            self.plan.scatter(alpha * local + (1 - alpha) * g, self.local_params, fragment)
        self.fragment_rounds[fragment] += 1

    @torch.no_grad()
    def load_local_from_global(self) -> None:
        for f, g in enumerate(self.global_flats):
            self.plan.scatter(g, self.local_params, f)

    def momentum(self, fragment: int) -> torch.Tensor:
        g = self.global_flats[fragment]
        buf = self.outers[fragment].state.get(g, {}).get("momentum_buffer")
        return buf if buf is not None else torch.zeros_like(g)

    def state_tensors(self) -> list[torch.Tensor]:
        """What a joiner downloads: θ̄ of every fragment, then their momentum buffers."""
        return [g.detach() for g in self.global_flats] + [self.momentum(f) for f in range(self.n_fragments)]

    def state_metadata(self) -> dict:
        return dict(
            module=self.module_id,
            outer_round=self.outer_round,
            fragment_rounds=list(self.fragment_rounds),
            n_fragments=self.n_fragments,
        )

    @torch.no_grad()
    def load_state(self, metadata: object, tensors: list[torch.Tensor], max_abs: float = 1e6) -> None:
        """Loads a downloaded state after checking everything about it; raises StateRejected."""
        if not isinstance(metadata, dict) or metadata.get("module") != self.module_id:
            raise StateRejected(
                f"state for {self.module_id}: metadata names another module ({metadata!r:.80})"
            )
        rounds = metadata.get("fragment_rounds")
        n = self.n_fragments
        if (
            not isinstance(rounds, list)
            or len(rounds) != n
            or not all(isinstance(r, int) and r >= 0 for r in rounds)
        ):
            raise StateRejected(f"state for {self.module_id}: malformed fragment rounds {rounds!r:.80}")
        if len(tensors) != 2 * n:
            raise StateRejected(f"state for {self.module_id}: {len(tensors)} tensors, expected {2 * n}")
        for i, t in enumerate(tensors):
            expected = self.global_flats[i % n]
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != expected.shape:
                raise StateRejected(
                    f"state for {self.module_id}: tensor {i} is {getattr(t, 'dtype', type(t))} "
                    f"{tuple(getattr(t, 'shape', ()))}, expected float32 {tuple(expected.shape)}"
                )
            if not torch.isfinite(t).all():
                raise StateRejected(f"state for {self.module_id}: tensor {i} has NaN or inf")
            if t.numel() and t.abs().max() > max_abs:
                raise StateRejected(f"state for {self.module_id}: tensor {i} has values beyond {max_abs:g}")
        for f in range(n):
            self.global_flats[f].copy_(tensors[f])
            self.outers[f].state[self.global_flats[f]]["momentum_buffer"] = tensors[n + f].clone()
        self.fragment_rounds = list(rounds)
        self.load_local_from_global()

    def named_state(self) -> dict[str, torch.Tensor]:
        """For checkpoints: the global copy per parameter (readable without the fragment plan), and
        the outer momentum per fragment."""
        out = {
            f"{self.module_id}/global/{name}": t
            for name, t in zip(self.names, self.plan.join(self.global_flats), strict=True)
        }
        for f in range(self.n_fragments):
            out[f"{self.module_id}/momentum/f{f}"] = self.momentum(f).detach()
        return out

    def load_named_state(self, tensors: dict[str, torch.Tensor], fragment_rounds: list[int]) -> None:
        try:
            params = [tensors[f"{self.module_id}/global/{n}"].float() for n in self.names]
            momenta = [tensors[f"{self.module_id}/momentum/f{f}"].float() for f in range(self.n_fragments)]
        except KeyError as e:
            raise StateRejected(f"checkpoint lacks {e.args[0]}") from None
        flats = [self.plan.gather(params, f) for f in range(self.n_fragments)]
        self.load_state(dict(module=self.module_id, fragment_rounds=list(fragment_rounds)), flats + momenta)
