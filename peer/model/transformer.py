"""The path-composed transformer of DiPaCo: modules of the grid as torch modules, and paths of them.

`build_module` initialises every module from the run seed and its id alone, so all peers start from
the same weights; a `PathModel` runs the trunk, one module per level and the path's private blocks;
a `GridModel` holds every module (evaluation and export). The grid's shape lives in
`peer.model.grid`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from peer.model.grid import (
    TRUNK,
    ModelConfig,
    Path,
    all_module_ids,
    fragment_of,
    path_from_index,
    path_module_ids,
)
from peer.seeding import stable_seed


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Trunk(nn.Module):
    """Embedding, positions, final norm; the LM head is tied to the embedding."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.ln_f = nn.LayerNorm(cfg.d_model)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok_emb(tokens) + self.pos_emb(positions)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ln_f(hidden) @ self.tok_emb.weight.t()


class BlockStack(nn.Module):
    """A run of consecutive blocks: one grid module, or a path's private blocks."""

    def __init__(self, cfg: ModelConfig, n_blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _init_weights(module: nn.Module, n_blocks_total: int) -> None:
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            std = 0.02
            if name.endswith(("proj.weight", "out.weight")):
                std = 0.02 / math.sqrt(2 * n_blocks_total)  # GPT-2 style residual scaling
            nn.init.normal_(p, 0.0, std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


def build_module(cfg: ModelConfig, module_id: str, seed: int) -> nn.Module:
    """Builds one module with weights that depend only on (seed, module_id)."""
    if module_id == TRUNK:
        factory = lambda: Trunk(cfg)  # noqa: E731
    elif module_id.startswith("l"):
        level, k = (int(x) for x in module_id[1:].split("m"))
        if not (0 <= level < cfg.n_levels and 0 <= k < cfg.modules_per_level):
            raise ValueError(f"module {module_id} is not in the {cfg.n_levels}x{cfg.modules_per_level} grid")
        factory = lambda: BlockStack(cfg, cfg.blocks_per_module)  # noqa: E731
    elif module_id.startswith("p") and cfg.private_blocks_per_path:
        path_from_index(cfg, int(module_id[1:]))
        factory = lambda: BlockStack(cfg, cfg.private_blocks_per_path)  # noqa: E731
    else:
        raise ValueError(f"unknown module id {module_id!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stable_seed(seed, module_id))
        module = factory()
        _init_weights(module, cfg.blocks_per_path)
    return module


class PathModel(nn.Module):
    """One path through the grid: the trunk, one module per level, and its private blocks."""

    def __init__(
        self, cfg: ModelConfig, path: Path, seed: int = 0, modules: dict[str, nn.Module] | None = None
    ):
        super().__init__()
        self.cfg = cfg
        self.path = tuple(path)
        ids = path_module_ids(cfg, self.path)
        modules = modules or {}
        self.parts = nn.ModuleDict({mid: modules.get(mid) or build_module(cfg, mid, seed) for mid in ids})

    @property
    def module_ids(self) -> list[str]:
        return list(self.parts.keys())

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Last hidden state (before the final norm), shape (batch, time, d_model)."""
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {tokens.shape[1]} tokens exceeds max_seq_len={self.cfg.max_seq_len}"
            )
        trunk: Trunk = self.parts[TRUNK]  # type: ignore[assignment]
        x = trunk.embed(tokens)
        for mid in self.module_ids[1:]:
            x = self.parts[mid](x)
        return x

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.parts[TRUNK].head(self.hidden(tokens))  # type: ignore[operator]

    def loss(self, tokens: torch.Tensor, ignore_prefix: int = 0) -> torch.Tensor:
        """Mean next-token cross-entropy; the first `ignore_prefix` targets are not scored."""
        logits = self(tokens[:, :-1])
        targets = tokens[:, 1:].clone()
        if ignore_prefix:
            targets[:, : max(ignore_prefix - 1, 0)] = -100
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100
        )


class GridModel(nn.Module):
    """Every module of the grid, for evaluation and export; paths share module objects."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.grid = nn.ModuleDict({mid: build_module(cfg, mid, seed) for mid in all_module_ids(cfg)})

    def path_model(self, path: Path) -> PathModel:
        return PathModel(
            self.cfg, path, modules={mid: self.grid[mid] for mid in path_module_ids(self.cfg, path)}
        )


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives: its module, its name inside the module, its fragment."""

    module_id: str
    name: str
    fragment: int
    shape: tuple[int, ...]


class _NoNormalInit(TorchFunctionMode):
    """Skips normal_ initialisation: on the meta device it runs a Python decomposition that imports
    torch._dynamo, two seconds of every peer's and command's start, to fill tensors without values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.normal_, nn.init.normal_):
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


@contextmanager
def shapes_only() -> Iterator[None]:
    """Modules built inside have parameters on the meta device: shapes, no memory, no values."""
    with torch.device("meta"), _NoNormalInit():
        yield


def parameter_map(
    cfg: ModelConfig, n_fragments: int = 1, module_ids: list[str] | None = None
) -> list[ParamSlot]:
    """Every parameter of the given modules (default: the whole grid), each exactly once."""
    slots = []
    for mid in module_ids or all_module_ids(cfg):
        module = build_module_shape_only(cfg, mid)
        for name, p in module.named_parameters():
            slots.append(ParamSlot(mid, name, fragment_of(cfg, mid, name, n_fragments), tuple(p.shape)))
    return slots


def build_module_shape_only(cfg: ModelConfig, module_id: str) -> nn.Module:
    """A module's parameters on the meta device (`shapes_only`): names and shapes, nothing allocated."""
    n = cfg.private_blocks_per_path if module_id.startswith("p") else cfg.blocks_per_module
    with shapes_only():
        return Trunk(cfg) if module_id == TRUNK else BlockStack(cfg, n)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
