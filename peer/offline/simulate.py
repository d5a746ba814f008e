"""DiPaCo in one process, without the swarm: the reference the tests and benchmarks measure.

Every path of the grid gets its own `PathModel` whose modules are *local* copies, its own AdamW and
its own document shard. Paths train round-robin, H inner steps each per outer round; then, for every
module, the outer gradients Δᵢ = θ̄ − θᵢ of the paths through it are averaged with weights ∝ tokens
and one `ModuleSync` (global copy + SGD-Nesterov) takes the outer step, whose result is loaded into
every path's local copy. That is what the swarm's holders do over the network, minus the network.

`train_dense` trains the baselines (a single stack of the same blocks, or any `dense_shape`) with the
same inner optimizer and batches. Every model trains on `SimConfig.device` as a peer's does (bf16
autocast on CUDA, `peer.training.inner`); the batches come from the CPU and the global copies of the
outer optimizer stay there, as a peer keeps them. `warm_start_modules` cuts a trained dense model
into grid modules so every path starts from one base model, as the DiPaCo paper does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from peer.config import InnerOptimizerConfig, OuterOptimizerConfig, RunManifest
from peer.data.batches import PathBatches
from peer.model.grid import TRUNK, ModelConfig, all_module_ids, all_paths, path_module_ids
from peer.model.tokenizer import Tokenizer
from peer.model.transformer import GridModel, PathModel
from peer.seeding import stable_seed
from peer.sync.module_sync import ModuleSync
from peer.training.inner import autocast_for, device_of, inner_step, make_inner_optimizer, tokens_in

ModuleStates = dict[str, dict[str, torch.Tensor]]


class SimConfig(BaseModel):
    """The training half of a run manifest, plus the batch size a peer would choose."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelConfig = ModelConfig()
    seed: int = 0
    seq_len: int = Field(64, ge=8)
    batch_size: int = Field(16, ge=1)
    inner_steps: int = Field(50, ge=1, description="H: inner steps between outer syncs")
    inner: InnerOptimizerConfig = InnerOptimizerConfig()
    outer: OuterOptimizerConfig = OuterOptimizerConfig()
    #: where every model of the simulation trains and is scored: "cpu", "cuda[:N]" or "auto"
    device: str = Field("cpu", pattern=r"^(cpu|auto|cuda(:\d+)?)$")

    @classmethod
    def from_manifest(cls, manifest: RunManifest, batch_size: int = 16) -> SimConfig:
        return cls(
            model=manifest.model,
            seed=manifest.seed,
            seq_len=manifest.seq_len,
            batch_size=batch_size,
            inner_steps=manifest.sync.inner_steps,
            inner=manifest.inner,
            outer=manifest.outer,
        )


def dense_config(cfg: ModelConfig, width_multiplier: int = 1) -> ModelConfig:
    """A 1x1 grid with as many blocks as one path of `cfg`. Doubling the width (and heads, so the head
    size stays) gives a model with about 4x the block parameters at the same depth."""
    return dense_shape(cfg, cfg.d_model * width_multiplier, cfg.blocks_per_path)


def dense_shape(cfg: ModelConfig, d_model: int, blocks: int) -> ModelConfig:
    """A 1x1 grid of `blocks` blocks of width `d_model`, with the head size and the d_ff / d_model
    ratio of `cfg` (so only width and depth differ from a path of `cfg`)."""
    head = cfg.d_model // cfg.n_heads
    if d_model % head or (cfg.d_ff * d_model) % cfg.d_model:
        raise ValueError(f"d_model={d_model} must be a multiple of the head size {head}")
    shape = dict(d_model=d_model, d_ff=cfg.d_ff * d_model // cfg.d_model, n_heads=d_model // head)
    grid = dict(n_levels=1, modules_per_level=1, blocks_per_module=blocks, private_blocks_per_path=0)
    return ModelConfig(**{**cfg.model_dump(), **shape, **grid})


def document_batches(
    docs: Sequence[str], tokenizer: Tokenizer, seq_len: int, batch_size: int, seed: int
) -> PathBatches:
    """The swarm's own batching (packing, windows, shuffle buffer) over an already chosen shard."""
    return PathBatches(
        docs,
        lambda token_lists: [0] * len(token_lists),
        0,
        tokenizer,
        seq_len,
        batch_size,
        seed=seed,
        eval_fraction=0.0,  # the caller already kept training documents only
        shuffle_buffer=256,  # shards of a simulation are small; a peer's 1024 would delay the first batch
    )


class InnerLoop:
    """One model, its AdamW and its batches: the inner loop of a peer (`peer.training.inner`). The model
    moves to `device` before its optimizer is made; each batch follows it there."""

    def __init__(
        self,
        model: PathModel,
        batches: PathBatches,
        inner: InnerOptimizerConfig,
        total_steps: int,
        device: str | torch.device = "cpu",
    ):
        self.device = device_of(device) if isinstance(device, str) else device
        self.model = model.to(self.device)
        self.batches = batches
        self.inner = inner
        self.total_steps = total_steps
        self.opt = make_inner_optimizer(model, inner)
        self.step_count = 0
        self.tokens_since_sync = 0
        self.tokens_seen = 0  # all steps: what the benchmarks report as a model's token budget
        self.losses: list[float] = []

    def step(self) -> float:
        self.model.train()
        batch = next(self.batches).to(self.device, non_blocking=True)
        autocast = autocast_for(self.device)
        loss = inner_step(
            self.model, self.opt, batch, self.inner, self.step_count, self.total_steps, autocast
        )
        self.step_count += 1
        self.tokens_since_sync += tokens_in(batch)
        self.tokens_seen += tokens_in(batch)
        self.losses.append(loss)
        return loss


class DenseTrainer:
    """A dense model (default: the path-size 1x1 grid of `dense_config`) on all training documents,
    with the run's AdamW, schedule and batch shape. `schedule_steps` sets the cosine's length, so a
    base model for the warm start can be the first steps of the dense baseline's own run."""

    def __init__(
        self,
        cfg: SimConfig,
        docs: Sequence[str],
        tokenizer: Tokenizer,
        schedule_steps: int,
        *,
        width_multiplier: int = 1,
        model: PathModel | None = None,
        progress: bool = True,
        desc: str = "dense",
    ):
        if model is None:
            model = PathModel(dense_config(cfg.model, width_multiplier), (0,), seed=cfg.seed)
        batches = document_batches(docs, tokenizer, cfg.seq_len, cfg.batch_size, stable_seed(cfg.seed, desc))
        self.loop = InnerLoop(model, batches, cfg.inner, total_steps=schedule_steps, device=cfg.device)
        self.progress, self.desc = progress, desc

    @property
    def model(self) -> PathModel:
        return self.loop.model

    def train(self, steps: int) -> PathModel:
        with tqdm(range(steps), desc=self.desc, disable=not self.progress, leave=False) as bar:
            for i in bar:
                loss = self.loop.step()
                if i % 20 == 0:
                    bar.set_postfix(loss=f"{loss:.3f}")
        return self.model.eval()


def train_dense(
    cfg: SimConfig,
    docs: Sequence[str],
    tokenizer: Tokenizer,
    steps: int,
    *,
    width_multiplier: int = 1,
    model: PathModel | None = None,
    progress: bool = True,
    desc: str = "dense",
) -> PathModel:
    """Trains a dense model on all `docs` for `steps` inner steps (continues `model` when given)."""
    trainer = DenseTrainer(
        cfg,
        docs,
        tokenizer,
        steps,
        width_multiplier=width_multiplier,
        model=model,
        progress=progress,
        desc=desc,
    )
    return trainer.train(steps)


def warm_start_modules(cfg: ModelConfig, base: PathModel) -> ModuleStates:
    """Cuts a dense model with `cfg.blocks_per_path` blocks into the grid's modules: the trunk is
    shared, level l takes blocks [l*B, (l+1)*B) (in every module of the level) and the private
    blocks take the rest, so every path starts as an exact copy of `base`."""
    if base.cfg.blocks_per_path != cfg.blocks_per_path or base.cfg.d_model != cfg.d_model:
        raise ValueError("the base model must have the width and block count of one path")
    blocks = [b.state_dict() for mid in base.module_ids[1:] for b in base.parts[mid].blocks]
    trunk = {k: v.detach().clone() for k, v in base.parts[TRUNK].state_dict().items()}
    states: ModuleStates = {}
    for mid in all_module_ids(cfg):
        if mid == TRUNK:
            states[mid] = trunk
            continue
        if mid.startswith("l"):
            first, n = int(mid[1:].split("m")[0]) * cfg.blocks_per_module, cfg.blocks_per_module
        else:
            first, n = cfg.n_levels * cfg.blocks_per_module, cfg.private_blocks_per_path
        states[mid] = {
            f"blocks.{i}.{k}": v.detach().clone() for i in range(n) for k, v in blocks[first + i].items()
        }
    return states


@dataclass
class PathState:
    """One path of the simulated grid: its inner loop and the size of its shard."""

    index: int
    loop: InnerLoop
    docs: int


@dataclass
class DipacoSim:
    """The whole grid in one process. `train(steps)` may be called repeatedly (phases); `reshard`
    swaps the document shards between phases (the discriminative re-routing)."""

    cfg: SimConfig
    shards: Mapping[int, Sequence[str]]
    tokenizer: Tokenizer
    total_steps: int
    init: ModuleStates | None = None
    progress: bool = True
    paths: dict[int, PathState] = field(init=False)
    syncs: dict[str, ModuleSync] = field(init=False)
    holders: dict[str, list[int]] = field(init=False)
    outer_rounds: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        mcfg = self.cfg.model
        missing = [i for i in range(mcfg.n_paths) if not self.shards.get(i)]
        if missing:
            raise ValueError(f"paths {missing} have no training documents; route more documents")
        # Every local copy starts from the same global copy (the seeded init or the warm start).
        reference = GridModel(mcfg, seed=self.cfg.seed)
        if self.init is not None:
            for mid, state in self.init.items():
                reference.grid[mid].load_state_dict(state)
        self.paths, self.holders = {}, {mid: [] for mid in all_module_ids(mcfg)}
        for path in all_paths(mcfg):
            index = len(self.paths)
            local = {mid: copy.deepcopy(reference.grid[mid]) for mid in path_module_ids(mcfg, path)}
            model = PathModel(mcfg, path, modules=local)
            batches = self._batches(index, self.shards[index])
            loop = InnerLoop(model, batches, self.cfg.inner, self.total_steps, device=self.cfg.device)
            self.paths[index] = PathState(index, loop, len(self.shards[index]))
            for mid in model.module_ids:
                self.holders[mid].append(index)
        self.syncs = {
            mid: ModuleSync(
                mcfg, mid, self.paths[ids[0]].loop.model.parts[mid], self.cfg.outer, paths_through=len(ids)
            )
            for mid, ids in self.holders.items()
        }

    def _batches(self, index: int, docs: Sequence[str]) -> PathBatches:
        seed = stable_seed(self.cfg.seed, "sim-path", index, self.outer_rounds)
        return document_batches(docs, self.tokenizer, self.cfg.seq_len, self.cfg.batch_size, seed)

    def reshard(self, shards: Mapping[int, Sequence[str]]) -> None:
        for index, state in self.paths.items():
            if not shards.get(index):
                raise ValueError(f"path {index} has no training documents after re-routing")
            state.loop.batches = self._batches(index, shards[index])
            state.docs = len(shards[index])
        self.shards = shards

    def train(self, steps: int) -> None:
        """`steps` more inner steps on every path, with an outer sync every H steps and at the end."""
        h = self.cfg.inner_steps
        total = steps * len(self.paths)
        with tqdm(total=total, desc="dipaco", disable=not self.progress, leave=False) as bar:
            done = 0
            while done < steps:
                n = min(h, steps - done)
                for state in self.paths.values():
                    for _ in range(n):
                        state.loop.step()
                    bar.update(n)
                done += n
                self.outer_sync()
                losses = [s.loop.losses[-1] for s in self.paths.values()]
                bar.set_postfix(round=self.outer_rounds, loss=f"{sum(losses) / len(losses):.3f}")

    @torch.no_grad()
    def outer_sync(self) -> None:
        """One outer round for every module, as its holders would do it after an exact all-reduce.
        Σ wᵢ(θ̄ − θᵢ) = θ̄ − Σ wᵢθᵢ, so the first holder's local copy is set to the token-weighted mean
        of the holders' copies and `ModuleSync` computes the averaged Δ from it, steps and loads θ̄."""
        for mid, ms in self.syncs.items():
            ids = self.holders[mid]
            weights = torch.tensor(
                [max(1, self.paths[i].loop.tokens_since_sync) for i in ids], dtype=torch.float64
            )
            weights = (weights / weights.sum()).tolist()
            locals_ = [list(self.paths[i].loop.model.parts[mid].parameters()) for i in ids]
            if len(ids) > 1:
                for j, target in enumerate(locals_[0]):
                    mean = sum(
                        w * params[j].detach().double() for w, params in zip(weights, locals_, strict=True)
                    )
                    target.copy_(mean.to(target.dtype))
            for f in range(ms.n_fragments):
                ms.apply(f, ms.outer_gradient(f))  # also loads θ̄ into the first holder's local copy
            for params in locals_[1:]:
                for p, q in zip(params, locals_[0], strict=True):
                    p.copy_(q)
        for state in self.paths.values():
            state.loop.tokens_since_sync = 0
        self.outer_rounds += 1

    def global_state(self) -> dict[str, torch.Tensor]:
        """The global copies as a peer checkpoint names them: "{module_id}/global/{param}"."""
        out: dict[str, torch.Tensor] = {}
        for ms in self.syncs.values():
            out.update({k: v.detach().clone() for k, v in ms.named_state().items() if "/global/" in k})
        return out

    def grid(self) -> GridModel:
        """A GridModel holding the global copies (what the checkpoints of the swarm hold), on the
        simulation's device so that scoring it runs there too."""
        grid = GridModel(self.cfg.model, seed=self.cfg.seed)
        state = self.global_state()
        with torch.no_grad():
            for mid, module in grid.grid.items():
                for name, p in module.named_parameters():
                    p.copy_(state[f"{mid}/global/{name}"])
        return grid.to(device_of(self.cfg.device)).eval()

    def path_model(self, index: int) -> PathModel:
        return self.paths[index].loop.model


def train_dipaco(
    cfg: SimConfig,
    shards: Mapping[int, Sequence[str]],
    tokenizer: Tokenizer,
    steps_per_path: int,
    *,
    init: ModuleStates | None = None,
    progress: bool = True,
) -> DipacoSim:
    """Trains every path for `steps_per_path` inner steps; returns the simulation (`.grid()`)."""
    sim = DipacoSim(cfg, shards, tokenizer, steps_per_path, init=init, progress=progress)
    sim.train(steps_per_path)
    return sim
