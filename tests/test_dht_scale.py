"""The DHT scale benchmark's swarm at a small size (benchmarks/dht_scale.py): light processes, each a
real DHT node publishing and reading claims. Every view converges; a node that leaves is gone from
the others' views within a heartbeat or two, while a killed one stays until its claim's TTL runs out."""

from __future__ import annotations

import pytest

from benchmarks.dht_scale import run_size

HEARTBEAT = 2.0
WATCH = 4 * HEARTBEAT + 2  # well past the leaver's 3 heartbeats + 2 s, well before the TTL


@pytest.mark.timeout(170)
@pytest.mark.swarm
def test_views_converge_and_a_leaving_node_vanishes_long_before_a_killed_one(tmp_path):
    # the killed node's claim is watched for a few heartbeats, not its TTL (`test_expired_claims_disappear`)
    r = run_size(6, tmp_path, heartbeat=HEARTBEAT, steady_seconds=6.0, departures=1, kill_watch_seconds=WATCH)
    assert r["nodes"] == 6 and r["client_nodes"] == 1
    assert r["converged_nodes"] == 6 and r["convergence_seconds_max"] < 30 and r["view_coverage_min"] == 1.0
    # every node's DHT process sent RPCs (its own stores and reads), counted where they happen
    assert r["rpcs_per_node_per_minute"] > 0 and r["rpcs_by_kind_per_node_per_minute"]["call_store"] > 0
    # a leaving claim takes the node out of every view at the next read
    assert r["still_visible_at_deadline"] == r["killed_still_visible"]
    assert max(r["visible_after_leave_seconds"]) < 3 * HEARTBEAT + 2
    # a killed node's claim lives on in every view (to its TTL, which the DHT's expiry test covers)
    assert r["killed_still_visible"] == 4 and not r["visible_after_kill_seconds"]  # 4 observers left
