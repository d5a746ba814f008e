"""Following the run's router versions: DiPaCo's discriminative re-routing live (`RouterFollower`).

Once per outer round the peer reads the run's router versions from the DHT (peer/run/router_versions.py:
signed by the run's creator, refused otherwise), on a thread of its own: a round's end takes the answer
of the read started at the one before, so the training thread never waits for the DHT (that wait was
3–8% of the goodput benchmark's loop, docs/benchmarks/goodput.md) and a switch is seen at most a
round late. At its first round boundary at or after a newer
version's switch round it fetches the router file by hash, re-reads its path's data shard routed by
it, and re-publishes the record so the version outlives the tool that published it. Which documents
a path trains on never touches what is averaged, so peers switching a round apart stay consistent.
A peer that joins after a re-route starts with the latest version that is due.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import hivemind
from hivemind.utils.crypto import RSAPrivateKey

from dht.keys import ROUTER_TTL_SECONDS
from dht.schema import ManifestRecord, RouterRecord
from dht.serve_limits import ServeLimits
from monitoring.metrics import PeerMetrics
from peer.artifacts.store import ArtifactError, ArtifactStore
from peer.artifacts.transfer import ArtifactService
from peer.config import PeerConfig, RunManifest
from peer.errors import ConfigError
from peer.faults import fault_point
from peer.model.base import ModuleStates
from peer.model.route import Route
from peer.run.rebuild import make_route
from peer.run.router_versions import (
    RouterVersion,
    latest_router_version,
    publish_router_record,
    read_router,
)
from peer.swarm.base_model import default_artifacts_dir, obtain_artifact, run_folder_store

logger = logging.getLogger(__name__)


class RouterFollower:
    """A peer's route: the one its data shard is read with, and the switch to a newer router version.

    The peer asks `route()` when it reads its shard and `due()` at every round's end; a route from
    `due()` means "re-read your shard with it". What to do with the answer is the peer's business.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        key: RSAPrivateKey,
        config: PeerConfig,
        manifest: RunManifest,
        record: ManifestRecord,
        base: ModuleStates | None,
        artifacts: ArtifactService | None,
        metrics: PeerMetrics,
    ):
        """`artifacts`: the peer's artifact service, None in a run whose manifest names no artifact;
        a router version then starts one here, which the peer takes over from `artifacts`."""
        self.dht, self.key, self.config = dht, key, config
        self.manifest, self.record, self.base = manifest, record, base
        self.artifacts = artifacts
        self.metrics = metrics
        self._route: Route | None = None
        #: the router version we route with; None: the manifest's own router
        self.version: RouterVersion | None = None
        self._announced_due = 0  # the version whose "due at round" line was logged
        self._published_at = 0.0
        self._reading: Future | None = None  # the background read of the versions, if one was started
        # One thread for every read of the run, started at the first: a thread started at every
        # round's end cost the training thread 0.6-0.9% of its time in the goodput benchmark (the
        # start waits for the new thread to run, a scheduler slice on a busy machine).
        self._reader: threading.Thread | None = None
        self._reads: queue.SimpleQueue[Future | None] = queue.SimpleQueue()

    def route(self, outer_round: int, path_index: int) -> Route:
        """The route to read our path's shard with: the latest version due by now, else the manifest's."""
        if self._route is None and not self._switch(outer_round, path_index, self._read()):
            self._route = make_route(self.manifest, self.base, self.folders())
        return self._route

    def due(self, outer_round: int, path_index: int) -> Route | None:
        """At a round boundary: the route of a newer router version that is due, else None. Uses what
        the read started at the previous boundary found, and starts the next read."""
        if self._reading is not None and not self._reading.done():
            return None  # a slow DHT: one read at a time, the next boundary looks again
        found = self._reading.result() if self._reading is not None else None
        self._reading = Future()
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_each, name="router-versions", daemon=True)
            self._reader.start()
        self._reads.put(self._reading)
        return self._route if self._switch(outer_round, path_index, found) else None

    def _read_each(self) -> None:
        """The reader thread: answers each read `due` asks for, until `shutdown`."""
        while (reading := self._reads.get()) is not None:
            reading.set_result(self._read())

    def shutdown(self, timeout_seconds: float = 10.0) -> None:
        """Waits (bounded) for a read still in flight, before the DHT it reads goes down: a read thread
        left running into the interpreter's exit was killed inside torch (hivemind's futures keep their
        state in shared tensors) and the process aborted ("terminate called without an active
        exception") after a clean run. No read starts after this."""
        self._reading = Future()  # never done: `due` starts none from now on
        if self._reader is not None:
            self._reads.put(None)
            self._reader.join(timeout=timeout_seconds)
            if self._reader.is_alive():
                logger.warning(f"the read of the router versions did not end in {timeout_seconds:.0f} s")

    @property
    def version_number(self) -> int:
        """The router version we route with; 0: the manifest's own router."""
        return self.version.router_version if self.version is not None else 0

    def meta(self) -> dict:
        """What a checkpoint says about the router it trained with (`pathswarm eval` routes alike)."""
        v = self.version
        return (
            {}
            if v is None
            else {"router_version": v.router_version, "router_file": v.router_file.model_dump()}
        )

    def folders(self) -> list[Path]:
        """Where the run's artifacts (base model, router files, shards) lie on this machine."""
        return [self.artifacts.store.root] if self.artifacts is not None else []

    def _read(self) -> tuple[RouterVersion, RouterRecord, int] | None:
        try:
            fault_point("router.read")
            return latest_router_version(self.dht, self.config.run_name, self.record)
        except Exception as e:  # reading the DHT must never stop the training
            logger.warning(f"could not read the run's router versions: {type(e).__name__}: {e}")
            return None

    def _switch(self, outer_round: int, path_index: int, found: tuple | None) -> bool:
        if found is None:
            return False
        version, record, _ = found
        current = self.version_number
        if version.router_version <= current:
            if version.router_version == current:  # keep the version alive after its publisher left
                self._republish(record)
            return False
        if outer_round < version.switch_round:
            if self._announced_due != version.router_version:
                self._announced_due = version.router_version
                logger.info(f"router version {version.router_version} is due at round {version.switch_round}")
            return False
        try:
            router = read_router(self._fetch(version), f"router version {version.router_version}")
            route = make_route(self.manifest, self.base, self.folders(), router=router)
        except (ArtifactError, ConfigError) as e:
            logger.warning(f"router version {version.router_version}: {e}; keeping ours, trying next round")
            return False
        self._route, self.version = route, version
        self._republish(record, now=True)
        logger.info(
            f"router version {version.router_version} from round {outer_round} (due at round "
            f"{version.switch_round}): path {path_index}'s data is re-routed"
        )
        self.metrics.set_router_version(version.router_version)
        return True

    def _republish(self, record, now: bool = False) -> None:
        if now or time.monotonic() - self._published_at > ROUTER_TTL_SECONDS / 3:
            if publish_router_record(self.dht, self.key, self.config.run_name, record):
                self._published_at = time.monotonic()

    def _fetch(self, version: RouterVersion) -> Path:
        cfg = self.config
        if self.artifacts is None:  # a run without artifacts in its manifest has no service yet
            store = ArtifactStore(cfg.artifacts_dir or default_artifacts_dir(cfg.checkpoint_dir))
            self.artifacts = ArtifactService(self.dht, store, ServeLimits(cfg.serve_limits()))
        what = f"router version {version.router_version}"
        local = [run_folder_store(cfg.manifest_path)]
        path = obtain_artifact(
            self.artifacts,
            self.dht,
            (cfg.run_name, self.record.run_id),
            version.router_file,
            local,
            what,
            progress=False,
        )
        self.artifacts.publish(self.dht, self.key, cfg.run_name, self.record.run_id)
        return path
