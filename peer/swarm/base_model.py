"""Getting a run's artifacts (its base model, its data shards): from a local copy, or by hash from
the peers that serve them.

A peer looks in its own artifact folder first, then beside the manifest it was given (where
`pathswarm run create` writes them), then asks the DHT who serves each and fetches it
(peer/artifacts/transfer.py). Whatever it got, it then serves too, so a run's artifacts outlive its
creator. Offline commands (eval, generate, the demo's check) only look on disk.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import hivemind
from tqdm import tqdm

from dht.serve_limits import ServeLimits
from peer.artifacts.ref import MAX_ARTIFACT_BYTES, ArtifactRef
from peer.artifacts.room import check_room
from peer.artifacts.store import ArtifactError, ArtifactStore, require_artifact
from peer.artifacts.transfer import ArtifactService, providers
from peer.config import PeerConfig, RunManifest
from peer.model.base import ModuleStates, load_base
from peer.run.routing_index import INDEX_SOURCES_SECONDS

logger = logging.getLogger(__name__)

#: how long a peer looks for a source of the base before it gives up (a DHT record can lag a start)
FIND_SOURCES_SECONDS = 60.0
ARTIFACTS_SUBDIR = "artifacts"
#: above this many data shards a peer logs one line and shows one progress bar for all of them
MANY_SHARDS = 8


def default_artifacts_dir(checkpoint_dir: Path | None) -> Path:
    # inside the peer's own (locked) checkpoint folder: two peers never write one partial file
    if checkpoint_dir is not None:
        return Path(checkpoint_dir) / ARTIFACTS_SUBDIR
    return Path.home() / ".cache" / "pathswarm" / ARTIFACTS_SUBDIR


def run_folder_store(manifest_path: Path | None) -> ArtifactStore | None:
    """Where `run create` put the run's artifacts: beside its manifest."""
    return ArtifactStore(Path(manifest_path).parent / ARTIFACTS_SUBDIR) if manifest_path else None


def _adopt(store: ArtifactStore, other: ArtifactStore | None, ref: ArtifactRef) -> bool:
    """Copies the artifact in from `other` if it is there and is the manifest's."""
    if other is None or other.root == store.root or not other.path(ref.sha256).is_file():
        return False
    got = store.add_file(other.path(ref.sha256), ref.name, ref.chunk_bytes)
    if got.sha256 != ref.sha256 or got.chunks_sha256 != ref.chunks_sha256:
        raise ArtifactError(f"{other.path(ref.sha256)} is not the run's {ref.name} (its sha256 differs)")
    return True


def obtain_artifact(
    service: ArtifactService,
    dht: hivemind.DHT,
    run: tuple[str, str],
    ref: ArtifactRef,
    local: list[ArtifactStore | None],
    what: str,
    progress: bool = True,
    quiet: bool = False,
    find_seconds: float = FIND_SOURCES_SECONDS,
) -> Path:
    """One of the run's artifacts (`what` names it in messages), from a local copy or fetched from
    the peers that serve it (looked for `find_seconds`), checked against the manifest's hashes;
    offered to other peers from now on. `run`: (name, id)."""
    store = service.store
    if not store.has(ref) and not any(_adopt(store, other, ref) for other in local):
        deadline, last = time.monotonic() + find_seconds, "no peer offers it yet"
        while not store.has(ref):
            sources = providers(dht, run[0], run[1], ref.sha256)
            if sources:
                mib = ref.size_bytes / 2**20
                log = logger.debug if quiet else logger.info
                log(f"fetching {what} ({mib:.1f} MiB) from {len(sources)} peer(s)")
                try:
                    service.fetch(ref, sources, progress)
                    break
                except ArtifactError as e:
                    last = str(e)
            if time.monotonic() > deadline:
                raise ArtifactError(
                    f"could not get {what} {ref.sha256[:12]}… ({last}); it is served by any node started "
                    "with the run's --manifest_path and the artifacts folder beside it"
                )
            time.sleep(3.0)
    service.offer(ref)
    return store.path(ref.sha256)


def run_artifacts(manifest: RunManifest) -> list[tuple[str, ArtifactRef]]:
    """Every artifact the manifest names, with the field that names it."""
    named = [
        (field, ref)
        for field, ref in (
            ("base_checkpoint", manifest.base_checkpoint),
            ("tokenizer_file", manifest.tokenizer_file),
            ("router_file", manifest.router_file),
            ("routing_index", manifest.routing_index),
        )
        if ref is not None
    ]
    return named + [("dataset.shards", ref) for ref in manifest.dataset.shards]


def start_artifact_service(
    dht: hivemind.DHT, key, config: PeerConfig, manifest: RunManifest, run_id: str, limits: ServeLimits
) -> tuple[ArtifactService, ModuleStates | None]:
    """A peer's artifact service with the run's base model (returned, loaded), tokenizer and router
    files and data shards in it, each fetched if need be, offered and published."""
    store = ArtifactStore(config.artifacts_dir or default_artifacts_dir(config.checkpoint_dir))
    # before anything is fetched or even a folder made: the sizes are the signed manifest's claim
    check_room(store, run_artifacts(manifest))
    service = ArtifactService(dht, store, limits)
    local = [run_folder_store(config.manifest_path)]
    run = (manifest.name, run_id)
    try:
        base = None
        if manifest.base_checkpoint is not None:
            path = obtain_artifact(service, dht, run, manifest.base_checkpoint, local, "the run's base model")
            base = load_base(path, manifest.model)
        for what, ref in (
            ("the run's tokenizer", manifest.tokenizer_file),
            ("the run's router", manifest.router_file),
        ):
            if ref is not None:
                obtain_artifact(service, dht, run, ref, local, what)
        if manifest.routing_index is not None:  # a speed-up: without it the peer routes for itself
            try:
                obtain_artifact(service, dht, run, manifest.routing_index, local, "the run's routing index",
                                find_seconds=INDEX_SOURCES_SECONDS)  # fmt: skip
            except ArtifactError as e:
                logger.warning(f"{e}: routing every document here")
        shards = manifest.dataset.shards
        many = len(shards) > MANY_SHARDS  # one line and one progress bar, not one per shard
        if many:
            missing = [r for r in shards if not store.has(r)]
            mib = sum(r.size_bytes for r in missing) / 2**20
            logger.info(f"the run's data: {len(shards)} shards, {len(missing)} to get ({mib:.1f} MiB)")
        for i, ref in enumerate(tqdm(shards, desc="data shards", unit="shard", disable=not many)):
            what = f"data shard {i + 1}/{len(shards)} ({ref.name})"
            obtain_artifact(service, dht, run, ref, local, what, progress=not many, quiet=many)
        service.publish(dht, key, config.run_name, run_id)
    except BaseException:
        service.shutdown()
        raise
    return service, base


def base_on_disk(manifest: RunManifest, folders: list[Path]) -> ModuleStates | None:
    """The run's base from the first of `folders` (artifact folders) that has it; None for a run
    without a base. Offline commands use this: they never fetch."""
    ref = manifest.base_checkpoint
    if ref is None:
        return None
    # hashed whatever its size: a base is read once per command, and weights are what it changes
    path = require_artifact(ref, folders, "this run's base model", rehash_up_to_bytes=MAX_ARTIFACT_BYTES)
    return load_base(path, manifest.model)
