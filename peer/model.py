"""The path-composed transformer of DiPaCo (arXiv 2403.10616): a grid of shared modules.

A model is a decoder-only transformer whose blocks are cut into L levels of K modules each. The
token embedding, final norm and (tied) LM head form the *trunk*, a module every path shares. A path
picks one module per level; optionally each path also owns private blocks after the grid. Every
parameter belongs to exactly one module and one fragment of it (the unit Streaming DiLoCo syncs),
and every module is initialised from the run seed alone, so all peers start from the same weights.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

TRUNK = "trunk"
Path = tuple[int, ...]


class ModelConfig(BaseModel):
    """Shape of the grid model. Frozen: it is part of the signed run manifest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(260, ge=2)
    d_model: int = Field(64, ge=8)
    n_heads: int = Field(4, ge=1)
    d_ff: int = Field(256, ge=8)
    max_seq_len: int = Field(128, ge=8)
    n_levels: int = Field(2, ge=1, le=8)
    modules_per_level: int = Field(2, ge=1, le=64)
    blocks_per_module: int = Field(1, ge=1)
    private_blocks_per_path: int = Field(0, ge=0)
    fragment_layout: Literal["strided", "sequential"] = "strided"

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        return self

    @property
    def n_paths(self) -> int:
        return self.modules_per_level**self.n_levels

    @property
    def blocks_per_path(self) -> int:
        return self.n_levels * self.blocks_per_module + self.private_blocks_per_path


PRESETS: dict[str, dict] = {
    # CPU tests and the demo: a few hundred thousand parameters per path.
    "tiny": dict(d_model=64, n_heads=4, d_ff=256, max_seq_len=128, blocks_per_module=1),
    "small": dict(d_model=128, n_heads=4, d_ff=512, max_seq_len=256, blocks_per_module=2),
    "base": dict(d_model=512, n_heads=8, d_ff=2048, max_seq_len=512, blocks_per_module=4),
    # About the 150M-parameter path of the DiPaCo paper with a 32k vocabulary: 12 blocks of d=896.
    "path-150m": dict(
        vocab_size=32000, d_model=896, n_heads=14, d_ff=3584, max_seq_len=1024, blocks_per_module=6
    ),
}


def model_config_from_preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


def all_paths(cfg: ModelConfig) -> list[Path]:
    return list(itertools.product(range(cfg.modules_per_level), repeat=cfg.n_levels))


def path_index(cfg: ModelConfig, path: Path) -> int:
    check_path(cfg, path)
    index = 0
    for k in path:
        index = index * cfg.modules_per_level + k
    return index


def path_from_index(cfg: ModelConfig, index: int) -> Path:
    if not 0 <= index < cfg.n_paths:
        raise ValueError(f"path index {index} is outside 0..{cfg.n_paths - 1}")
    digits = []
    for _ in range(cfg.n_levels):
        index, k = divmod(index, cfg.modules_per_level)
        digits.append(k)
    return tuple(reversed(digits))


def parse_path(cfg: ModelConfig, text: str) -> Path:
    """Accepts "3" (a path index) or "1,0" / "1-0" (one module index per level)."""
    text = text.strip()
    try:
        if text.isdigit():
            return path_from_index(cfg, int(text))
        path = tuple(int(p) for p in text.replace("-", ",").split(","))
    except ValueError as e:
        raise ValueError(f"cannot read path {text!r}: expected an index or one module per level") from e
    check_path(cfg, path)
    return path


def check_path(cfg: ModelConfig, path: Path) -> None:
    if len(path) != cfg.n_levels or not all(0 <= k < cfg.modules_per_level for k in path):
        raise ValueError(
            f"path {path} does not fit a {cfg.n_levels}x{cfg.modules_per_level} grid "
            f"(one index in 0..{cfg.modules_per_level - 1} per level)"
        )


def grid_module_id(level: int, k: int) -> str:
    return f"l{level}m{k}"


def private_module_id(cfg: ModelConfig, path: Path) -> str:
    return f"p{path_index(cfg, path)}"


def path_module_ids(cfg: ModelConfig, path: Path) -> list[str]:
    """Module ids a path runs through, in forward order (trunk first)."""
    check_path(cfg, path)
    ids = [TRUNK] + [grid_module_id(level, k) for level, k in enumerate(path)]
    if cfg.private_blocks_per_path:
        ids.append(private_module_id(cfg, path))
    return ids


def all_module_ids(cfg: ModelConfig) -> list[str]:
    ids = [TRUNK] + [
        grid_module_id(lv, k) for lv in range(cfg.n_levels) for k in range(cfg.modules_per_level)
    ]
    if cfg.private_blocks_per_path:
        ids += [private_module_id(cfg, p) for p in all_paths(cfg)]
    return ids


def stable_seed(*parts: object) -> int:
    """A seed that is the same in every process and Python version (unlike hash())."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


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


def fragment_of(cfg: ModelConfig, module_id: str, name: str, n_fragments: int) -> int:
    """Fragment of a parameter: blocks are dealt out strided ({0, P, 2P, ...}) or in runs."""
    if n_fragments < 1:
        raise ValueError("n_fragments must be >= 1")
    if module_id == TRUNK:
        order = ["tok_emb.", "pos_emb.", "ln_f."]
        return next(i for i, prefix in enumerate(order) if name.startswith(prefix)) % n_fragments
    block = int(name.split(".")[1])
    n_blocks = cfg.private_blocks_per_path if module_id.startswith("p") else cfg.blocks_per_module
    if cfg.fragment_layout == "strided":
        return block % n_fragments
    return block * n_fragments // n_blocks


def parameter_map(
    cfg: ModelConfig, n_fragments: int = 1, module_ids: list[str] | None = None
) -> list[ParamSlot]:
    """Every parameter of the given modules (default: the whole grid), each exactly once."""
    slots = []
    for mid in module_ids or all_module_ids(cfg):
        with torch.device("meta"):
            module = build_module_shape_only(cfg, mid)
        for name, p in module.named_parameters():
            slots.append(ParamSlot(mid, name, fragment_of(cfg, mid, name, n_fragments), tuple(p.shape)))
    return slots


def build_module_shape_only(cfg: ModelConfig, module_id: str) -> nn.Module:
    if module_id == TRUNK:
        return Trunk(cfg)
    n = cfg.private_blocks_per_path if module_id.startswith("p") else cfg.blocks_per_module
    return BlockStack(cfg, n)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
