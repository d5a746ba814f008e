"""`pathswarm run create`: fit a run's router, sign its manifest, write it and publish it;
`pathswarm run reroute`: re-route a live run by its paths' losses (peer/run/reroute.py).

`create`'s flags are the fields of `peer.run.create.RunOptions` (plus where to write and publish);
the whole path from flags to manifest is `manifest_from_options`.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from peer.cli.common import Handler, add_swarm_flags, setup_logging
from peer.codecs.specs import CODEC_NAMES
from peer.model.grid import PRESETS

logger = logging.getLogger(__name__)

#: stores of the signed manifest tried before `run create` gives up (the DHT may still be warming up)
PUBLISH_ATTEMPTS = 3

#: flags of `run create` that are not choices about the run itself
_OUTPUT_FLAGS = ("out", "no_publish", "initial_peers", "host_maddrs", "announce_maddrs", "identity_path")


def register(subparsers) -> dict[str, Handler]:
    p = subparsers.add_parser("run", help="create runs")
    rsub = p.add_subparsers(dest="run_command", required=True)
    c = rsub.add_parser("create", help="fit the router, sign a run manifest, write and publish it")
    add_swarm_flags(c)
    c.add_argument("--name", required=True)
    c.add_argument("--out", type=Path, required=True, help="where to write the signed manifest (JSON)")
    c.add_argument("--preset", default="tiny", help=f"model size preset ({', '.join(PRESETS)})")
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
    c.add_argument("--codec", default="fp32", choices=CODEC_NAMES)
    c.add_argument("--fragments", type=int, default=1, help="P: fragments per module (Streaming DiLoCo)")
    c.add_argument("--overlap_steps", type=int, default=0, help="τ: inner steps a fragment sync may overlap")
    c.add_argument(
        "--mixing_alpha",
        type=float,
        default=None,
        help="α: local weight when merging (default: 0.5 if τ > 0, else 0)",
    )
    c.add_argument("--outer_lr", type=float, default=0.7, help="outer SGD lr (DiLoCo's 0.7)")
    c.add_argument("--outer_momentum", type=float, default=0.9, help="outer Nesterov momentum (0: plain SGD)")
    c.add_argument("--blocks_per_module", type=int, default=None, help="override the preset blocks/module")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--warm_start_steps",
        type=int,
        default=0,
        help="train a dense base model of one path's size this many steps on the run's data; every "
        "module starts from it and the router uses its features (DiPaCo's warm start)",
    )
    c.add_argument("--warm_start_batch_size", type=int, default=16, help="batch size of the base's training")
    c.add_argument(
        "--base_checkpoint",
        default=None,
        help="start every module from this base model instead (a safetensors file a run create wrote)",
    )
    c.add_argument(
        "--share_data",
        action="store_true",
        help="copy the --data_files beside the manifest, named by hash: nodes started with this "
        "--manifest_path serve them and peers fetch them (no volunteer needs a copy or --data_root)",
    )
    c.add_argument("--no_publish", action="store_true", help="only write the file")

    r = rsub.add_parser(
        "reroute",
        help="score documents with the live run's paths; publish a router sending each to its best path",
    )
    r.add_argument(
        "--manifest_path",
        type=Path,
        required=True,
        help="the run's signed manifest (its folder holds the artifacts; the new router is written there)",
    )
    r.add_argument(
        "--identity_path", required=True, help="the key that created the run (it signs the router)"
    )
    r.add_argument("--initial_peers", nargs="+", required=True, help="multiaddrs of peers of the run")
    r.add_argument("--host_maddrs", nargs="*", default=None, help="multiaddrs to listen on")
    r.add_argument("--docs", type=int, default=1000, help="training documents scored by every path")
    r.add_argument("--eval_docs", type=int, default=200, help="held-out documents to compare the routings on")
    r.add_argument("--max_share_ratio", type=float, default=3.0,
                   help="largest path's share of the documents over the smallest's, at most")  # fmt: skip
    r.add_argument("--checkpoints", nargs="*", type=Path, default=[],
                   help="score a paused run from these checkpoint folders, not live holders")  # fmt: skip
    r.add_argument("--at_round", type=int, default=0, help="wait until the swarm reaches this round")
    r.add_argument("--force", action="store_true", help="publish even if it scores held-out documents worse")
    r.add_argument("--score_tokens", type=int, default=512, help="score each document's first N tokens")
    r.add_argument("--torch_threads", type=int, default=None, help="torch threads for the scoring")
    r.add_argument(
        "--switch_after_rounds", type=int, default=2, help="peers switch this many rounds from now"
    )
    r.add_argument(
        "--wait_seconds", type=float, default=60.0, help="wait this long for every module's holder"
    )
    r.add_argument(
        "--serve_seconds",
        type=float,
        default=600.0,
        help="serve the router file at most this long (ends once every peer switched)",
    )
    return {"run": cmd_run}


def cmd_run(args: argparse.Namespace) -> int:
    return cmd_run_reroute(args) if args.run_command == "reroute" else cmd_run_create(args)


def cmd_run_reroute(args: argparse.Namespace) -> int:
    from peer.cli.reroute import RerouteOptions, reroute
    from peer.errors import ConfigError

    setup_logging()
    for flag, least in (("docs", 1), ("eval_docs", 0), ("switch_after_rounds", 0), ("score_tokens", 8),
                        ("max_share_ratio", 1), ("at_round", 0)):  # fmt: skip
        if getattr(args, flag) < least:
            raise ConfigError(f"--{flag} must be >= {least}")
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    extra = {"host_maddrs": args.host_maddrs} if args.host_maddrs else {}
    reroute(
        RerouteOptions(
            manifest_path=args.manifest_path,
            identity_path=args.identity_path,
            initial_peers=args.initial_peers,
            docs=args.docs,
            eval_docs=args.eval_docs,
            score_tokens=args.score_tokens,
            max_share_ratio=args.max_share_ratio,
            at_round=args.at_round,
            force=args.force,
            checkpoints=args.checkpoints,
            switch_after_rounds=args.switch_after_rounds,
            wait_seconds=args.wait_seconds,
            serve_seconds=args.serve_seconds,
            **extra,
        )
    )
    return 0


def cmd_run_create(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from dht.identity import load_identity
    from dht.node import start_dht
    from peer.config import InnerOptimizerConfig, one_line
    from peer.errors import ConfigError, SwarmError
    from peer.offline.warm_start import make_base
    from peer.run.create import RunOptions, manifest_from_options
    from peer.run.record import save_record, sign_manifest
    from peer.swarm.base_model import run_folder_store
    from peer.swarm.manifest import fetch_manifest, publish_record

    setup_logging()
    choices = {k: v for k, v in vars(args).items() if k not in ("command", "run_command", *_OUTPUT_FLAGS)}
    try:
        options = RunOptions(**choices)
    except ValidationError as e:
        raise ConfigError(one_line(e)) from None
    # the base model, when there is one, goes beside the manifest: a node started with this
    # --manifest_path serves it to the peers (peer/artifacts/)
    store = run_folder_store(args.out)
    artifacts = store.root
    manifest = manifest_from_options(
        options,
        lambda o, model, data, tok: make_base(o, model, data, tok, artifacts, InnerOptimizerConfig()),
        store,
    )
    # one key both signs the records and is the DHT node's identity: the node's signature validator
    # refuses records whose owner subkey names another key
    key, identity_file = load_identity(getattr(args, "identity_path", None))
    record = sign_manifest(manifest, key)
    save_record(record, args.out)
    print(f"run {manifest.name} id {record.run_id}")
    print(f"manifest written to {args.out}; peers join with --run {manifest.name}@{record.run_id[:16]}")
    if manifest.base_checkpoint is not None:
        ref = manifest.base_checkpoint
        print(
            f"base model {ref.sha256[:12]}… written to {artifacts}: a node started with --manifest_path "
            f"{args.out} serves it"
        )
    if manifest.dataset.shards:
        print(f"data: {len(manifest.dataset.shards)} shards written to {artifacts}, served the same way")
    if not args.no_publish and getattr(args, "initial_peers", None):
        dht, _ = start_dht(initial_peers=args.initial_peers, identity_path=identity_file, client_mode=True)
        try:
            published = False
            for attempt in range(PUBLISH_ATTEMPTS):
                if publish_record(dht, key, record):
                    # read back: a store that some node took is not yet one a joiner finds
                    try:
                        fetch_manifest(dht, manifest.name, record.run_id, timeout_seconds=10.0)
                        published = True
                        break
                    except SwarmError as e:
                        logger.info(f"published, but not readable yet: {e}")
                time.sleep(1.0 + attempt)
        finally:
            dht.shutdown()
        if not published:
            raise SwarmError(
                f"could not publish the manifest through {', '.join(args.initial_peers)}: no DHT node took "
                f"it in {PUBLISH_ATTEMPTS} attempts (is a bootstrap or peer running there?); peers can still "
                f"join with --manifest_path {args.out}"
            )
        print(f"published to the DHT: peers join with --run {manifest.name}@{record.run_id[:16]}")
    return 0
