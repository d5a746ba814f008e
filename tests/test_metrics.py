"""PeerMetrics: values after observations, HTTP scraping, label validation, independent registries."""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from monitoring.metrics import BAD_PART_REASONS, OUTCOMES, PeerMetrics


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        return response.read().decode()


@pytest.fixture
def metrics():
    m = PeerMetrics(run="run-a", peer_id="12D3KooWpeer", path="0-1", version="0.1.0")
    yield m
    m.shutdown()


def test_serve_and_scrape(metrics):
    port = metrics.serve(0, host="127.0.0.1")
    assert port > 0
    metrics.observe_step(tokens=512, loss=2.5, tokens_per_second=1000.0)
    metrics.observe_step(tokens=512, loss=2.25, tokens_per_second=1100.0)
    metrics.observe_round("averaged", seconds=1.5, group_size=4, bytes_sent=1000, bytes_received=3000)
    metrics.observe_round("alone", seconds=0.0, group_size=1, bytes_sent=0, bytes_received=0, outer_round=7)
    metrics.bad_part("nonfinite")
    metrics.set_holders("L0M1", 3)
    metrics.set_peers_seen(5)

    s = samples(scrape(port))
    assert s[("pathswarm_tokens_total", ())] == 1024
    assert s[("pathswarm_inner_steps_total", ())] == 2
    assert s[("pathswarm_loss", ())] == 2.25
    assert s[("pathswarm_tokens_per_second", ())] == 1100.0
    assert s[("pathswarm_outer_rounds_total", (("outcome", "averaged"),))] == 1
    assert s[("pathswarm_outer_rounds_total", (("outcome", "alone"),))] == 1
    for outcome in ("excluded", "behind", "failed"):  # exported as zero from the start
        assert s[("pathswarm_outer_rounds_total", (("outcome", outcome),))] == 0
    assert s[("pathswarm_outer_round", ())] == 7
    assert s[("pathswarm_group_size", ())] == 1
    assert s[("pathswarm_bytes_sent_total", ())] == 1000
    assert s[("pathswarm_bytes_received_total", ())] == 3000
    assert s[("pathswarm_bad_parts_total", (("reason", "nonfinite"),))] == 1
    assert s[("pathswarm_bad_parts_total", (("reason", "norm"),))] == 0
    assert s[("pathswarm_module_holders", (("module", "L0M1"),))] == 3
    assert s[("pathswarm_peers_seen", ())] == 5
    # Only the averaged round ran an all-reduce.
    assert s[("pathswarm_allreduce_seconds_count", ())] == 1
    assert s[("pathswarm_allreduce_seconds_sum", ())] == 1.5
    assert s[("pathswarm_allreduce_seconds_bucket", (("le", "0.05"),))] == 0
    assert s[("pathswarm_allreduce_seconds_bucket", (("le", "120.0"),))] == 1
    peer = [k for k in s if k[0] == "pathswarm_peer_info"]
    assert peer == [("pathswarm_peer_info", (("path", "0-1"), ("peer_id", "12D3KooWpeer"), ("run", "run-a")))]
    build = dict(next(k for k in s if k[0] == "pathswarm_build_info")[1])
    assert build["version"] == "0.1.0" and build["torch"] and build["python"]


def test_round_gauges_count_rounds_not_module_syncs(metrics):
    # one round syncs every module of the path: the round gauge must not count the syncs (3 modules
    # over 5 rounds once read 15 while the log said round 5)
    for round_index in range(1, 6):
        for _ in range(3):
            metrics.observe_round("averaged", seconds=0.1, group_size=2, bytes_sent=1, bytes_received=1)
        metrics.set_rounds(swarm_round=round_index + 10, own_rounds=round_index)
    s = samples(metrics.render().decode())
    assert s[("pathswarm_outer_round", ())] == 15  # the swarm's round, as in the log's `round N`
    assert s[("pathswarm_own_rounds", ())] == 5
    assert s[("pathswarm_outer_rounds_total", (("outcome", "averaged"),))] == 15


def test_render_has_help(metrics):
    text = metrics.render().decode()
    assert "# HELP pathswarm_tokens_total" in text
    assert "# TYPE pathswarm_allreduce_seconds histogram" in text


def test_unknown_labels_raise(metrics):
    with pytest.raises(ValueError):
        metrics.observe_round("great", seconds=1.0, group_size=2, bytes_sent=0, bytes_received=0)
    with pytest.raises(ValueError):
        metrics.bad_part("ugly")
    s = samples(metrics.render().decode())
    assert all(s[("pathswarm_outer_rounds_total", (("outcome", o),))] == 0 for o in OUTCOMES)
    assert all(s[("pathswarm_bad_parts_total", (("reason", r),))] == 0 for r in BAD_PART_REASONS)


def test_two_peers_do_not_collide():
    a = PeerMetrics(run="r", peer_id="a", path="0", version="0.1.0")
    b = PeerMetrics(run="r", peer_id="b", path="1", version="0.1.0")
    try:
        port_a, port_b = a.serve(0, host="127.0.0.1"), b.serve(0, host="127.0.0.1")
        assert port_a != port_b
        a.observe_step(tokens=10, loss=1.0, tokens_per_second=5.0)
        sa, sb = samples(scrape(port_a)), samples(scrape(port_b))
        assert sa[("pathswarm_tokens_total", ())] == 10
        assert sb[("pathswarm_tokens_total", ())] == 0
        with pytest.raises(RuntimeError):
            a.serve(0, host="127.0.0.1")
    finally:
        a.shutdown()
        b.shutdown()
        a.shutdown()  # idempotent
