"""The churn simulation (benchmarks/swarm_sim.py): orphaned paths and their recovery, the oracle bound,
reproducibility."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.swarm_sim import SwarmSim, simulate
from peer.model.grid import ModelConfig

pytestmark = pytest.mark.swarm

GRID = ModelConfig(n_levels=2, modules_per_level=8)  # 64 paths: 200 peers hold about 3 each


def started_swarm(n: int = 200, seed: int = 3) -> SwarmSim:
    sim = SwarmSim(n, seed, GRID)
    for _ in range(n):
        sim.new_peer(0.0, residual=True)
    sim.replan(first=True)
    return sim


def coverage(sim: SwarmSim) -> float:
    return np.count_nonzero(sim.path_count) / GRID.n_paths


def test_a_path_whose_holders_all_leave_is_uncovered_until_the_claim_rule_sends_a_joiner_there():
    sim = started_swarm()
    assert coverage(sim) == 1.0
    for pid in [p for p, c in sim.claims.items() if c.path == 5]:
        sim.leave(pid)
    assert sim.path_count[5] == 0 and coverage(sim) < 1.0
    assert sim.path_orphaned == 1
    pid, _ = sim.new_peer(sim.now)
    sim.join([pid])
    assert sim.claims[pid].path == 5
    assert coverage(sim) == 1.0


def test_a_module_is_orphaned_when_no_path_through_it_has_a_holder():
    sim = started_swarm()
    # level-0 module 2 lies on paths 16..23 (the first digit of the path is 2)
    for pid in [p for p, c in sim.claims.items() if c.path // 8 == 2]:
        sim.leave(pid)
    assert sim.module_orphaned == 1
    assert sim.path_orphaned == 8


@pytest.fixture(scope="module")
def short_run() -> dict:
    return simulate(100, 0.5, 7, GRID, replan_minutes=10.0, progress=False)


def test_throughput_is_below_the_oracle_but_positive(short_run):
    assert short_run["lost_tokens"] > 0
    assert 0.0 < short_run["throughput_over_oracle"] < 1.0
    assert 0.0 < short_run["coverage_mean"] <= 1.0
    assert short_run["replans"] == 4  # t = 0, then every 10 simulated minutes


def test_the_same_seed_gives_the_same_swarm(short_run):
    again = simulate(100, 0.5, 7, GRID, replan_minutes=10.0, progress=False)
    for key in ("coverage_mean", "throughput_over_oracle", "modules_orphaned", "paths_orphaned", "series"):
        assert again[key] == short_run[key], key
    other = simulate(100, 0.5, 8, GRID, replan_minutes=10.0, progress=False)
    assert other["series"] != short_run["series"]
