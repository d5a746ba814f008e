"""Creating a run: from the flags of `pathswarm run create` to a manifest with a fitted router.

`RunOptions` holds what a researcher chooses (grid, preset, data, tokenizer, sync settings), each
declared once (peer/run/options.py); `manifest_from_options` turns them into the model shape, the
dataset spec and the manifest's sections, and `build_manifest` fits the router on the run's data
and fills in the manifest. The router's features come from the run's initial path-0 model
(`peer.model.route.feature_model`), so every peer can rebuild them from the manifest alone
(`peer.run.rebuild`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from tqdm import tqdm

from peer.artifacts.ref import ArtifactRef
from peer.artifacts.store import ArtifactStore
from peer.codecs.specs import codec_spec
from peer.config import InnerOptimizerConfig, OuterOptimizerConfig, RunManifest, SyncConfig, one_line
from peer.data.batches import encode_document
from peer.data.files import fingerprints
from peer.data.sources import DatasetSpec, load_documents, local_files, split_of
from peer.errors import ConfigError
from peer.model.base import ModuleStates
from peer.model.grid import ModelConfig, model_config_from_preset
from peer.model.route import feature_model, prefix_features
from peer.model.router import fit_router, rebalance, share_ratio
from peer.model.tokenizer import Tokenizer, load_tokenizer
from peer.run.options import RunOptions, manifest_settings
from peer.run.routing_index import build_run_index

logger = logging.getLogger(__name__)

#: a router whose JSON is larger goes beside the manifest as an artifact (the manifest is a DHT
#: record, capped at 48 KiB)
INLINE_ROUTER_BYTES = 16 << 10


def parse_grid(text: str) -> tuple[int, int]:
    """ "LxK" -> (levels, modules per level), within the grid caps (peer/model/grid.py)."""
    try:
        levels, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--grid {text!r}: expected LxK, e.g. 2x2") from None
    try:  # the caps are ModelConfig's; checked here so that the message names the flag
        ModelConfig(n_levels=levels, modules_per_level=k)
    except ValidationError as e:
        raise ConfigError(f"--grid {text}: {one_line(e)}") from None
    return levels, k


#: makes a run's base model from its options, model shape, dataset and tokenizer: (states, artifact)
BaseMaker = Callable[[RunOptions, ModelConfig, DatasetSpec, Tokenizer], tuple[ModuleStates, ArtifactRef]]


def share_dataset(dataset: DatasetSpec, store: ArtifactStore) -> DatasetSpec:
    """The dataset with its local files copied into `store` and named by hash, in the same order:
    peers fetch them from whoever serves the run (`--share_data`) instead of needing a copy."""
    if dataset.kind not in ("text", "json", "parquet"):
        raise ConfigError(f"--share_data shares local files; a {dataset.kind!r} dataset has none")
    files = local_files(dataset)
    refs = []
    for i, file in enumerate(tqdm(files, desc="data shards", unit="file", disable=len(files) < 20)):
        refs.append(store.add_file(Path(file), f"{i:05d}-{Path(file).name}"[:128]))
    total = sum(r.size_bytes for r in refs)
    logger.info(f"the run's data: {len(refs)} shards, {total / 2**20:.1f} MiB, named by hash in {store.root}")
    try:
        return DatasetSpec(**{**dataset.model_dump(), "data_files": [], "fingerprints": [], "shards": refs})
    except ValidationError as e:
        raise ConfigError(f"--share_data: {one_line(e)}") from None


def manifest_from_options(
    options: RunOptions, base_maker: BaseMaker | None = None, store: ArtifactStore | None = None
) -> RunManifest:
    """Model shape from the preset and grid, the dataset spec and sync settings, the base model (if
    asked for, from `base_maker`: `peer.offline.warm_start.make_base`), then the router; with
    `--share_data`, the data files go into `store` (the run folder's artifacts) by hash."""
    o = options
    levels, k = parse_grid(o.grid)
    tok = load_tokenizer(o.tokenizer)
    try:
        model = model_config_from_preset(
            o.preset,
            n_levels=levels,
            modules_per_level=k,
            private_blocks_per_path=o.private_blocks,
            vocab_size=tok.vocab_size,
            **({"blocks_per_module": o.blocks_per_module} if o.blocks_per_module else {}),
        )
        settings = manifest_settings(o)
        dataset = DatasetSpec(**settings.pop("dataset"), seed=o.seed)
        sync = SyncConfig(**settings.pop("sync"))
        outer = OuterOptimizerConfig(**settings.pop("outer"), nesterov=o.outer_momentum > 0)
        inner = InnerOptimizerConfig(**settings.pop("inner"))
    except ValidationError as e:
        raise ConfigError(one_line(e)) from None
    # sparse codecs only: a dense one (dense2bit) sends every coordinate, so DiLoCo's step suits it
    if codec_spec(o.codec).topk and (outer.momentum > 0 or sync.mixing_alpha > 0):
        # benchmarks/sparse_outer.py: with DiLoCo's outer step the sparse codec's global copy ended
        # at 1.27x DiLoCo's loss; without momentum, with α = 0 and a larger lr at 1.06-1.08x
        logger.warning(
            f"codec {o.codec} with outer momentum {outer.momentum:g} and α = {sync.mixing_alpha:g}: a "
            "group's mean of top-k parts moves each coordinate by the share of holders that sent it, so "
            "DiLoCo's outer step learns slowly; measured better: --outer_momentum 0 --mixing_alpha 0 "
            "--outer_lr about 2 x the holders per module (docs/benchmarks/wan.md)"
        )
    base = base_ref = None
    if o.warm_start_steps or o.base_checkpoint:
        if o.warm_start_steps and o.base_checkpoint:
            raise ConfigError("give --warm_start_steps or --base_checkpoint, not both")
        if base_maker is None:
            raise ConfigError("this caller cannot make a base model")
        base, base_ref = base_maker(o, model, dataset, tok)
    if o.share_data and store is None:
        raise ConfigError("this caller cannot share the run's data")
    shared = share_dataset(dataset, store) if o.share_data else None
    # a tokenizer file travels by hash too: volunteers do not have it at the creator's path
    tokenizer_ref = None
    if o.tokenizer != "bytes" and store is not None:
        tokenizer_ref = store.add_file(tok.path, "tokenizer.json")
    for name in ("name", "seed", "seq_len", "tokenizer"):
        settings.pop(name)
    manifest = build_manifest(
        o.name, model, dataset, seed=o.seed, seq_len=o.seq_len, sync=sync, inner=inner, outer=outer,
        tokenizer=o.tokenizer,
        base=base, base_ref=base_ref, tokenizer_ref=tokenizer_ref, sections=settings,
    )  # fmt: skip
    update = {}
    if shared is not None:  # the router and base were fitted on the same files, read by path
        update["dataset"] = shared
    # routed once here for every peer (the manifest's router is still inline: the route reads it)
    index = build_run_index(manifest, tok, store, o.routing_index_documents, base) if store else None
    if index is not None:
        update["routing_index"] = index
    # the router by hash, when someone serves the run's artifacts anyway or it is big: the manifest
    # stays a small DHT record. A run with nothing else to serve keeps a small router inline, so its
    # peers need no node that holds the run folder (one that cannot get the index routes for itself).
    served = base_ref is not None or tokenizer_ref is not None or shared is not None
    if store is not None and (served or len(json.dumps(manifest.router)) > INLINE_ROUTER_BYTES):
        update["router"], update["router_file"] = {}, router_artifact(manifest.router, store)
    return RunManifest.model_validate({**manifest.model_dump(), **update}) if update else manifest


def router_artifact(router: dict, store: ArtifactStore) -> ArtifactRef:
    """The router's JSON as an artifact in `store`."""
    store.root.mkdir(parents=True, exist_ok=True)
    tmp = store.root / "router.json.tmp"
    try:
        tmp.write_text(json.dumps(router, sort_keys=True, separators=(",", ":")))
        return store.add_file(tmp, "router.json")
    except OSError as e:
        raise ConfigError(f"cannot write the router beside the manifest: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def build_manifest(
    name: str,
    model: ModelConfig,
    dataset: DatasetSpec,
    *,
    seed: int = 0,
    seq_len: int = 64,
    inner: InnerOptimizerConfig | None = None,
    outer: OuterOptimizerConfig | None = None,
    sync: SyncConfig | None = None,
    tokenizer: str = "bytes",
    router_docs: int = 1000,
    router_kind: str = "product_kmeans",
    base: ModuleStates | None = None,
    base_ref: ArtifactRef | None = None,
    tokenizer_ref: ArtifactRef | None = None,
    sections: dict[str, Any] | None = None,
) -> RunManifest:
    """Fits the router on up to `router_docs` training documents and returns the full manifest; H is
    `sync.inner_steps`. `sections`: the manifest's other settings (those `run create` passes on)."""
    tok = load_tokenizer(tokenizer)
    if tok.vocab_size > model.vocab_size:
        raise ConfigError(f"tokenizer has {tok.vocab_size} tokens but model.vocab_size is {model.vocab_size}")
    sample = list(islice(load_documents(dataset), router_docs * 2))
    if dataset.data_files and not dataset.fingerprints:
        # what every peer's copy of the files must be (peer/training/startup_checks.py)
        try:
            dataset = DatasetSpec(
                **{**dataset.model_dump(), "fingerprints": fingerprints(local_files(dataset))}
            )
        except ValidationError as e:
            raise ConfigError(f"the run's data files: {one_line(e)}") from None
    docs = [d for d in sample if split_of(d, dataset) == "train"][:router_docs]
    # the first held-out documents, those eval scores first: the router's biases balance them too
    held = [d for d in sample if split_of(d, dataset) == "eval"]
    if len(docs) < model.n_paths * 4:
        raise ConfigError(f"only {len(docs)} training documents to fit a router for {model.n_paths} paths")
    started = time.monotonic()
    extractor = feature_model(model, seed, base)  # DiPaCo routes with the base model's features
    features = prefix_features(extractor, [encode_document(tok, d) for d in docs])
    kind = router_kind if model.n_levels > 1 else "kmeans"
    router = fit_router(features, model.n_levels, model.modules_per_level, kind=kind, seed=seed)
    logger.info(f"fitted a {kind} router on {len(docs)} documents in {time.monotonic() - started:.1f}s")
    if held:
        held_features = prefix_features(extractor, [encode_document(tok, d) for d in held])
        before = share_ratio(router, held_features)
        # balanced on the training documents alone, a small held-out split can come out far less
        # even (2.25x on the README's run): the biases balance both sets at once. Only which path
        # a document goes to changes, never what a path learns.
        router = rebalance(router, [features, held_features])
        logger.info(
            f"router balance (largest path's share / smallest's): held-out {before:.2f}x -> "
            f"{share_ratio(router, held_features):.2f}x ({len(held)} documents), training "
            f"{share_ratio(router, features):.2f}x"
        )
    manifest = dict(
        name=name,
        seed=seed,
        model=model,
        seq_len=seq_len,
        inner=inner or InnerOptimizerConfig(),
        outer=outer or OuterOptimizerConfig(),
        sync=sync or SyncConfig(),
        dataset=dataset,
        tokenizer=tokenizer,
        tokenizer_fingerprint=tok.fingerprint,
        router=json.loads(router.to_json()),
        base_checkpoint=base_ref,
        tokenizer_file=tokenizer_ref,
        created_at=time.time(),
        **(sections or {}),
    )
    try:
        return RunManifest(**manifest)
    except ValidationError as e:
        raise ConfigError(f"invalid run: {one_line(e)}") from None
