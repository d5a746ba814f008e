"""`pathswarm peer` and `pathswarm bootstrap`: the processes a swarm is made of.

`register(subparsers)` adds both subcommands and returns their handlers. A peer's flags are the
fields of `PeerConfig`; they can also come from `--config FILE` or `PATHSWARM_<FLAG>` variables.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

from peer.cli.common import Handler, add_swarm_flags, install_sigterm, logger, setup_logging
from peer.errors import ConfigError


def register(subparsers) -> dict[str, Handler]:
    s = argparse.SUPPRESS
    p = subparsers.add_parser("peer", help="join a run and train a path")
    add_swarm_flags(p)
    p.add_argument(
        "--config", type=Path, default=None, help="TOML or JSON file of settings (flags override it)"
    )
    p.add_argument("--client_mode", action="store_true", default=s, help="do not accept incoming connections")
    p.add_argument(
        "--new_swarm", action="store_true", default=s, help="start a new swarm (no --initial_peers)"
    )
    p.add_argument("--run", default=s, help="run NAME or NAME@HASH")
    p.add_argument("--manifest_path", default=s, help="signed manifest file to verify and publish")
    p.add_argument(
        "--creator", default=s, help="refuse a manifest not signed by this creator key (hex prefix)"
    )
    p.add_argument("--data_root", default=s, help="folder holding the run's local data files")
    p.add_argument(
        "--artifacts_dir",
        default=s,
        help="where the run's base model is kept and served from (default: CHECKPOINT_DIR/artifacts)",
    )
    p.add_argument("--path", default=s, help="claim this path: an index or one module index per level")
    p.add_argument("--device", default=s, help="auto, cpu or cuda[:N]")
    p.add_argument("--batch_size", type=int, default=s)
    p.add_argument(
        "--max_memory_bytes", type=int, default=s, help="memory the path may use (default: all that is free)"
    )
    p.add_argument("--inner_optimizer", choices=["adamw", "adamw8bit"], default=s)
    p.add_argument("--metrics_port", type=int, default=s, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics_host", default=s, help="address for /metrics (default 0.0.0.0)")
    p.add_argument("--checkpoint_dir", default=s)
    p.add_argument(
        "--checkpoint_every_rounds", type=int, default=s, help="checkpoint every N outer rounds (default 1)"
    )
    p.add_argument("--keep_checkpoints", type=int, default=s, help="complete checkpoints kept (default 2)")
    p.add_argument("--resume", action="store_true", default=s, help="continue from --checkpoint_dir")
    p.add_argument(
        "--max_rounds",
        type=int,
        default=s,
        help="stop after this peer has done this many outer rounds of its own, counted across --resume "
        "(a late joiner does them all; the swarm's round number, in the log's `round N`, may be higher)",
    )
    p.add_argument("--max_steps", type=int, default=s, help="stop after this many inner steps")
    p.add_argument(
        "--rotate_every_rounds",
        type=int,
        default=s,
        help="with fewer peers than paths, every N outer rounds one peer moves to the least-trained "
        "path nobody holds, so every path gets trained (default 4; 0: never; a --path peer stays)",
    )
    p.add_argument("--torch_threads", type=int, default=s)
    p.add_argument("--heartbeat_seconds", type=float, default=s)
    p.add_argument("--probe_file", default=s, help="JSON of injected probe values (tests, benchmarks)")
    p.add_argument("--wait_for_peers", type=int, default=s, help="start training once N peers are ready")
    p.add_argument("--log_level", default=s)

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
        "--keep_every_seconds", type=float, default=30.0, help="how often kept states are refreshed"
    )
    b.add_argument(
        "--artifacts_dir",
        type=Path,
        default=None,
        help="serve the run's artifacts (its base model) from here (default: beside --manifest_path)",
    )
    return {"peer": cmd_peer, "bootstrap": cmd_bootstrap}


def cmd_peer(args: argparse.Namespace) -> int:
    from peer.config import load_peer_config
    from peer.training.peer import Peer

    values = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    config = load_peer_config(values, args.config)
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
    from peer.run.record import load_verified_manifest
    from peer.swarm.manifest import publish_record

    setup_logging()
    manifest = record = None
    if args.manifest_path is not None:
        manifest, record = load_verified_manifest(args.manifest_path)
    if args.keep_state is not None and manifest is None:
        raise ConfigError("--keep_state needs --manifest_path: the keeper must know the run")

    def start():
        return start_dht(
            initial_peers=getattr(args, "initial_peers", []),
            host_maddrs=getattr(args, "host_maddrs", ["/ip4/0.0.0.0/tcp/0"]),
            announce_maddrs=getattr(args, "announce_maddrs", []),
            identity_path=getattr(args, "identity_path", None),
            use_relay=getattr(args, "use_relay", True),
            use_auto_relay=getattr(args, "use_auto_relay", False),
            public=True,
            run_name=manifest.name if manifest is not None else None,
            run_id=record.run_id if record is not None else None,
        )

    # peers behind NAT relay through their initial peers, so a bootstrap node checks its relay first
    relays = getattr(args, "use_relay", True) and not getattr(args, "use_auto_relay", False)
    if relays:
        prefer_configured_relay()
    dht, key = start_relaying_dht(start) if relays else start()
    from peer.swarm.reachability import DialBackService

    dialback = DialBackService(dht)  # joining peers ask the bootstrap node whether it can dial them
    keeper = artifacts = None
    dht_lock = threading.Lock()  # the keeper's thread and this one share the DHT handle
    stop = threading.Event()
    install_sigterm(stop.set)
    try:
        if args.keep_state is not None:
            from peer.swarm.keeper import Keeper

            keeper = Keeper(dht, key, manifest, record, args.keep_state, args.keep_every_seconds, dht_lock)
            keeper.start()
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
