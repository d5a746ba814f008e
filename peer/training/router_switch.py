"""Following the run's router versions (`Peer` inherits it): DiPaCo's discriminative re-routing live.

Once per outer round the peer reads the run's router versions from the DHT (peer/run/router_versions.py:
signed by the run's creator, refused otherwise). At its first round boundary at or after a newer
version's switch round it fetches the router file by hash, re-reads its path's data shard routed by
it, and re-publishes the record so the version outlives the tool that published it. Which documents
a path trains on never touches what is averaged, so peers switching a round apart stay consistent.
A peer that joins after a re-route starts with the latest version that is due.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from dht.keys import ROUTER_TTL_SECONDS
from peer.artifacts.store import ArtifactError, ArtifactStore
from peer.artifacts.transfer import ArtifactService
from peer.errors import ConfigError
from peer.model.grid import path_index
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


class RouterSwitch:
    """The routing half of `Peer`: the route its data shard is read with, and switching versions."""

    _route_fn: Route | None = None
    #: the router version we route with; None: the manifest's own router
    router_version: RouterVersion | None = None
    _announced_due: int = 0
    _router_published_at: float = 0.0

    def _route(self) -> Route:
        """The route to read our path's shard with: the latest version due by now, else the manifest's."""
        if self._route_fn is None and not self._switch_router():
            self._route_fn = make_route(self.manifest, self.base, self._artifact_folders())
        return self._route_fn

    def _follow_router(self) -> None:
        """At a round boundary: a newer router version that is due re-routes our data shard."""
        if self._switch_router():
            self._start_data()

    def _router_meta(self) -> dict:
        """What a checkpoint says about the router it trained with (`pathswarm eval` routes alike)."""
        v = self.router_version
        return (
            {}
            if v is None
            else {"router_version": v.router_version, "router_file": v.router_file.model_dump()}
        )

    def _switch_router(self) -> bool:
        try:
            found = latest_router_version(self.dht, self.config.run_name, self.record)
        except Exception as e:  # reading the DHT must never stop the training
            logger.warning(f"could not read the run's router versions: {type(e).__name__}: {e}")
            return False
        if found is None:
            return False
        version, record, _ = found
        current = self.router_version.router_version if self.router_version else 0
        if version.router_version <= current:
            if version.router_version == current:  # keep the version alive after its publisher left
                self._republish(record)
            return False
        if self.outer_round < version.switch_round:
            if self._announced_due != version.router_version:
                self._announced_due = version.router_version
                logger.info(f"router version {version.router_version} is due at round {version.switch_round}")
            return False
        try:
            router = read_router(self._fetch_router(version), f"router version {version.router_version}")
            route = make_route(self.manifest, self.base, self._artifact_folders(), router=router)
        except (ArtifactError, ConfigError) as e:
            logger.warning(f"router version {version.router_version}: {e}; keeping ours, trying next round")
            return False
        self._route_fn, self.router_version = route, version
        self._republish(record, now=True)
        index = path_index(self.manifest.model, self.path)
        logger.info(
            f"router version {version.router_version} from round {self.outer_round} (due at round "
            f"{version.switch_round}): path {index}'s data is re-routed"
        )
        if self.metrics is not None:
            self.metrics.set_router_version(version.router_version)
        return True

    def _republish(self, record, now: bool = False) -> None:
        if now or time.monotonic() - self._router_published_at > ROUTER_TTL_SECONDS / 3:
            if publish_router_record(self.dht, self.key, self.config.run_name, record):
                self._router_published_at = time.monotonic()

    def _fetch_router(self, version: RouterVersion) -> Path:
        cfg = self.config
        if self.artifacts is None:  # a run without artifacts in its manifest has no service yet
            store = ArtifactStore(cfg.artifacts_dir or default_artifacts_dir(cfg.checkpoint_dir))
            self.artifacts = ArtifactService(self.dht, store)
            if self.membership is not None:
                self.membership.artifacts = self.artifacts  # its heartbeat re-publishes what we serve
        what = f"router version {version.router_version}"
        local = [run_folder_store(cfg.manifest_path)]
        path = obtain_artifact(
            self.artifacts,
            self.dht,
            (cfg.run_name, self.run_id),
            version.router_file,
            local,
            what,
            progress=False,
        )
        self.artifacts.publish(self.dht, self.key, cfg.run_name, self.run_id)
        return path
