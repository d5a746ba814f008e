"""`pathswarm peer` and `pathswarm bootstrap`: the processes a swarm is made of.

`register(subparsers)` adds both subcommands and returns their handlers. A peer's flags are the
fields of `PeerConfig` (generated: peer/cli/flags.py); they can also come from `--config FILE` or
`PATHSWARM_<FLAG>` variables. A bootstrap node shares the swarm's flags (`SWARM_FIELDS`).
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

from peer.cli.common import SWARM_FIELDS, Handler, add_swarm_flags, install_sigterm, logger, setup_logging
from peer.cli.flags import add_model_flags, flag_or_default, given
from peer.config import PeerConfig, load_peer_config
from peer.errors import ConfigError


def register(subparsers) -> dict[str, Handler]:
    p = subparsers.add_parser(
        "peer",
        help="join a run and train a path",
        description="Join a run and train a path.",
        epilog="Every flag can also come from --config FILE (its keys are the flags' names) or from "
        "a PATHSWARM_<FLAG> environment variable (PATHSWARM_BATCH_SIZE=16; lists space-separated or "
        "JSON); a flag beats the environment, which beats the file.",
    )
    add_swarm_flags(p)
    p.add_argument(
        "--config", type=Path, default=None, help="TOML or JSON file of settings (flags override it)"
    )
    own = [name for name in PeerConfig.model_fields if name not in SWARM_FIELDS]
    add_model_flags(p.add_argument_group("the peer"), PeerConfig, own)

    b = subparsers.add_parser("bootstrap", help="run a DHT-only node that other peers use to join")
    add_swarm_flags(b)
    b.add_argument(
        "--manifest_path", type=Path, default=None, help="also keep this signed run alive in the DHT"
    )
    b.add_argument(
        "--keep_state",
        type=Path,
        default=None,
        help="keep and serve the latest state of every module of the run here (needs --manifest_path)",
    )
    b.add_argument(
        "--keep_every_seconds",
        type=float,
        default=30.0,
        help="how often kept states are refreshed (default: 30)",
    )
    b.add_argument(
        "--artifacts_dir",
        type=Path,
        default=None,
        help="serve the run's artifacts (its base model) from here (default: beside --manifest_path)",
    )
    return {"peer": cmd_peer, "bootstrap": cmd_bootstrap}


def peer_config(args: argparse.Namespace) -> PeerConfig:
    """The peer's settings: its flags over the environment over --config's file over the defaults."""
    return load_peer_config(given(args, PeerConfig), args.config)


def cmd_peer(args: argparse.Namespace) -> int:
    from peer.training.peer import Peer

    config = peer_config(args)
    setup_logging(config.log_level)
    logger.info(f"config: {config.model_dump_json()}")
    peer = Peer(config)
    install_sigterm(peer.request_stop)
    try:
        peer.start()
        peer.run()
    finally:
        peer.close()
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from dht.node import start_dht, visible_maddrs
    from dht.relay_check import prefer_configured_relay, start_relaying_dht
    from peer.run.admission import AdmissionCheck, invite_only
    from peer.run.record import load_verified_manifest
    from peer.swarm.manifest import publish_record

    setup_logging()
    manifest = record = None
    if args.manifest_path is not None:
        manifest, record = load_verified_manifest(args.manifest_path)
    if args.keep_state is not None and manifest is None:
        raise ConfigError("--keep_state needs --manifest_path: the keeper must know the run")

    swarm = {name: flag_or_default(args, PeerConfig, name) for name in SWARM_FIELDS}

    def start():
        return start_dht(
            **swarm,
            public=True,
            run_name=manifest.name if manifest is not None else None,
            run_id=record.run_id if record is not None else None,
            admitted=AdmissionCheck.of(record).admitted if record is not None else None,
            admitted_only=record is not None and invite_only(record),
            creator_public_key=record.creator_public_key if record is not None else None,
        )

    # peers behind NAT relay through their initial peers, so a bootstrap node checks its relay first
    relays = swarm["use_relay"] and not swarm["use_auto_relay"]
    if relays:
        prefer_configured_relay()
    dht, key = start_relaying_dht(start) if relays else start()
    from peer.swarm.reachability import DialBackService

    dialback = DialBackService(dht)  # joining peers ask the bootstrap node whether it can dial them
    keeper = artifacts = authority_service = None
    dht_lock = threading.Lock()  # the keeper's thread and this one share the DHT handle
    stop = threading.Event()
    install_sigterm(stop.set)
    try:
        if args.keep_state is not None:
            from peer.swarm.keeper import Keeper

            keeper = Keeper(dht, key, manifest, record, args.keep_state, args.keep_every_seconds, dht_lock)
            keeper.start()
        if record is not None and key.get_public_key().to_bytes() == record.creator_public_key:
            from peer.swarm.authority import start_authority

            # the creator's own node admits keys to its run (invite codes, probation)
            _, authority_service = start_authority(
                dht, key, manifest, record, args.manifest_path, dht_lock,
                keeper.service if keeper is not None else None,
            )  # fmt: skip
        artifacts = _serve_run_artifacts(dht, manifest, args)
        print("--initial_peers " + " ".join(visible_maddrs(dht)), flush=True)
        while not stop.is_set():
            if record is not None:
                with dht_lock:
                    publish_record(dht, key, record)
                    if artifacts is not None:
                        artifacts.publish(dht, key, manifest.name, record.run_id)
            stop.wait(60)
    finally:
        if artifacts is not None:
            artifacts.shutdown()
        if keeper is not None:
            keeper.shutdown()
        if authority_service is not None:
            authority_service.shutdown()
        dialback.shutdown()
        dht.shutdown()
    return 0


def _serve_run_artifacts(dht, manifest, args: argparse.Namespace):
    """The artifact service serving the run's base model and data shards that the node has (else
    None)."""
    if manifest is None:
        return None
    named = [
        ("base model", manifest.base_checkpoint),
        ("tokenizer", manifest.tokenizer_file),
        ("router", manifest.router_file),
        ("routing index", manifest.routing_index),
    ]
    refs = [(what, ref) for what, ref in named if ref is not None]
    refs += [(f"data shard {r.name}", r) for r in manifest.dataset.shards]
    if not refs:
        return None
    from peer.artifacts.store import ArtifactStore
    from peer.artifacts.transfer import ArtifactService
    from peer.swarm.base_model import run_folder_store

    store = ArtifactStore(args.artifacts_dir) if args.artifacts_dir else run_folder_store(args.manifest_path)
    have = []
    for what, ref in refs:
        if store.has(ref):
            have.append((what, ref))
        else:
            logger.warning(
                f"the run's {what} {ref.sha256[:12]}… is not in {store.root}: this node does not serve it "
                "(peers get it from others that do; give --artifacts_dir with the folder run create wrote)"
            )
    if not have:
        return None
    service = ArtifactService(dht, store)
    for _, ref in have:
        service.offer(ref)
    total = sum(ref.size_bytes for _, ref in have) / 2**20
    logger.info(f"serving the run's {', '.join(what for what, _ in have[:3])}{'…' if len(have) > 3 else ''} "
                f"({len(have)} artifacts, {total:.1f} MiB)")  # fmt: skip
    return service
