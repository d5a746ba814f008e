"""The `pathswarm` command line: peer, bootstrap, run create, demo, eval, generate, export, schedule.

Every subcommand is thin: parse, build, run, shut down in `finally`. Errors a user can fix are one
line on stderr and exit status 2; SIGTERM and Ctrl-C let a peer finish its step and checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from pydantic import ValidationError

from dht.node import SwarmError

logger = logging.getLogger("pathswarm")


def _setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    # hivemind configures its own loggers; keep its chatter at warnings.
    logging.getLogger("hivemind").setLevel(logging.WARNING if level != "DEBUG" else logging.DEBUG)


def _add_swarm_flags(p: argparse.ArgumentParser) -> None:
    s = argparse.SUPPRESS
    p.add_argument("--initial_peers", nargs="*", default=s, help="multiaddrs of peers already in the swarm")
    p.add_argument("--host_maddrs", nargs="*", default=s, help="multiaddrs to listen on")
    p.add_argument("--announce_maddrs", nargs="*", default=s, help="multiaddrs to advertise to other peers")
    p.add_argument(
        "--identity_path", default=s, help="file with this peer's private key (created if missing)"
    )


def _peer_parser(sub) -> None:
    s = argparse.SUPPRESS
    p = sub.add_parser("peer", help="join a run and train a path")
    _add_swarm_flags(p)
    p.add_argument(
        "--config", type=Path, default=None, help="TOML or JSON file of settings (flags override it)"
    )
    p.add_argument("--client_mode", action="store_true", default=s, help="do not accept incoming connections")
    p.add_argument(
        "--new_swarm", action="store_true", default=s, help="start a new swarm (no --initial_peers)"
    )
    p.add_argument("--run", default=s, help="run NAME or NAME@HASH")
    p.add_argument("--manifest_path", default=s, help="signed manifest file to verify and publish")
    p.add_argument("--path", default=s, help="claim this path: an index or one module index per level")
    p.add_argument("--device", default=s, help="auto, cpu or cuda[:N]")
    p.add_argument("--batch_size", type=int, default=s)
    p.add_argument("--inner_optimizer", choices=["adamw", "adamw8bit"], default=s)
    p.add_argument("--metrics_port", type=int, default=s, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics_host", default=s, help="address for /metrics (default 0.0.0.0)")
    p.add_argument("--checkpoint_dir", default=s)
    p.add_argument("--keep_checkpoints", type=int, default=s, help="complete checkpoints kept (default 2)")
    p.add_argument("--resume", action="store_true", default=s, help="continue from --checkpoint_dir")
    p.add_argument("--max_rounds", type=int, default=s, help="stop after this many outer rounds")
    p.add_argument("--max_steps", type=int, default=s, help="stop after this many inner steps")
    p.add_argument("--torch_threads", type=int, default=s)
    p.add_argument("--heartbeat_seconds", type=float, default=s)
    p.add_argument("--probe_file", default=s, help="JSON of injected probe values (tests, benchmarks)")
    p.add_argument("--wait_for_peers", type=int, default=s, help="start training once N peers are ready")
    p.add_argument("--log_level", default=s)


def _bootstrap_parser(sub) -> None:
    p = sub.add_parser("bootstrap", help="run a DHT-only node that other peers use to join")
    _add_swarm_flags(p)
    p.add_argument(
        "--manifest_path", type=Path, default=None, help="also keep this signed run alive in the DHT"
    )


def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="create runs")
    rsub = p.add_subparsers(dest="run_command", required=True)
    c = rsub.add_parser("create", help="fit the router, sign a run manifest, write and publish it")
    _add_swarm_flags(c)
    c.add_argument("--name", required=True)
    c.add_argument("--out", type=Path, required=True, help="where to write the signed manifest (JSON)")
    c.add_argument("--preset", default="tiny", help="model size preset (tiny, small, base, path-150m)")
    c.add_argument("--grid", default="2x2", help="LxK: levels x modules per level")
    c.add_argument(
        "--private_blocks", type=int, default=0, help="blocks per path kept private after the grid"
    )
    c.add_argument("--dataset", default="builtin", choices=["builtin", "text", "json", "parquet", "hub"])
    c.add_argument("--data_files", nargs="*", default=[], help="local files or globs (text/json/parquet)")
    c.add_argument("--dataset_name", default=None, help="hub dataset name (streamed), for --dataset hub")
    c.add_argument("--text_field", default="text")
    c.add_argument("--tokenizer", default="bytes", help="'bytes' or a tokenizer.json file")
    c.add_argument("--seq_len", type=int, default=64)
    c.add_argument("--inner_steps", type=int, default=50, help="H: inner steps per outer round")
    c.add_argument("--codec", default="fp32", choices=["fp32", "fp16", "int8", "nf4", "e3m0"])
    c.add_argument("--fragments", type=int, default=1, help="P: fragments per module (Streaming DiLoCo)")
    c.add_argument("--overlap_steps", type=int, default=0, help="τ: inner steps a fragment sync may overlap")
    c.add_argument("--mixing_alpha", type=float, default=0.5, help="α: local weight when merging after τ > 0")
    c.add_argument("--blocks_per_module", type=int, default=None, help="override the preset blocks/module")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--no_publish", action="store_true", help="only write the file")


def _demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="a local swarm on loopback: bootstrap + N peers on a 2x2 grid")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--inner_steps", type=int, default=40)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--out", type=Path, default=None, help="write summary.json and peer logs here")
    p.add_argument("--timeout_seconds", type=float, default=600)


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    from peer import cli_model, cli_schedule

    parser = argparse.ArgumentParser(prog="pathswarm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _peer_parser(sub)
    _bootstrap_parser(sub)
    _run_parser(sub)
    _demo_parser(sub)
    commands = {"peer": cmd_peer, "bootstrap": cmd_bootstrap, "demo": cmd_demo, "run": cmd_run_create}
    commands.update(cli_model.register(sub))
    commands.update(cli_schedule.register(sub))
    return parser, commands


def _install_sigterm(stop) -> None:
    def handler(signum, frame):
        logger.info(f"received signal {signum}: finishing the current step, then leaving")
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def cmd_peer(args: argparse.Namespace) -> int:
    from peer.config import load_peer_config
    from peer.trainer import Peer

    values = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    config = load_peer_config(values, args.config)
    _setup_logging(config.log_level)
    if not config.initial_peers and not config.new_swarm:
        raise SwarmError("give --initial_peers of a running peer, or --new_swarm to start a new swarm")
    if config.new_swarm and config.manifest_path is None:
        raise SwarmError("--new_swarm needs --manifest_path: nobody else can give this peer the run manifest")
    logger.info(f"config: {config.model_dump_json()}")
    peer = Peer(config)
    _install_sigterm(peer.stop_requested.set)
    try:
        peer.start()
        peer.run()
    finally:
        peer.close()
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    import threading

    from dht.node import start_dht, visible_maddrs
    from peer.manifest import load_record, publish_record, verify_record

    _setup_logging()
    record = None
    if args.manifest_path is not None:
        record = load_record(args.manifest_path)
        try:
            verify_record(record)
        except ValueError as e:
            raise SwarmError(f"manifest file {args.manifest_path} does not verify: {e}") from e
    dht, key = start_dht(
        initial_peers=getattr(args, "initial_peers", []),
        host_maddrs=getattr(args, "host_maddrs", ["/ip4/0.0.0.0/tcp/0"]),
        announce_maddrs=getattr(args, "announce_maddrs", []),
        identity_path=getattr(args, "identity_path", None),
    )
    stop = threading.Event()
    _install_sigterm(stop.set)
    try:
        print("--initial_peers " + " ".join(visible_maddrs(dht)), flush=True)
        while not stop.is_set():
            if record is not None:
                publish_record(dht, key, record)
            stop.wait(60)
    finally:
        dht.shutdown()
    return 0


def _parse_grid(text: str) -> tuple[int, int]:
    try:
        levels, k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SwarmError(f"--grid {text!r}: expected LxK, e.g. 2x2") from None
    return levels, k


def cmd_run_create(args: argparse.Namespace) -> int:
    from dht.node import load_identity, start_dht
    from peer.config import SyncConfig
    from peer.data import DatasetSpec
    from peer.manifest import publish_record, save_record, sign_manifest
    from peer.model import model_config_from_preset
    from peer.run_setup import build_manifest
    from peer.tokenizer import load_tokenizer

    _setup_logging()
    levels, k = _parse_grid(args.grid)
    tok = load_tokenizer(args.tokenizer)
    model = model_config_from_preset(
        args.preset,
        n_levels=levels,
        modules_per_level=k,
        private_blocks_per_path=args.private_blocks,
        vocab_size=tok.vocab_size,
        **({"blocks_per_module": args.blocks_per_module} if args.blocks_per_module else {}),
    )
    dataset = DatasetSpec(
        kind=args.dataset,
        data_files=args.data_files,
        name=args.dataset_name,
        text_field=args.text_field,
        seed=args.seed,
    )
    manifest = build_manifest(
        args.name,
        model,
        dataset,
        seed=args.seed,
        seq_len=args.seq_len,
        inner_steps=args.inner_steps,
        sync=SyncConfig(
            codec=args.codec,
            fragments=args.fragments,
            overlap_steps=args.overlap_steps,
            mixing_alpha=args.mixing_alpha,
        ),
        tokenizer=args.tokenizer,
    )
    identity = getattr(args, "identity_path", None)
    key = load_identity(identity)
    record = sign_manifest(manifest, key)
    save_record(record, args.out)
    print(f"run {manifest.name} id {record.run_id}")
    print(f"manifest written to {args.out}; peers join with --run {manifest.name}@{record.run_id[:16]}")
    if not args.no_publish and getattr(args, "initial_peers", None):
        dht, _ = start_dht(initial_peers=args.initial_peers, identity_path=identity, client_mode=True)
        try:
            ok = publish_record(dht, key, record)
            print("published to the DHT" if ok else "could not publish (peers can still use --manifest_path)")
        finally:
            dht.shutdown()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from peer.demo import run_demo

    _setup_logging()
    return run_demo(
        args.peers, args.rounds, args.inner_steps, args.batch_size, args.out, args.timeout_seconds
    )


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    command = commands[args.command]
    try:
        return command(args)
    except (SwarmError, ValueError, ValidationError, OSError) as e:
        from peer.config import one_line

        text = (
            one_line(e) if isinstance(e, ValidationError) else str(e).splitlines()[0] if str(e) else repr(e)
        )
        print(f"pathswarm {args.command}: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
