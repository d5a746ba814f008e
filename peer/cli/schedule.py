"""`pathswarm schedule`: plan a simulated swarm and compare the plan with the baselines.

Runs entirely offline on one of Yuan et al.'s five network scenarios or a JSON file of measured
matrices, and prints the planned round time against random and greedy assignment, plus the exact
optimum when the swarm is small enough to enumerate. `register` adds the subcommand to the
`pathswarm` parser; peer/cli/main.py wires it in.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from peer.errors import ConfigError
from peer.scheduler import (
    SCENARIOS,
    count_balanced_partitions,
    greedy_assignment,
    load_scenario,
    paper_grid,
    plan,
    random_cost,
    round_cost,
)
from peer.scheduler.scenarios import EXTRA_SCENARIOS, PAPER_FRAGMENT_BYTES, PAPER_TOKENS_PER_STEP

#: Enumerate the optimum only below this many balanced partitions (about a second of scoring).
EXHAUSTIVE_LIMIT = 20_000


def register(subparsers) -> dict[str, Callable[[argparse.Namespace], int]]:
    p = subparsers.add_parser(
        "schedule",
        help="plan a simulated swarm (Yuan et al. scenarios or a JSON file) against random and greedy",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "--scenario",
        required=True,
        help=f"one of {', '.join(SCENARIOS + EXTRA_SCENARIOS)}, or a .json file with peers, latency_seconds, "
        "bandwidth_bytes_per_second and tokens_per_second",
    )
    p.add_argument("--peers", type=int, default=None, help="number of peers (default 64; a file: all)")
    p.add_argument("--paths", type=int, default=8, help="paths in the grid, K^L (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the genetic search")
    p.add_argument(
        "--fragment_bytes",
        type=float,
        default=float(PAPER_FRAGMENT_BYTES),
        help="bytes each peer averages per round (default: fp16 gradients of a GPT-3 XL tasklet)",
    )
    p.add_argument("--inner_steps", type=int, default=1, help="H, inner steps per round (default 1)")
    p.add_argument("--tokens_per_step", type=int, default=PAPER_TOKENS_PER_STEP)
    p.add_argument(
        "--compute", choices=["uniform", "mixed"], default="uniform", help="peer speeds in named scenarios"
    )
    return {"schedule": cmd_schedule}


def cmd_schedule(args: argparse.Namespace) -> int:
    if args.paths < 1:
        raise ConfigError(f"--paths must be >= 1, got {args.paths}")
    if args.fragment_bytes < 0:
        raise ConfigError(f"--fragment_bytes must be >= 0, got {args.fragment_bytes}")
    grid = paper_grid(
        args.paths,
        fragment_bytes=args.fragment_bytes,
        inner_steps=args.inner_steps,
        tokens_per_step=args.tokens_per_step,
    )
    snap = load_scenario(args.scenario, args.peers, grid, args.compute, args.seed)
    start = time.perf_counter()
    # The genetic search even where a peer would enumerate, so that the optimum row compares it.
    ours = plan(snap, args.seed, method="genetic")
    seconds = time.perf_counter() - start
    greedy = round_cost(greedy_assignment(snap), snap)
    rnd = random_cost(snap)
    base = ours.cost.round_seconds
    n, g = snap.n_peers, min(args.paths, snap.n_peers)
    mb = args.fragment_bytes / 1e6
    print(
        f"scenario {args.scenario}: {n} peers, {args.paths} paths, fragment {mb:.1f} MB, "
        f"H={args.inner_steps}, {args.tokens_per_step} tokens/step"
    )
    if any(snap.filled.values()):
        print(f"filled missing measurements with conservative defaults: {dict(snap.filled)}")
    print(f"{'assignment':<22}{'round s':>10}{'compute s':>11}{'comm s':>10}{'balance s':>11}{'x ours':>8}")

    def row(name: str, c) -> None:
        parts = (c.round_seconds, c.compute_seconds, c.communication_seconds, c.token_balance_seconds)
        print(
            f"{name:<22}" + "".join(f"{x:>{w}.3f}" for x, w in zip(parts, (10, 11, 10, 11), strict=True)),
            end="",
        )
        print(f"{c.round_seconds / base:>8.2f}")

    row(f"ours ({ours.method})", ours.cost)
    row("greedy", greedy)
    print(f"{'random (mean of 10)':<22}{rnd:>10.3f}{'':>32}{rnd / base:>8.2f}")
    if 1 < g < n and count_balanced_partitions(n, g) <= EXHAUSTIVE_LIMIT:
        row("exhaustive optimum", plan(snap, args.seed, method="exhaustive").cost)
    print(f"planned in {seconds:.2f} s ({ours.generations} generations)")
    if ours.cost.uncovered_paths:
        print(f"uncovered paths (fewer peers than paths): {list(ours.cost.uncovered_paths)}")
    if ours.cost.unplaced_peers:
        print(f"peers without memory for a path: {list(ours.cost.unplaced_peers)}")
    return 0
