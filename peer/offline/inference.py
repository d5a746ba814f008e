"""Single-path inference and export: DiPaCo serves a prompt with the one path its prefix routes to.

`generate` routes the prompt (BOS + its tokens, first 32 of them) exactly as training documents were
routed, then samples from that path alone; the other modules of the grid are never run. `export_path`
writes one path as a plain safetensors file plus a JSON config (model shape, path, tokenizer, run id),
and `load_exported` rebuilds it as a `PathModel` with nothing but those two files (and the tokenizer
file, copied alongside when the run does not use the byte tokenizer).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from peer.config import RunManifest
from peer.errors import ConfigError
from peer.model.grid import ModelConfig, check_path, path_from_index, path_index, path_module_ids
from peer.model.route import Route, route_function
from peer.model.router import Router
from peer.model.tokenizer import Tokenizer, load_tokenizer
from peer.model.transformer import GridModel, PathModel

EXPORT_FORMAT = "pathswarm-path"
EXPORT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


@dataclass
class Generation:
    """A sampled continuation and the path that produced it."""

    prompt: str
    text: str  # the generated continuation only
    tokens: list[int]  # its token ids
    path: tuple[int, ...]
    path_index: int
    #: why it ended: "eos" (the model's end-of-text token) or "max_new_tokens"
    stopped: str = "max_new_tokens"
    #: the context it ran in; longer prompt + continuation slid the window (the start was not seen)
    context: int = 0
    prompt_tokens: int = 0

    def why(self) -> str:
        """One line: how much was generated, why it ended, and what to try when it says little."""
        n = len(self.tokens)
        if self.stopped == "eos" and n == 0:
            return (
                "nothing generated: the model's first token after the prompt was its end-of-text token "
                "(another --seed, or --min_new_tokens N, continues past it)"
            )
        end = "at the model's end-of-text token" if self.stopped == "eos" else "at --max_new_tokens"
        line = f"{n} new tokens, stopped {end}"
        if self.prompt_tokens + n > self.context:
            line += f"; past the model's context of {self.context} tokens the window slid on"
        if n and not self.text.strip():
            line += (
                "; the continuation is only whitespace: the model predicts little but spaces, as an "
                "undertrained one does (train longer: --inner_steps, --max_rounds)"
            )
        return line


def _choose_path_model(
    model: GridModel | PathModel, router: Route | Router | None, features: PathModel | None, ids: list[int]
) -> PathModel:
    if isinstance(model, PathModel):
        return model  # a single path needs no routing
    if router is None:
        raise ValueError("generating from a grid needs the run's router to pick a path")
    if isinstance(router, Router):
        if features is None:
            raise ValueError("a Router needs its feature model (see peer.model.route.feature_model)")
        router = route_function(router, features)
    index = int(router([ids])[0])
    return model.path_model(path_from_index(model.cfg, index))


@torch.no_grad()
def generate(
    model: GridModel | PathModel,
    router: Route | Router | None,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    *,
    feature_model: PathModel | None = None,
    context_len: int | None = None,
    min_new_tokens: int = 0,
) -> Generation:
    """Samples a continuation of `prompt` from the path its prefix routes to. `router` is a route
    function (as `peer.run.rebuild.make_route`) or a `Router` with its `feature_model`; it is unused for a
    `PathModel`. temperature 0 is greedy. The context is cropped to `context_len` (default
    max_seq_len; pass the run's seq_len, the window the model was trained on). The end-of-text token
    is not sampled before `min_new_tokens` tokens."""
    if min(max_new_tokens, min_new_tokens) < 0 or temperature < 0 or (top_k is not None and top_k < 1):
        raise ConfigError("max_new_tokens, min_new_tokens and temperature must be >= 0 and top_k >= 1")
    ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
    path_model = _choose_path_model(model, router, feature_model, ids)
    cfg = path_model.cfg
    context = min(context_len or cfg.max_seq_len, cfg.max_seq_len)
    gen = torch.Generator().manual_seed(seed)
    device = next(path_model.parameters()).device
    was_training = path_model.training
    path_model.eval()
    new: list[int] = []
    stopped = "max_new_tokens"
    try:
        for _ in range(max_new_tokens):
            window = torch.tensor([(ids + new)[-context:]], dtype=torch.long, device=device)
            logits = path_model(window)[0, -1].float().cpu()
            if len(new) < min_new_tokens:
                logits[tokenizer.eos_id] = float("-inf")
            if temperature == 0:
                token = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    cutoff = logits.topk(top_k).values[-1]
                    logits = logits.masked_fill(logits < cutoff, float("-inf"))
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            if token == tokenizer.eos_id:
                stopped = "eos"
                break
            new.append(token)
    finally:
        path_model.train(was_training)
    index = path_index(cfg, path_model.path)
    return Generation(prompt, tokenizer.decode(new), new, path_model.path, index, stopped, context, len(ids))


def export_path(
    grid: GridModel,
    path: tuple[int, ...] | int,
    out_dir: str | Path,
    manifest: RunManifest,
    tokenizer_file: Path | None = None,
) -> Path:
    """Writes `model.safetensors` and `config.json` for one path; returns the folder.
    `tokenizer_file`: the run's checked tokenizer file (default: the manifest's tokenizer path)."""
    path = path_from_index(grid.cfg, path) if isinstance(path, int) else tuple(path)
    check_path(grid.cfg, path)
    if manifest.model != grid.cfg:
        raise ValueError("the grid's model config differs from the manifest's")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = grid.path_model(path)
    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in model.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    tokenizer = manifest.tokenizer
    if tokenizer != "bytes":
        # Copied so the export is self-contained; the fingerprint says it is the run's tokenizer.
        source = tokenizer_file or Path(tokenizer)
        shutil.copyfile(source / "tokenizer.json" if source.is_dir() else source, out / "tokenizer.json")
        tokenizer = "tokenizer.json"
    config = dict(
        format=EXPORT_FORMAT,
        version=EXPORT_VERSION,
        model=grid.cfg.model_dump(mode="json"),
        path=list(path),
        path_index=path_index(grid.cfg, path),
        modules=path_module_ids(grid.cfg, path),
        tokenizer=tokenizer,
        tokenizer_fingerprint=manifest.tokenizer_fingerprint,
        seq_len=manifest.seq_len,
        run_id=manifest.run_id,
        run_name=manifest.name,
    )
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return out


def read_export_config(directory: str | Path) -> dict[str, Any]:
    file = Path(directory) / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {file}: {e}") from e
    if not isinstance(config, dict) or config.get("format") != EXPORT_FORMAT:
        raise ConfigError(f"{file} is not a pathswarm path export")
    if config.get("version") != EXPORT_VERSION:
        raise ConfigError(f"{file} has export version {config.get('version')}, this reads {EXPORT_VERSION}")
    return config


def load_exported(directory: str | Path) -> PathModel:
    """The exported path as a `PathModel` in eval mode; its config dict is `model.export_config`."""
    config = read_export_config(directory)
    cfg = ModelConfig(**config["model"])
    model = PathModel(cfg, tuple(config["path"]))
    try:
        state = load_file(str(Path(directory) / WEIGHTS_FILE))
    except Exception as e:  # safetensors raises its own error types for bad files
        raise ConfigError(f"cannot read {Path(directory) / WEIGHTS_FILE}: {e}") from e
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"{directory}: weights do not match the config (missing {missing}, extra {unexpected})"
        )
    model.export_config = config  # type: ignore[attr-defined]
    return model.eval()


def exported_tokenizer(directory: str | Path) -> Tokenizer:
    config = read_export_config(directory)
    spec = config["tokenizer"]
    tok = load_tokenizer(spec if spec == "bytes" else str(Path(directory) / spec))
    if config.get("tokenizer_fingerprint") and tok.fingerprint != config["tokenizer_fingerprint"]:
        raise ConfigError(f"{directory}: the tokenizer differs from the one the model was trained with")
    return tok
