"""Heterogeneity-aware scheduling (Yuan et al. 2022, arXiv 2206.01288) for a DiPaCo swarm.

From a snapshot of the swarm's measurements (tokens/s and memory per peer, latency and bandwidth per
pair, read from the DHT) the scheduler decides which path each peer trains and which holders of a
module average together, so that a round (H inner steps, then averaging) is as short as possible.

* `snapshot`: the typed, symmetrised, gap-filled input (`SwarmSnapshot`, `GridSpec`);
* `cost`: the paper's cost model (compute, DATAP-COST, PIPELINE-COST, token balance);
* `partition`: balanced partitions, the random and greedy baselines, exhaustive search;
* `search`: the paper's hybrid genetic algorithm, with its local search in `local`;
* `plan`: `plan` and `replan` (hysteresis on churn);
* `online`: `online_decision`, whether a live peer moves: the plan's gain against the move's cost;
* `groups`: `averaging_groups`, rotating subgroups of a widely held module;
* `scenarios`: the paper's five network scenarios and JSON scenario files.
"""

from peer.scheduler.cost import Assignment, CostBreakdown, CostModel, datap_cost, pipeline_cost, round_cost
from peer.scheduler.groups import averaging_groups, rotation_period
from peer.scheduler.online import GridState, OnlineDecision, online_decision
from peer.scheduler.partition import (
    count_balanced_partitions,
    greedy_assignment,
    random_assignment,
)
from peer.scheduler.plan import Plan, Replan, plan, random_cost, replan
from peer.scheduler.scenarios import SCENARIOS, load_scenario, load_scenario_json, make_scenario, paper_grid
from peer.scheduler.search import SearchConfig
from peer.scheduler.snapshot import GridSpec, LinkMeasurement, PeerMeasurement, SwarmSnapshot

__all__ = [
    "SCENARIOS",
    "Assignment",
    "CostBreakdown",
    "CostModel",
    "GridSpec",
    "GridState",
    "LinkMeasurement",
    "OnlineDecision",
    "PeerMeasurement",
    "Plan",
    "Replan",
    "SearchConfig",
    "SwarmSnapshot",
    "averaging_groups",
    "count_balanced_partitions",
    "datap_cost",
    "greedy_assignment",
    "load_scenario",
    "load_scenario_json",
    "make_scenario",
    "online_decision",
    "paper_grid",
    "pipeline_cost",
    "plan",
    "random_assignment",
    "random_cost",
    "replan",
    "rotation_period",
    "round_cost",
]
