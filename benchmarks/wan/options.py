"""The WAN lab's configurations and flags (`python -m benchmarks.wan --help`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from peer.codecs.specs import CODEC_NAMES

CONFIGS = (
    "no_sync",
    "diloco_fp32",
    "streaming_4bit",
    "streaming_sparse",
    "hivemind_optimizer",
    "no_sync_end",
)
#: the compute ceiling, measured first and again last: the ratios' denominator is their mean, so that a
#: machine slower or faster at one end of a run flatters no configuration
NO_SYNC = ("no_sync", "no_sync_end")
#: the runs that keep a global copy (scored by it) and sync by fragments
STREAMING = ("streaming_4bit", "streaming_sparse")
#: τ of streaming_sparse unless given: with α = 0 the overlap's steps are dropped at the merge, and at
#: H = 24, P = 4 τ = 2 lost about 5% less than τ = 5 (docs/benchmarks/sparse_outer.md, session 56)
SPARSE_OVERLAP_STEPS = 2


def largest_overlap_steps(args: argparse.Namespace) -> int:
    """H/P − 1 (at least 0): a fragment's round must end before the next fragment's begins."""
    return max(0, args.inner_steps // args.fragments - 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wan", description="Streaming DiLoCo, emulated WAN")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--cap_mbit", type=float, default=20.0, help="egress cap of every peer")
    p.add_argument("--loss", type=float, default=0.0, help="random packet loss of every peer's egress")
    p.add_argument("--steps", type=int, default=192, help="inner steps of every peer")
    p.add_argument("--inner_steps", type=int, default=48, help="H")
    p.add_argument("--fragments", type=int, default=4, help="P of streaming_4bit")
    p.add_argument("--overlap_steps", type=int, default=None, help="τ of streaming_4bit (default: derived)")
    p.add_argument("--mixing_alpha", type=float, default=0.5, help="α of streaming_4bit")
    p.add_argument("--codec", default="nf4", choices=CODEC_NAMES)
    # streaming_sparse: SparseLoCo's shape of the outer step (error feedback in place of momentum, the
    # local copy replaced by the global one) with a larger lr, because the group's mean of members'
    # top-k parts moves a coordinate only by the share of members that chose it; benchmarks/sparse_outer.py
    p.add_argument(
        "--sparse_codec", default="sparse2bit", choices=CODEC_NAMES, help="codec of streaming_sparse"
    )
    # lr 5 at τ = 2: best or tied on the validation split at d_model 64 (three seeds) and at the lab's
    # own d_model 256 (docs/benchmarks/sparse_outer.md, session 56)
    p.add_argument("--sparse_outer_lr", type=float, default=5.0, help="outer lr of streaming_sparse")
    p.add_argument(
        "--sparse_outer_momentum", type=float, default=0.0, help="outer momentum of streaming_sparse"
    )
    p.add_argument("--sparse_mixing_alpha", type=float, default=0.0, help="α of streaming_sparse")
    p.add_argument(
        "--sparse_overlap_steps",
        type=int,
        default=None,
        help=f"τ of streaming_sparse (default: {SPARSE_OVERLAP_STEPS}, or H/P − 1 where that is less)",
    )
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4, help="blocks of the one grid module (a multiple of P)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=30)
    p.add_argument(
        "--matchmaking_seconds",
        type=float,
        default=5.0,
        help="hivemind_optimizer only; hivemind's guide: 3-5 s for small local runs",
    )
    p.add_argument("--averaging_timeout", type=float, default=30.0)
    p.add_argument("--builtin_docs", type=int, default=3000)
    p.add_argument("--max_eval_docs", type=int, default=100)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset to run")
    p.add_argument("--config_timeout", type=float, default=600.0, help="seconds one configuration may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compute_cores", type=float, default=0.25, help="CPU quota of each peer's training thread (0: none)"
    )
    p.add_argument(
        "--comm_priority", type=int, default=5, help="nice levels by which peers' networking outranks compute"
    )
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    if args.blocks % args.fragments:
        p.error(f"--blocks {args.blocks} must be a multiple of --fragments {args.fragments} (whole blocks)")
    sparse_tau = args.sparse_overlap_steps
    if sparse_tau is not None and not 0 <= sparse_tau <= largest_overlap_steps(args):
        p.error(f"--sparse_overlap_steps {args.sparse_overlap_steps} must be in [0, H/P)")
    if args.steps % args.inner_steps:
        p.error("--steps must be a multiple of --inner_steps (whole rounds, equal steps everywhere)")
    return args
