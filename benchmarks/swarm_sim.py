"""A churning swarm of 1,000 and 10,000 peers, simulated: `python -m benchmarks.swarm_sim --out DIR`.

A discrete-event simulation whose decisions are the project's own code, imported, not re-written:
joiners claim a path with `peer.swarm.claims.choose_path` and re-check with `should_move` (as
`Membership.claim_path` does), the swarm re-plans with `peer.scheduler.replan` (hysteresis,
`min_gain` 0.1 as in `SchedulerConfig`) on a `SwarmSnapshot` of the online peers, and round
times come from the scheduler's cost model. Only the churn is invented here.

Churn. Measurement studies of P2P and volunteer systems found session lengths heavy-tailed (Weibull
or lognormal fits; Stutzbach & Rejaie, IMC 2006; Kondo et al., volunteer desktop grids, 2007), with
medians of tens of minutes. Here a session is lognormal with median `--median-minutes` (30) and
sigma 1.5 (mean about 92 min). Joins come in bursts (a Poisson process of bursts, 1 + Poisson(2)
peers each, a mailing-list post or a restarted cluster), at the rate that keeps about N peers
online; the N peers online at the start draw the residual of a length-biased session, so the swarm
starts in its steady state. Every peer draws a world-wide region (Yuan et al.'s eight AWS regions,
`peer.scheduler.scenarios`) and a speed of 0.5x, 1x or 2x a V100 (`compute="mixed"`). One RNG,
seeded by `--seed`: a run is reproducible up to the wall-clock timings.

Workload: the paper's 16 x 16 DiPaCo grid (256 paths, trunk + 32 level modules), each path a GPT-3
XL tasklet as in `benchmarks/scheduler.py`, in DiLoCo rounds of H = 100 inner steps with 4-bit outer
gradients. Everyone syncs at round boundaries; a round lasts the plan's round time R (compute of
the slowest peer, slowest group's DATAP-COST, token-balance penalty).

What the swarm does when a path loses all holders (read from peer/swarm): nothing at once. Live
peers never leave their path except a joiner's re-check (`should_move`) and rotation
(`plan_rotation`), which only acts with fewer peers than paths. The path stays uncovered until the
next joiner, whose claim rule puts it on the least-covered path, i.e. an uncovered one (ties by a
hash of peer id and path); no re-plan moves a peer that is already training. The modules' state
survives only where a keeper holds it (`peer.swarm.keeper`: the last holder hands its modules over
when it leaves cleanly; a joiner takes a module from a keeper when no holder has it); without a
keeper it restarts from initial weights.
The simulation counts a module as orphaned while no online peer holds it.

Re-plans: at t = 0 (`plan`, from scratch: the peers that start a run together take their lines of
it) and every `--replan-minutes` of simulated time (`replan` on the claims as they are: what a
joiner of a planned run computes). A live peer acts only on its own line of a plan, when it joins,
so a re-plan moves nobody who is training; the peers it would move are recorded
(`plan_would_move`), and the round goes on at the current claims' cost. The planner is timed in real
seconds, snapshot building apart. Above 4,096 peers the search runs with
`LARGE_N_SEARCH` (the planner's own `SearchConfig` knobs: fewer individuals and passes, still
deterministic) so that a re-plan of 10,000 peers stays under a minute on 2 cores.

Throughput against an oracle. Each placed peer does H steps of `tokens_per_step` tokens per round,
accruing evenly over the round: the swarm's token rate is (peers online) x H x tokens_per_step / R.
The *oracle* sees the same joins, departures and round times but knows every departure in advance:
it has a leaving peer sync just before it leaves and never moves a peer mid-round, so every token
computed counts. The swarm loses the tokens a peer computed since its last round boundary (or its
join) when it leaves or is moved. `throughput_over_oracle` = (oracle tokens - lost tokens) / oracle
tokens, over the simulated time; it isolates the cost of not knowing the future, not plan quality.

Writes DIR/swarm_sim.json, DIR/swarm_sim.md and DIR/swarm_sim.png; prints the table.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import platform
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.swarm_sim_report import markdown, plain, plot
from peer.model.grid import ModelConfig, all_module_ids, path_from_index, path_module_ids
from peer.scheduler import Assignment, SearchConfig, SwarmSnapshot, paper_grid, plan, replan, round_cost
from peer.scheduler.scenarios import (
    TASKLET_PARAMS,
    V100_MEMORY_BYTES,
    V100_TOKENS_PER_SECOND,
    scenario_matrices,
)
from peer.swarm.claims import choose_path, should_move

#: the planner's knobs above LARGE_N_PEERS: 3 local searches instead of ~26 (see the docstring)
LARGE_N_SEARCH = SearchConfig(
    population=2,
    offspring_per_generation=1,
    generations=1,
    local_search_passes=2,
    kl_passes=16,
    descent_steps=8,
)
LARGE_N_PEERS = 4096
MIN_GAIN = 0.1  # SchedulerConfig.replan_min_gain
SIGMA = 1.5
BURST_EXTRA_MEAN = 2.0
SPEEDS = (0.5, 1.0, 1.0, 2.0)


@dataclass
class Claim:
    """What `choose_path` and `should_move` read of a ClaimRecord."""

    path: int
    client_mode: bool = False


def region_links() -> tuple[np.ndarray, np.ndarray]:
    """8 x 8 latency (s) and bandwidth (B/s) between world-wide regions, inside a region on the
    diagonal, read from the scenario itself (two peers per region)."""
    _, lat, bw = scenario_matrices("world_wide", 16)
    return lat[0::2, 1::2].copy(), bw[0::2, 1::2].copy()


class SwarmSim:
    """The swarm's state and its event handlers; `run` drives them from a seeded event queue."""

    def __init__(self, n_peers: int, seed: int, cfg: ModelConfig, median_minutes: float = 30.0):
        self.n_target, self.seed, self.cfg = n_peers, seed, cfg
        self.rng = np.random.default_rng(seed)
        self.mu = np.log(median_minutes * 60.0)
        self.grid = paper_grid(cfg.n_paths, inner_steps=100, fragment_bytes=TASKLET_PARAMS / 2)
        self.region_lat, self.region_bw = region_links()
        modules = all_module_ids(cfg)
        self.incidence = np.zeros((cfg.n_paths, len(modules)), dtype=np.int64)
        for p in range(cfg.n_paths):
            for m in path_module_ids(cfg, path_from_index(cfg, p)):
                self.incidence[p, modules.index(m)] = 1
        self.claims: dict[str, Claim] = {}
        self.region: dict[str, int] = {}
        self.speed: dict[str, float] = {}
        self.joined: dict[str, float] = {}
        self.path_count = np.zeros(cfg.n_paths, dtype=np.int64)
        self.next_id = 0
        self.now = 0.0
        self.round_start, self.round_seconds = 0.0, 0.0
        self.oracle_tokens = self.lost_tokens = 0.0
        self.covered_time = self.online_time = 0.0
        self.path_orphaned = self.module_orphaned = 0
        self.module_orphan_seconds = 0.0
        self.replans: list[dict] = []

    # --- bookkeeping --------------------------------------------------------------------------

    def rate(self) -> float:
        """Tokens per second of one placed peer."""
        return (
            self.grid.inner_steps * self.grid.tokens_per_step / self.round_seconds
            if self.round_seconds
            else 0.0
        )

    def module_holders(self) -> np.ndarray:
        return self.path_count @ self.incidence

    def advance(self, t: float) -> None:
        """Accrues time-weighted totals up to `t` (nothing changes between events)."""
        dt = t - self.now
        if dt > 0:
            self.oracle_tokens += len(self.claims) * self.rate() * dt
            self.covered_time += np.count_nonzero(self.path_count) / self.cfg.n_paths * dt
            self.online_time += dt
            self.module_orphan_seconds += np.count_nonzero(self.module_holders() == 0) * dt
            self.now = t
        if self.round_seconds > 0 and t >= self.round_start + self.round_seconds:
            self.round_start += np.floor((t - self.round_start) / self.round_seconds) * self.round_seconds

    def unsynced(self, pid: str) -> float:
        """Tokens `pid` computed since its last sync (round boundary or join)."""
        return self.rate() * (self.now - max(self.round_start, self.joined[pid]))

    def set_path(self, pid: str, path: int | None) -> None:
        before = self.module_holders() == 0
        uncovered = int(np.count_nonzero(self.path_count == 0))
        if pid in self.claims:
            self.path_count[self.claims.pop(pid).path] -= 1
        if path is not None:
            self.claims[pid] = Claim(path)
            self.path_count[path] += 1
        self.module_orphaned += int(np.count_nonzero((self.module_holders() == 0) & ~before))
        self.path_orphaned += max(0, int(np.count_nonzero(self.path_count == 0)) - uncovered)

    # --- peers --------------------------------------------------------------------------------

    def new_peer(self, t: float, residual: bool = False) -> tuple[str, float]:
        """A fresh peer (region, speed) and when it leaves; `residual`: already online at t = 0."""
        pid = f"peer-{self.next_id:07d}"
        self.next_id += 1
        self.region[pid] = int(self.rng.integers(0, len(self.region_lat)))
        self.speed[pid] = float(self.rng.choice(SPEEDS))
        self.joined[pid] = t
        if residual:  # length-biased lognormal is lognormal(mu + sigma^2); a uniform point of it
            length = self.rng.lognormal(self.mu + SIGMA**2, SIGMA) * self.rng.uniform()
        else:
            length = self.rng.lognormal(self.mu, SIGMA)
        return pid, t + length

    def join(self, pids: list[str]) -> None:
        """A burst: each joiner claims from the view before the burst (they do not see each other
        yet), then all re-check once every claim is visible, as `Membership.claim_path` does."""
        view = dict(self.claims)
        chosen = {pid: choose_path(self.cfg, view, pid) for pid in pids}
        for pid, path in chosen.items():
            self.set_path(pid, path)
        settled = dict(self.claims)
        moves = {pid: should_move(self.cfg, settled, pid, chosen[pid]) for pid in pids}
        for pid, target in moves.items():
            if target is not None:
                self.set_path(pid, target)

    def leave(self, pid: str) -> None:
        if pid in self.claims:
            self.lost_tokens += self.unsynced(pid)
            self.set_path(pid, None)
        for table in (self.region, self.speed, self.joined):
            table.pop(pid, None)

    # --- planning -----------------------------------------------------------------------------

    def snapshot(self) -> SwarmSnapshot:
        ids = sorted(self.claims) if self.claims else sorted(self.region)
        r = np.array([self.region[p] for p in ids])
        lat = self.region_lat[np.ix_(r, r)]
        bw = self.region_bw[np.ix_(r, r)]
        tps = np.array([self.speed[p] for p in ids]) * V100_TOKENS_PER_SECOND
        mem = np.full(len(ids), V100_MEMORY_BYTES)
        return SwarmSnapshot.from_matrices(ids, lat, bw, self.grid, tps, mem)

    def replan(self, first: bool = False) -> dict:
        start = time.perf_counter()
        snap = self.snapshot()
        built = time.perf_counter() - start
        config = LARGE_N_SEARCH if snap.n_peers > LARGE_N_PEERS else None
        start = time.perf_counter()
        would_move = 0
        if first:
            result = plan(snap, self.seed, config)
            seconds = time.perf_counter() - start
            cost, taken = result.cost, True
            for pid, path in result.assignment.path_of_peer.items():
                self.set_path(pid, path)
        else:
            current = Assignment({p: c.path for p, c in self.claims.items()}, self.cfg.n_paths)
            fresh = replan(current, snap, self.seed, MIN_GAIN, config)
            seconds = time.perf_counter() - start
            # A live peer acts only on its own line of a plan, when it joins (Membership._choose_path):
            # peers already training never follow a re-plan, so it moves nobody here either; the
            # round goes on at the current claims' cost. What it would have moved is recorded.
            cost, taken, would_move = round_cost(current, snap), fresh.replanned, len(fresh.moved_peers)
        self.round_start, self.round_seconds = self.now, cost.round_seconds
        del snap
        gc.collect()
        record = {
            "t_hours": self.now / 3600,
            "peers": len(self.claims),
            "plan_seconds": seconds,
            "snapshot_seconds": built,
            "round_seconds": cost.round_seconds,
            "communication_seconds": cost.communication_seconds,
            "fresh_plan_won": bool(taken),
            "plan_would_move": would_move,
        }
        self.replans.append(record)
        return record


def simulate(
    n_peers: int,
    hours: float,
    seed: int,
    cfg: ModelConfig,
    replan_minutes: float = 30.0,
    sample_minutes: float = 1.0,
    progress: bool = True,
) -> dict:
    """Runs one swarm for `hours` of simulated time; returns its summary and time series."""
    sim = SwarmSim(n_peers, seed, cfg)
    end = hours * 3600.0
    mean_session = np.exp(sim.mu + SIGMA**2 / 2)
    burst_rate = n_peers / mean_session / (1.0 + BURST_EXTRA_MEAN)
    events: list[tuple[float, int, str, object]] = []
    seq = iter(range(1 << 62))

    def push(t: float, kind: str, data: object = None) -> None:
        if t <= end:
            heapq.heappush(events, (t, next(seq), kind, data))

    for _ in range(n_peers):
        pid, leaves = sim.new_peer(0.0, residual=True)
        push(leaves, "leave", pid)
    sim.replan(first=True)
    push(sim.rng.exponential(1 / burst_rate), "burst")
    for k in range(1, int(end / (replan_minutes * 60)) + 1):
        push(k * replan_minutes * 60, "replan")
    series = {"t_hours": [], "coverage": [], "online": [], "orphaned_modules": []}
    next_sample = 0.0
    bar = _bar(end, f"{n_peers} peers", progress)
    while events:
        t, _, kind, data = heapq.heappop(events)
        while next_sample <= t:
            sim.advance(next_sample)
            series["t_hours"].append(next_sample / 3600)
            series["coverage"].append(np.count_nonzero(sim.path_count) / cfg.n_paths)
            series["online"].append(len(sim.claims))
            series["orphaned_modules"].append(int(np.count_nonzero(sim.module_holders() == 0)))
            next_sample += sample_minutes * 60
        sim.advance(t)
        bar.update(t - bar.n)
        if kind == "leave":
            sim.leave(data)
        elif kind == "burst":
            joiners = []
            for _ in range(1 + sim.rng.poisson(BURST_EXTRA_MEAN)):
                pid, leaves = sim.new_peer(t)
                joiners.append(pid)
                push(leaves, "leave", pid)
            sim.join(joiners)
            push(t + sim.rng.exponential(1 / burst_rate), "burst")
        else:
            rec = sim.replan()
            bar.set_postfix(plan_s=f"{rec['plan_seconds']:.1f}", peers=rec["peers"])
    sim.advance(end)
    bar.close()
    plan_s = [r["plan_seconds"] for r in sim.replans]
    return {
        "peers": n_peers,
        "simulated_hours": hours,
        "seed": seed,
        "plan_seconds_max": max(plan_s),
        "plan_seconds_mean": float(np.mean(plan_s)),
        "snapshot_seconds_max": max(r["snapshot_seconds"] for r in sim.replans),
        "replans": len(sim.replans),
        "replans_per_hour": (len(sim.replans) - 1) / hours,
        "fresh_plans_won": sum(r["fresh_plan_won"] for r in sim.replans[1:]),
        "coverage_mean": sim.covered_time / sim.online_time,
        "coverage_min": float(min(series["coverage"])),
        "paths_orphaned": sim.path_orphaned,
        "modules_orphaned": sim.module_orphaned,
        "module_orphaned_hours": sim.module_orphan_seconds / 3600,
        "throughput_over_oracle": (sim.oracle_tokens - sim.lost_tokens) / sim.oracle_tokens,
        "oracle_tokens": sim.oracle_tokens,
        "lost_tokens": sim.lost_tokens,
        "peers_joined": sim.next_id - n_peers,
        "online_mean": float(np.mean(series["online"])),
        "replan_log": sim.replans,
        "series": series,
    }


def _bar(total: float, label: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="sim s", disable=not enabled, mininterval=2.0, leave=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.swarm_sim", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--peers", default="1000,10000", help="peer counts, comma-separated")
    p.add_argument("--hours", type=float, default=2.0, help="simulated hours per peer count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replan-minutes", type=float, default=30.0)
    p.add_argument(
        "--grid", default="2x16", help="levels x modules per level (2x16: the paper's 16 x 16 grid)"
    )
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    levels, per_level = (int(x) for x in args.grid.split("x"))
    cfg = ModelConfig(n_levels=levels, modules_per_level=per_level)
    out = {}
    for n in (int(x) for x in args.peers.split(",")):
        start = time.perf_counter()
        out[str(n)] = simulate(n, args.hours, args.seed, cfg, args.replan_minutes)
        out[str(n)]["wall_seconds"] = time.perf_counter() - start
        print(f"{n} peers: {_row(out[str(n)])}", flush=True)
    out["config"] = {
        "grid": f"{cfg.n_levels} levels x {cfg.modules_per_level} modules = {cfg.n_paths} paths",
        "workload": "GPT-3 XL tasklet per path, H=100, 4-bit outer gradients",
        "sessions": f"lognormal, median {30} min, sigma {SIGMA}",
        "bursts": f"Poisson process, 1 + Poisson({BURST_EXTRA_MEAN}) peers each",
        "replan_minutes": args.replan_minutes,
        "min_gain": MIN_GAIN,
        "large_n_search": repr(LARGE_N_SEARCH),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    return out


def _row(r: dict) -> str:
    return (
        f"plan max {r['plan_seconds_max']:.1f} s, coverage {r['coverage_mean']:.4f}, "
        f"modules orphaned {r['modules_orphaned']}, throughput/oracle {r['throughput_over_oracle']:.4f}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (args.out / "swarm_sim.json").write_text(json.dumps(result, indent=1, default=plain) + "\n")
    table = markdown(result)
    (args.out / "swarm_sim.md").write_text(table)
    plot(result, args.out / "swarm_sim.png")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
