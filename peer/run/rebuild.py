"""What every peer rebuilds from a run manifest alone: the tokenizer and the routing function.

The router travels inside the manifest, or beside it as a file named by hash (fetched like any
artifact), and its features come from the run's *initial* path-0 model:
the base model the manifest names by hash (fetched like any artifact), or without one the model whose
weights follow from the run seed. Either way every peer routes every document to the same path.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from peer.artifacts.store import require_artifact
from peer.config import RunManifest
from peer.errors import ConfigError
from peer.model.base import ModuleStates
from peer.model.route import Route, feature_model, route_function
from peer.model.router import Router
from peer.model.tokenizer import Tokenizer, load_tokenizer


def router_of(manifest: RunManifest, folders: Sequence[Path] = ()) -> Router:
    """The run's router: inline in the manifest, or its `router_file` from the first of `folders`
    (artifact folders) that holds it."""
    ref = manifest.router_file
    if ref is None:
        return Router.from_json(json.dumps(manifest.router))
    path = require_artifact(ref, folders, "the run's router")
    try:
        return Router.from_json(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"the run's router file {path} is unreadable: {type(e).__name__}: {e}") from None


def make_route(
    manifest: RunManifest,
    base: ModuleStates | None = None,
    folders: Sequence[Path] = (),
    router: Router | None = None,
) -> Route:
    """The routing function every peer of the run shares; `base` is the run's base model, which a
    run that names one must pass (its router was fitted on the base's features); `folders`: where a
    router file is (see `router_of`); `router`: a later router version (peer/run/router_versions.py)
    instead of the manifest's, over the same features."""
    if (base is None) != (manifest.base_checkpoint is None):
        raise ConfigError("the router of a run with a base model needs the base, and only then")
    router = router if router is not None else router_of(manifest, folders)
    return route_function(router, feature_model(manifest.model, manifest.seed, base))


def check_tokenizer(manifest: RunManifest, folders: Sequence[Path] = ()) -> Tokenizer:
    """The run's tokenizer, refused when it is not the file the run was created with. A run whose
    tokenizer is a file names it by hash: it is read from the first of `folders` (artifact folders)
    that holds it."""
    ref = manifest.tokenizer_file
    if ref is None:
        tok = load_tokenizer(manifest.tokenizer)
    else:
        tok = load_tokenizer(str(require_artifact(ref, folders, "the run's tokenizer")))
    if manifest.tokenizer_fingerprint and tok.fingerprint != manifest.tokenizer_fingerprint:
        raise ConfigError(f"tokenizer {manifest.tokenizer!r} differs from the one the run was created with")
    return tok
