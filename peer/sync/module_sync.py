"""DiLoCo state of one module on one peer: the global copy and outer momentum per fragment.

The global copy θ̄ lives on the CPU in fp32, as one flat vector per fragment (peer/sync/fragments.py)
with its own outer momentum. A fragment's outer gradient is Δ = θ̄ − θ_local. After the holders
agreed on the group's Δ̄, the outer step (SGD with Nesterov momentum, as DiLoCo) gives θ̃, merged into
the local fragment with the Streaming DiLoCo rule θ_local ← α·θ_local + (1−α)·θ̃ (α = 0 replaces it:
plain DiLoCo).

Every holder must end a round with the *same bits* in θ̄ and in its momentum, so the outer step is
written here with separate element-wise operations, each rounded once, rather than with
`torch.optim.SGD`, whose fused multiply-adds round differently on different CPUs and vector widths.
`digest(f)` is a sha256 of a fragment's θ̄ and momentum: equal digests mean equal states, which is how
holders, joiners and repairs recognise the group's copy.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from dataclasses import dataclass

import torch
from torch import nn

from peer.config import OuterOptimizerConfig
from peer.model.grid import ModelConfig
from peer.sync.fragments import FragmentPlan

logger = logging.getLogger(__name__)


class StateRejected(ValueError):
    """A module state received from another peer failed validation; nothing was loaded."""


def state_digest(global_flat: torch.Tensor, momentum: torch.Tensor) -> str:
    """sha256 of a fragment's global copy and momentum, as little-endian float32 bytes."""
    h = hashlib.sha256()
    for t in (global_flat, momentum):
        # hashed from the tensor's own memory: a copy to bytes would cost as much as the hash
        h.update(t.detach().to(torch.float32).contiguous().numpy().data)
    return h.hexdigest()


def module_digest(fragment_digests: list[str]) -> str:
    """One digest of a module's whole state, from its fragments' digests in order."""
    return hashlib.sha256("".join(fragment_digests).encode()).hexdigest()


#: rounds after a joiner's download in which a dropped member or a repair is expected, not a fault:
#: the holders see the joiner's claim at different moments, so its first round's group can differ
#: between members (one averages with it, another without), and the next round's digests repair it
SETTLING_ROUNDS = 3


@dataclass(frozen=True)
class PreparedStep:
    """A fragment's outer step computed ahead of its installation (`ModuleSync.prepare_step`)."""

    #: the state it was computed from (the very tensors: `apply` replaces them, never writes into them)
    theta_before: torch.Tensor
    momentum_before: torch.Tensor
    theta: torch.Tensor
    momentum: torch.Tensor
    digest: str


class ModuleSync:
    """θ̄ of one module per fragment, its outer momentum and its fragment rounds."""

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
        self.global_flats = [self.plan.gather(self.local_params, f) for f in range(n_fragments)]
        self.momenta = [torch.zeros_like(g) for g in self.global_flats]
        self.outer = outer
        self.delta_scale = math.sqrt(paths_through) if outer.sqrt_paths_scaling else 1.0
        self.fragment_rounds = [0] * n_fragments
        #: bumped whenever the state is replaced (a download): rounds started before no longer apply
        self.epoch = 0
        #: rounds left in which this copy, just downloaded to join (or rejoin) its holders, may still
        #: disagree with the group's: a joiner's first round races the holders' views of the group
        self.settling = 0
        #: rounds with company left in which this copy, started here rather than downloaded, may
        #: differ from its group's as a matter of course: in a new swarm every holder takes its first
        #: rounds alone until it sees the others (only how loudly that is logged depends on it)
        self.forming = SETTLING_ROUNDS
        self._digests: list[str | None] = [None] * n_fragments
        #: a state served to another peer (on the sync service's thread) is one round's tensors with
        #: that round's count: a round's install or a download changes both under this lock
        self._lock = threading.Lock()
        #: sparse codecs: per fragment, what this peer's outer gradients did not send yet (local only)
        self.errors: list[torch.Tensor | None] = [None] * n_fragments

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
        return self.global_flats[fragment] - self.plan.gather(self.local_params, fragment)

    @torch.no_grad()
    def corrected_outer_gradient(self, fragment: int, codec, decay: float) -> torch.Tensor:
        """The fragment's Δ to send: with a codec that keeps error feedback (SparseLoCo's), plus the
        decayed rest of earlier outer gradients that did not go out (`settle_feedback` keeps it)."""
        delta = self.outer_gradient(fragment)
        e = self.errors[fragment]
        if not codec.spec.error_feedback or e is None:
            return delta
        return torch.add(delta, torch.mul(e, decay))

    @torch.no_grad()
    def settle_feedback(self, fragment: int, corrected: torch.Tensor, sent: torch.Tensor | None) -> None:
        """Error feedback, once a round is applied: the rest of `corrected` that `sent` (what of it went
        into the step: None for nothing) left out is added to the next outer gradient."""
        if sent is corrected:
            self.errors[fragment] = None
        else:
            self.errors[fragment] = corrected.clone() if sent is None else torch.sub(corrected, sent)

    def digest(self, fragment: int) -> str:
        if self._digests[fragment] is None:
            self._digests[fragment] = state_digest(self.global_flats[fragment], self.momenta[fragment])
        return self._digests[fragment]

    def module_digest(self) -> str:
        """One digest of the whole module's state (every fragment's digest, in order)."""
        return module_digest([self.digest(f) for f in range(self.n_fragments)])

    @torch.no_grad()
    def prepare_step(self, fragment: int, delta: torch.Tensor) -> PreparedStep:
        """The fragment's outer step computed from its current θ̄ and momentum without installing
        it: SGD with (Nesterov) momentum, one rounding per element-wise operation, and the digest of
        the result. Reads the state and writes nothing, so it may run on a thread of its own while
        the training thread goes on (`apply` then installs it if the state is still the one read)."""
        o = self.outer
        theta, momentum = self.global_flats[fragment], self.momenta[fragment]
        g = delta.to(torch.float32).reshape(theta.shape)
        if self.delta_scale != 1.0:
            g = torch.mul(g, self.delta_scale)
        if o.momentum > 0:
            buf = torch.add(torch.mul(momentum, o.momentum), g)
            update = torch.add(g, torch.mul(buf, o.momentum)) if o.nesterov else buf
        else:
            buf, update = momentum, g
        new_theta = torch.sub(theta, torch.mul(update, o.lr))
        return PreparedStep(theta, momentum, new_theta, buf, state_digest(new_theta, buf))

    @torch.no_grad()
    def apply(
        self,
        fragment: int,
        delta: torch.Tensor,
        alpha: float = 0.0,
        prepared: PreparedStep | None = None,
        sent_local: torch.Tensor | None = None,
    ) -> None:
        """Outer step on θ̄ of the fragment with the group's Δ̄, then θ_local ← α·θ_local + (1−α)·θ̃.
        Given `sent_local` (the fragment's θ_local when its Δ was taken), the steps trained since are
        carried onto the new copy: θ̃ + (θ_local − sent_local) stands for θ̃ in the merge, so that
        the overlap's steps go into the next Δ instead of being dropped.
        `prepared` (from `prepare_step` with the same Δ̄) is used only if it was computed from the
        state the fragment holds now; otherwise the step is computed here."""
        theta, momentum = self.global_flats[fragment], self.momenta[fragment]
        if prepared is None or prepared.theta_before is not theta or prepared.momentum_before is not momentum:
            prepared = self.prepare_step(fragment, delta)
        with self._lock:
            self.global_flats[fragment], self.momenta[fragment] = prepared.theta, prepared.momentum
            self.fragment_rounds[fragment] += 1
            self._digests[fragment] = prepared.digest
        g = self.global_flats[fragment]
        if alpha == 0.0 and sent_local is None:
            self.plan.scatter(g, self.local_params, fragment)
            return
        local = self.plan.gather(self.local_params, fragment)
        if sent_local is not None:
            g = torch.add(g, torch.sub(local, sent_local.reshape(local.shape)))
        self.plan.scatter(g if alpha == 0.0 else alpha * local + (1 - alpha) * g, self.local_params, fragment)

    def fragment_copy(self, fragment: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fragment's θ̄ and outer momentum (replaced, never written in place, by a round)."""
        return self.global_flats[fragment], self.momenta[fragment]

    @torch.no_grad()
    def load_fragment_copy(self, fragment: int, theta: torch.Tensor, momentum: torch.Tensor) -> None:
        """Replaces one fragment's θ̄ and momentum (a merge of diverged copies, `peer.sync.merge`)."""
        ref = self.global_flats[fragment]
        for t in (theta, momentum):
            if t.numel() != ref.numel() or not torch.isfinite(t).all():
                raise StateRejected(f"{self.module_id} fragment {fragment}: merged copy of the wrong size")
        theta = theta.detach().to(torch.float32).reshape(ref.shape).clone()
        momentum = momentum.detach().to(torch.float32).reshape(ref.shape).clone()
        with self._lock:
            self.global_flats[fragment], self.momenta[fragment] = theta, momentum
            self._digests[fragment] = None

    @torch.no_grad()
    def load_local_from_global(self) -> None:
        for f, g in enumerate(self.global_flats):
            self.plan.scatter(g, self.local_params, f)

    def state_tensors(self) -> list[torch.Tensor]:
        """What a joiner downloads: θ̄ of every fragment, then their momentum buffers."""
        return [g.detach() for g in self.global_flats] + [m.detach() for m in self.momenta]

    def snapshot(self) -> tuple[list[int], list[torch.Tensor]]:
        """The fragment rounds and the state tensors of one moment, from any thread: a round's tensors
        are replaced, never written into, so the references stay whole after the lock is let go."""
        with self._lock:
            return list(self.fragment_rounds), self.state_tensors()

    def state_metadata(self) -> dict:
        return dict(
            module=self.module_id,
            outer_round=self.outer_round,
            fragment_rounds=list(self.fragment_rounds),
            n_fragments=self.n_fragments,
        )

    def expected_shapes(self) -> list[torch.Size]:
        return [g.shape for g in self.global_flats] * 2

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
            or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 2**40 for r in rounds)
        ):
            raise StateRejected(f"state for {self.module_id}: malformed fragment rounds {rounds!r:.80}")
        if len(tensors) != 2 * n:
            raise StateRejected(f"state for {self.module_id}: {len(tensors)} tensors, expected {2 * n}")
        for i, (t, shape) in enumerate(zip(tensors, self.expected_shapes(), strict=True)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != shape:
                raise StateRejected(
                    f"state for {self.module_id}: tensor {i} is {getattr(t, 'dtype', type(t))} "
                    f"{tuple(getattr(t, 'shape', ()))}, expected float32 {tuple(shape)}"
                )
            if not torch.isfinite(t).all():
                raise StateRejected(f"state for {self.module_id}: tensor {i} has NaN or inf")
            if t.numel() and t.abs().max() > max_abs:
                raise StateRejected(f"state for {self.module_id}: tensor {i} has values beyond {max_abs:g}")
        flats = [tensors[f].detach().clone() for f in range(n)]
        momenta = [tensors[n + f].detach().clone() for f in range(n)]
        with self._lock:
            self.global_flats, self.momenta, self.fragment_rounds = flats, momenta, list(rounds)
            self._digests = [None] * n
            self.epoch += 1
        self.load_local_from_global()

    def named_state(self) -> dict[str, torch.Tensor]:
        """For checkpoints: the global copy per parameter (readable without the fragment plan), the
        outer momentum per fragment, and the error feedback's unsent rest per fragment that has one
        (a sparse peer restarted without it would lose what it has not sent yet)."""
        out = {
            f"{self.module_id}/global/{name}": t
            for name, t in zip(self.names, self.plan.join(self.global_flats), strict=True)
        }
        for f in range(self.n_fragments):
            out[f"{self.module_id}/momentum/f{f}"] = self.momenta[f].detach()
            if self.errors[f] is not None:
                out[f"{self.module_id}/error/f{f}"] = self.errors[f].detach()
        return out

    def load_named_state(self, tensors: dict[str, torch.Tensor], fragment_rounds: list[int]) -> None:
        try:
            params = [tensors[f"{self.module_id}/global/{n}"].float() for n in self.names]
            momenta = [tensors[f"{self.module_id}/momentum/f{f}"].float() for f in range(self.n_fragments)]
        except KeyError as e:
            raise StateRejected(f"checkpoint lacks {e.args[0]}") from None
        flats = [self.plan.gather(params, f) for f in range(self.n_fragments)]
        self.load_state(dict(module=self.module_id, fragment_rounds=list(fragment_rounds)), flats + momenta)
        for f in range(self.n_fragments):
            e = tensors.get(f"{self.module_id}/error/f{f}")  # absent: nothing unsent (or an older checkpoint)
            if e is not None and (e.shape != flats[f].shape or not torch.isfinite(e).all()):
                raise StateRejected(
                    f"checkpoint's error feedback of {self.module_id} fragment {f} is malformed"
                )
            self.errors[f] = None if e is None else e.float().clone()
