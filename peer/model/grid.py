"""The shape of a DiPaCo grid (arXiv 2403.10616): model size, paths, module ids, fragments.

A model is a decoder-only transformer whose blocks are cut into L levels of K modules each. The
token embedding, final norm and (tied) LM head form the *trunk*, a module every path shares. A path
picks one module per level; optionally each path also owns private blocks after the grid. Every
parameter belongs to exactly one module and one fragment of it (the unit Streaming DiLoCo syncs).

Pure data and arithmetic, no torch: the config tree and the scheduler import this without loading
the network code (`peer.model.transformer`).
"""

from __future__ import annotations

import itertools
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from peer.errors import ConfigError

TRUNK = "trunk"
Path = tuple[int, ...]

# Caps on a grid, checked when a manifest is read, before anything enumerates its paths or allocates a
# module: a signed manifest is the creator's claim, and an 8x64 grid (64**8 paths) would have every
# joiner and the monitor walk 2.8e14 paths. DiPaCo's largest grid is 16x16 = 256 paths; these leave
# real runs 16 times that room.
#: levels (L); 8 is already 4096 paths at K = 2, and every level adds a hop on each path's forward
MAX_LEVELS = 8
#: modules per level (K): router centroids and the monitor's grid view hold one row per module
MAX_MODULES_PER_LEVEL = 64
#: paths (K**L): the router's bias, the scheduler's assignment and the monitor's tables hold one per path
MAX_PATHS = 4096
#: blocks on one path (levels x blocks per module + private blocks): the deepest open models have about
#: 128; the memory check a peer makes before it allocates walks every block of its path
MAX_BLOCKS_PER_PATH = 256


class ModelConfig(BaseModel):
    """Shape of the grid model. Frozen: it is part of the signed run manifest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: int = Field(260, ge=2)
    d_model: int = Field(64, ge=8)
    n_heads: int = Field(4, ge=1)
    d_ff: int = Field(256, ge=8)
    max_seq_len: int = Field(128, ge=8)
    n_levels: int = Field(2, ge=1, le=MAX_LEVELS)
    modules_per_level: int = Field(2, ge=1, le=MAX_MODULES_PER_LEVEL)
    blocks_per_module: int = Field(1, ge=1)
    private_blocks_per_path: int = Field(0, ge=0)
    fragment_layout: Literal["strided", "sequential"] = "strided"

    @model_validator(mode="after")
    def _check_shape(self) -> ModelConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        # K and L are each capped by their fields; their power is what enumerating paths costs
        if self.n_paths > MAX_PATHS:
            raise ValueError(
                f"modules_per_level ** n_levels = {self.modules_per_level}**{self.n_levels} = "
                f"{self.n_paths} paths exceeds the cap of {MAX_PATHS} paths"
            )
        if self.blocks_per_path > MAX_BLOCKS_PER_PATH:
            raise ValueError(
                f"n_levels * blocks_per_module + private_blocks_per_path = {self.n_levels} * "
                f"{self.blocks_per_module} + {self.private_blocks_per_path} = {self.blocks_per_path} "
                f"blocks per path exceeds the cap of {MAX_BLOCKS_PER_PATH}"
            )
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
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
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
        raise ConfigError(f"path index {index} is outside 0..{cfg.n_paths - 1}")
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
        raise ConfigError(f"cannot read path {text!r}: expected an index or one module per level") from e
    check_path(cfg, path)
    return path


def check_path(cfg: ModelConfig, path: Path) -> None:
    if len(path) != cfg.n_levels or not all(0 <= k < cfg.modules_per_level for k in path):
        raise ConfigError(
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


def is_path_of(cfg: ModelConfig, index: int, modules: list[str]) -> bool:
    """Whether `modules` are exactly the modules of path `index` of the grid: what a claim on that
    path may say it holds (peer/swarm/claims.py, the monitor's view)."""
    if not 0 <= index < cfg.n_paths:
        return False
    return sorted(modules) == sorted(path_module_ids(cfg, path_from_index(cfg, index)))


def all_module_ids(cfg: ModelConfig) -> list[str]:
    ids = [TRUNK] + [
        grid_module_id(lv, k) for lv in range(cfg.n_levels) for k in range(cfg.modules_per_level)
    ]
    if cfg.private_blocks_per_path:
        ids += [private_module_id(cfg, p) for p in all_paths(cfg)]
    return ids


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
