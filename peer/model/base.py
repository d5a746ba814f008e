"""A run's base model: one dense path trained before the run, from which every module starts.

DiPaCo warm-starts every path from a briefly trained dense model and routes with that model's
features (Douillard et al. 2024, "DiPaCo: Distributed Path Composition", §3); the in-process
simulator does the same (`peer.offline.simulate.warm_start_modules`). In a live run the base is a
content-addressed artifact the manifest names (peer/artifacts/): a safetensors file with path 0's
modules, `<module id>.<tensor name>` for the trunk, `l{l}m0` of each level and `p0` when paths have
private blocks. Module `l{l}m{k}` of every `k` starts from the base's `l{l}m0` and every private
module from `p0`, so every path starts as an exact copy of the base.

The file comes from another peer: `load_base` refuses anything but exactly the expected tensors,
shapes and finite float32 values, with one line saying what is wrong.
"""

from __future__ import annotations

import re
from pathlib import Path

import safetensors
import torch
from safetensors.torch import save_file
from torch import nn

from peer.errors import ConfigError
from peer.model.grid import TRUNK, ModelConfig, path_module_ids
from peer.model.transformer import PathModel, build_module, build_module_shape_only

ModuleStates = dict[str, dict[str, torch.Tensor]]
FORMAT = "pathswarm-base/1"


def base_module_ids(cfg: ModelConfig) -> list[str]:
    return path_module_ids(cfg, (0,) * cfg.n_levels)


def source_of(module_id: str) -> str:
    """The base module a grid module starts from."""
    if module_id == TRUNK:
        return TRUNK
    if module_id.startswith("p"):
        return "p0"
    level = re.match(r"^l(\d+)m\d+$", module_id)
    if level is None:
        raise ValueError(f"unknown module id {module_id!r}")
    return f"l{level.group(1)}m0"


def save_base(states: ModuleStates, file: Path) -> None:
    flat = {f"{mid}.{name}": t.contiguous() for mid, tensors in states.items() for name, t in tensors.items()}
    save_file(flat, str(file), metadata={"format": FORMAT})


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for mid in base_module_ids(cfg):
        module = build_module_shape_only(cfg, mid)
        shapes.update({f"{mid}.{k}": tuple(v.shape) for k, v in module.state_dict().items()})
    return shapes


def load_base(file: Path, cfg: ModelConfig) -> ModuleStates:
    """The base's module states, checked against the run's model shape."""
    expected = expected_shapes(cfg)
    try:
        with safetensors.safe_open(str(file), framework="pt") as f:
            if (f.metadata() or {}).get("format") != FORMAT:
                raise ConfigError(f"{file} is not a pathswarm base model (format {FORMAT})")
            names = set(f.keys())
            if names != set(expected):
                extra, missing = sorted(names - set(expected))[:3], sorted(set(expected) - names)[:3]
                raise ConfigError(
                    f"{file} does not fit this run's model: missing {missing}, unexpected {extra}"
                )
            states: ModuleStates = {}
            for name in sorted(names):
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != expected[name] or not tensor.is_floating_point():
                    raise ConfigError(
                        f"{file}: {name} has shape {tuple(tensor.shape)}, expected {expected[name]}"
                    )
                if not torch.isfinite(tensor).all():
                    raise ConfigError(f"{file}: {name} holds NaN or infinite values")
                mid, _, key = name.partition(".")
                states.setdefault(mid, {})[key] = tensor.float()
    except (OSError, safetensors.SafetensorError) as e:
        raise ConfigError(f"cannot read the base model {file}: {e}") from None
    return states


def base_model(cfg: ModelConfig, base: ModuleStates) -> PathModel:
    """Path 0 of the grid as the base holds it: a dense model of one path's size."""
    path = (0,) * cfg.n_levels
    return PathModel(cfg, path, modules=base_modules(cfg, base, path_module_ids(cfg, path)))


def base_modules(cfg: ModelConfig, base: ModuleStates, module_ids: list[str]) -> dict[str, nn.Module]:
    """The given grid modules, each loaded from the base module it starts from."""
    modules = {}
    for mid in module_ids:
        module = build_module(cfg, mid, 0)
        module.load_state_dict(base[source_of(mid)])
        modules[mid] = module
    return modules
