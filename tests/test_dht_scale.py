"""The DHT scale benchmark's swarm at a small size (benchmarks/dht_scale.py): light processes, each a
real DHT node publishing and reading claims. Every view converges; a node that leaves is gone from
the others' views within a heartbeat or two, while a killed one stays until its claim's TTL runs out."""

from __future__ import annotations

import pytest

from benchmarks.dht_scale import run_size
from dht.keys import CLAIM_TTL_SECONDS

HEARTBEAT = 2.0


@pytest.mark.timeout(170)
@pytest.mark.swarm
def test_views_converge_and_a_leaving_node_vanishes_long_before_a_killed_one(tmp_path):
    r = run_size(6, tmp_path, heartbeat=HEARTBEAT, steady_seconds=6.0, departures=1)
    assert r["nodes"] == 6 and r["client_nodes"] == 1
    assert r["converged_nodes"] == 6 and r["convergence_seconds_max"] < 30 and r["view_coverage_min"] == 1.0
    # every node's DHT process sent RPCs (its own stores and reads), counted where they happen
    assert r["rpcs_per_node_per_minute"] > 0 and r["rpcs_by_kind_per_node_per_minute"]["call_store"] > 0
    # a leaving claim takes the node out of every view at the next read
    assert r["still_visible_at_deadline"] == 0
    assert max(r["visible_after_leave_seconds"]) < 3 * HEARTBEAT + 2
    # a killed node's claim lives out its TTL (it was renewed at most a heartbeat before the kill)
    assert min(r["visible_after_kill_seconds"]) > CLAIM_TTL_SECONDS - 2 * HEARTBEAT
