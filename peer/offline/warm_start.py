"""A run's base model, made when the run is created: DiPaCo's warm start (peer/model/base.py says why).

`run create --warm_start_steps N` trains a dense model of one path's size on the run's training
documents; `--base_checkpoint FILE` takes one made before. Either way the base is checked against the
run's model shape and stored as a content-addressed artifact (peer/artifacts/) beside the manifest.
"""

from __future__ import annotations

import logging
import tempfile
import time
from itertools import islice
from pathlib import Path

from peer.artifacts.ref import ArtifactRef
from peer.artifacts.store import ArtifactStore
from peer.config import InnerOptimizerConfig
from peer.data.sources import DatasetSpec, load_documents, split_of
from peer.errors import ConfigError
from peer.model.base import ModuleStates, base_module_ids, load_base, save_base
from peer.model.grid import ModelConfig
from peer.model.tokenizer import Tokenizer
from peer.offline.simulate import DenseTrainer, SimConfig, warm_start_modules
from peer.run.create import RunOptions

logger = logging.getLogger(__name__)

#: training documents a base model is trained on at most (streamed; a hub corpus is not read whole)
WARM_START_MAX_DOCS = 50_000


def make_base(
    o: RunOptions,
    model: ModelConfig,
    dataset: DatasetSpec,
    tok: Tokenizer,
    artifacts_dir: Path,
    inner: InnerOptimizerConfig,
) -> tuple[ModuleStates, ArtifactRef]:
    """The run's base model: `--base_checkpoint` checked against the model shape, or a dense model
    of one path's size trained `--warm_start_steps` on the run's training documents (the run's AdamW,
    `inner`, with its cosine over the base's own steps) and cut into path 0's modules. Stored as an
    artifact."""
    store = ArtifactStore(artifacts_dir)
    if o.base_checkpoint:
        source = Path(o.base_checkpoint)
        base = load_base(source, model)
        return base, store.add_file(source, "base")
    docs = islice(load_documents(dataset), WARM_START_MAX_DOCS)
    docs = [d for d in docs if split_of(d, dataset) == "train"]
    if not docs:
        raise ConfigError("the run's dataset has no training documents to train a base model on")
    sim = SimConfig(
        model=model, seed=o.seed, seq_len=o.seq_len, batch_size=o.warm_start_batch_size, inner=inner
    )
    started = time.monotonic()
    dense = DenseTrainer(sim, docs, tok, o.warm_start_steps, desc="base model").train(o.warm_start_steps)
    states = warm_start_modules(model, dense)
    base = {mid: states[mid] for mid in base_module_ids(model)}
    logger.info(
        f"trained the base model {o.warm_start_steps} steps on {len(docs)} documents "
        f"in {time.monotonic() - started:.0f}s"
    )
    artifacts_dir.mkdir(parents=True, exist_ok=True)  # the temporary file goes beside the store
    with tempfile.NamedTemporaryFile(dir=artifacts_dir, suffix=".safetensors") as tmp:
        save_base(base, Path(tmp.name))
        return base, store.add_file(Path(tmp.name), "base")
