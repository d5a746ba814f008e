"""How a peer enters a run before it claims a path: its DHT node, the run's verified manifest, the
run's artifacts. Plain functions of what they are given; `Peer.start` keeps what they return.
"""

from __future__ import annotations

import logging

import hivemind
from hivemind.utils.crypto import RSAPrivateKey

from dht.daemon_scheduling import batch_schedule_daemons
from dht.node import start_dht
from dht.schema import ManifestRecord
from dht.serve_limits import ServeLimits
from peer.artifacts.transfer import ArtifactService
from peer.config import PeerConfig, RunManifest
from peer.model.base import ModuleStates
from peer.run.record import load_verified_manifest
from peer.swarm.base_model import run_artifacts, start_artifact_service
from peer.swarm.manifest import creator_of, fetch_manifest, publish_record

logger = logging.getLogger(__name__)


def start_node(cfg: PeerConfig) -> tuple[hivemind.DHT, RSAPrivateKey]:
    """This peer's DHT node, on the addresses, relays and identity the config names."""
    dht, key = start_dht(
        initial_peers=cfg.initial_peers,
        host_maddrs=cfg.host_maddrs,
        announce_maddrs=cfg.announce_maddrs,
        identity_path=cfg.identity_path,
        client_mode=cfg.client_mode,
        use_relay=cfg.use_relay,
        use_auto_relay=cfg.use_auto_relay,
        run_name=cfg.run_name,
    )
    if cfg.p2p_daemon_batch_scheduling:
        logger.debug(f"{batch_schedule_daemons()} threads of the p2p daemon under SCHED_BATCH")
    return dht, key


def join_run(
    dht: hivemind.DHT, key: RSAPrivateKey, cfg: PeerConfig, peer_id: str
) -> tuple[RunManifest, ManifestRecord]:
    """The run's verified manifest: from --manifest_path (then published for the others), or
    from the DHT; either way this peer keeps re-publishing it, so the run outlives its creator."""
    pin = cfg.run_pin
    if cfg.manifest_path is not None:
        _, record = load_verified_manifest(cfg.manifest_path, cfg.run_name, pin)
        publish_record(dht, key, record)
        pin = record.run_id
    manifest, record = fetch_manifest(dht, cfg.run_name, pin, creator=cfg.creator)
    logger.info(
        f"joined run {cfg.run_name}@{record.run_id[:16]} (created by key {creator_of(record)[:16]}) "
        f"as {peer_id}"
    )
    publish_record(dht, key, record)
    return manifest, record


def obtain_artifacts(
    dht: hivemind.DHT,
    key: RSAPrivateKey,
    cfg: PeerConfig,
    manifest: RunManifest,
    run_id: str,
    limits: ServeLimits,
) -> tuple[ArtifactService | None, ModuleStates | None]:
    """The service that fetched the run's artifacts and serves them from now on (within `limits`), and
    the run's base model; (None, None) for a run whose manifest names no artifact."""
    if not run_artifacts(manifest):
        return None, None
    return start_artifact_service(dht, key, cfg, manifest, run_id, limits)
