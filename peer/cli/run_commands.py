"""`pathswarm run create`: fit a run's router, sign its manifest, write it and publish it;
`pathswarm run reroute`: re-route a live run by its paths' losses (peer/cli/reroute.py);
`pathswarm run invite` / `admit`: let volunteers in (peer/cli/admission_commands.py).

`create`'s flags are the fields of `peer.run.options.RunOptions`, generated (peer/cli/flags.py), plus
where to write and publish; the whole path from flags to manifest is `manifest_from_options`.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from peer.cli import admission_commands
from peer.cli.common import Handler, add_swarm_flags, setup_logging
from peer.cli.flags import add_model_flags, given
from peer.run.options import MANIFEST_FLAGS, RunChoices, RunOptions

logger = logging.getLogger(__name__)

#: stores of the signed manifest tried before `run create` gives up (the DHT may still be warming up)
PUBLISH_ATTEMPTS = 3


def register(subparsers) -> dict[str, Handler]:
    p = subparsers.add_parser("run", help="create runs, admit volunteers, re-route runs")
    rsub = p.add_subparsers(dest="run_command", required=True)
    admission_commands.add(rsub)
    c = rsub.add_parser(
        "create",
        help="fit the router, sign a run manifest, write and publish it",
        description="Fit the router, sign a run manifest, write it and publish it.",
    )
    add_swarm_flags(c)
    add_model_flags(c.add_argument_group("the run's manifest"), RunOptions, MANIFEST_FLAGS, required=True)
    add_model_flags(c.add_argument_group("how the run is made"), RunOptions, RunChoices.model_fields)
    out = c.add_argument_group("where it goes")
    out.add_argument("--out", type=Path, required=True, help="where to write the signed manifest (JSON)")
    out.add_argument("--no_publish", action="store_true", help="only write the file")

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
    commands = {
        "reroute": cmd_run_reroute,
        "invite": admission_commands.cmd_invite,
        "admit": admission_commands.cmd_admit,
    }
    return commands.get(args.run_command, cmd_run_create)(args)


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
    from peer.run.create import manifest_from_options
    from peer.run.record import save_record, sign_manifest
    from peer.swarm.base_model import run_folder_store
    from peer.swarm.manifest import fetch_manifest, publish_record

    setup_logging()
    try:
        options = RunOptions(**given(args, RunOptions))
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
