"""The run's routing index: where each document of its corpus goes, routed once by the run's creator.

Every peer needs to know which documents are its path's, and finding out is a prefix forward pass
of the feature model per document (peer/model/route.py), about one for every path's document it
trains on its own. DiPaCo routes its corpus into shards once, before training (Douillard et al.
2024). `pathswarm run create` does the same for the first `--routing_index_documents` documents of a
run's local or built-in corpus (`build_run_index`): an index file (peer/data/routed.py's records:
position, the text's hash, the path) that the manifest names by hash, fetched and served like the
run's other artifacts. A peer reads it before its own index, and a record counts only where the
text at its position still has the recorded hash. Without it, or past its end, each peer routes
for itself as before; a peer that cannot get it in `INDEX_SOURCES_SECONDS` goes on without it.

The creator's pass costs what one peer's first pass costs (0.15 ms a document on one core at the
tiny preset): 15 s per 100,000 documents, shown with a progress bar. A hub dataset, streamed, is not
indexed.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

from peer.artifacts.ref import ArtifactRef
from peer.artifacts.store import ArtifactError, ArtifactStore, find_artifact
from peer.config import RunManifest
from peer.data.batches import encode_document
from peer.data.routed import RECORD, build_index
from peer.data.sources import load_documents
from peer.errors import ConfigError
from peer.model.base import ModuleStates
from peer.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: how long a peer looks for a source of the index before it routes for itself
INDEX_SOURCES_SECONDS = 10.0
INDEX_NAME = "routing_index.bin"


def build_run_index(
    manifest: RunManifest,
    tokenizer: Tokenizer,
    store: ArtifactStore,
    max_documents: int,
    base: ModuleStates | None = None,
) -> ArtifactRef | None:
    """The run's routing index over its first `max_documents` documents, added to `store`; None for a
    hub dataset or `max_documents` 0. `manifest` carries its router inline; `base`: the run's base
    model, whose features the router scores."""
    if max_documents <= 0 or manifest.dataset.kind == "hub":
        return None
    from peer.run.rebuild import make_route  # the feature model: torch, kept off the import path

    route = make_route(manifest, base)
    tmp = store.root / f"{INDEX_NAME}.tmp"
    started = time.monotonic()
    try:
        store.root.mkdir(parents=True, exist_ok=True)
        encode = functools.partial(encode_document, tokenizer)
        n = build_index(route, manifest.dataset.eval_fraction, load_documents(manifest.dataset), encode,
                        tmp, max_documents)  # fmt: skip
        ref = store.add_file(tmp, INDEX_NAME)
    except (OSError, ArtifactError) as e:
        raise ConfigError(f"cannot write the run's routing index beside the manifest: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    logger.info(
        f"routed {n} documents for every peer in {time.monotonic() - started:.1f}s "
        f"(the routing index, {ref.size_bytes // RECORD.itemsize} records)"
    )
    return ref


def with_run_index(manifest: RunManifest, store: ArtifactStore, max_documents: int) -> RunManifest:
    """`manifest` (with its router inline, no base model) naming its routing index, written into
    `store` (the run folder's artifacts): what `run create` makes, for callers that build a manifest
    themselves (the demo, benchmarks)."""
    from peer.run.rebuild import check_tokenizer

    index = build_run_index(manifest, check_tokenizer(manifest), store, max_documents)
    if index is None:
        return manifest
    return RunManifest.model_validate({**manifest.model_dump(), "routing_index": index})


def run_index_file(manifest: RunManifest, folders: list[Path]) -> Path | None:
    """The run's routing index from the first of `folders` (artifact folders) that has it, if the run
    has one; None where none has it (the peer routes for itself) or a file there is not the run's."""
    ref = manifest.routing_index
    if ref is None:
        return None
    try:
        return find_artifact(ref, folders)
    except ArtifactError as e:
        logger.warning(f"{e}: routing every document here")
        return None
