"""Cutting a module into P fragments, the unit Streaming DiLoCo (arXiv 2501.18512) syncs.

A module's parameters are laid end to end in fragment order — blocks dealt out strided ({0, P, 2P,
...} first) or in runs, as `model.fragment_of` says — and the flat vector is cut into P slices of
equal length. When the block count is a multiple of P the slices are exactly the block groups; in
every case each fragment carries 1/P of the module's numbers (the last at most P−1 fewer), so a
fragment sync puts 1/P of a full sync on the wire.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from peer.model.grid import ModelConfig, fragment_of


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of parameter `param` (flattened) sit in a fragment at `offset`."""

    param: int
    start: int
    stop: int
    offset: int


class FragmentPlan:
    """Where every number of a module's parameters sits in its P fragment vectors."""

    def __init__(
        self, cfg: ModelConfig, module_id: str, names: Sequence[str], shapes: Sequence[torch.Size], n: int
    ):
        if n < 1:
            raise ValueError("a module needs at least one fragment")
        self.module_id = module_id
        self.n_fragments = n
        self.shapes = [torch.Size(s) for s in shapes]
        sizes = [s.numel() for s in self.shapes]
        order = sorted(range(len(names)), key=lambda i: (fragment_of(cfg, module_id, names[i], n), i))
        self.numel = sum(sizes)
        self.fragment_numel = math.ceil(self.numel / n)
        self.pieces: list[list[Piece]] = [[] for _ in range(n)]
        position = 0  # in the flat, fragment-ordered vector
        for i in order:
            start = 0
            while start < sizes[i]:
                fragment, offset = divmod(position, self.fragment_numel)
                take = min(sizes[i] - start, self.fragment_numel - offset)
                self.pieces[fragment].append(Piece(i, start, start + take, offset))
                start += take
                position += take

    def size(self, fragment: int) -> int:
        return sum(p.stop - p.start for p in self.pieces[fragment])

    def gather(self, tensors: Sequence[torch.Tensor], fragment: int) -> torch.Tensor:
        """The fragment's numbers from per-parameter tensors, as one flat fp32 CPU tensor."""
        out = torch.empty(self.size(fragment), dtype=torch.float32)
        for piece in self.pieces[fragment]:
            flat = tensors[piece.param].detach().reshape(-1)[piece.start : piece.stop]
            out[piece.offset : piece.offset + piece.stop - piece.start] = flat.float().cpu()
        return out

    @torch.no_grad()
    def scatter(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], fragment: int) -> None:
        """Writes a fragment's numbers into per-parameter tensors (any device and dtype)."""
        for piece in self.pieces[fragment]:
            target = tensors[piece.param].view(-1)[piece.start : piece.stop]
            target.copy_(flat[piece.offset : piece.offset + piece.stop - piece.start].to(target))

    def split(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [self.gather(tensors, f) for f in range(self.n_fragments)]

    def join(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = [torch.empty(s, dtype=torch.float32) for s in self.shapes]
        for f, flat in enumerate(flats):
            self.scatter(flat, out, f)
        return out


def sync_offsets(inner_steps: int, n_fragments: int) -> list[int]:
    """t_p = p·H/P: fragment p syncs at inner steps t ≡ t_p (mod H); fragment 0 at H, 2H, ..."""
    if n_fragments > inner_steps:
        raise ValueError(f"fragments ({n_fragments}) cannot exceed inner steps H ({inner_steps})")
    return [p * inner_steps // n_fragments for p in range(n_fragments)]


def fragments_due(step: int, inner_steps: int, n_fragments: int) -> list[int]:
    """Fragments whose sync starts after inner step `step` (1-based count of completed steps)."""
    offsets = sync_offsets(inner_steps, n_fragments)
    return [p for p, t in enumerate(offsets) if step > 0 and step >= t and (step - t) % inner_steps == 0]


def next_due(step: int, inner_steps: int, n_fragments: int) -> tuple[int, int]:
    """(schedule step, fragment) of the first fragment sync due after inner step `step` or at it."""
    due = []
    for p, t in enumerate(sync_offsets(inner_steps, n_fragments)):
        first = t if t > 0 else inner_steps  # no sync at step 0
        at = first if step <= first else first + math.ceil((step - first) / inner_steps) * inner_steps
        due.append((at, p))
    return min(due)
