"""The swarm monitor's view and metrics from real ClaimRecords: states, holders, orphaned and
under-replicated modules, fragment lag, monotonic swarm totals, capped per-peer series, naming."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dht.schema import ClaimRecord, KeptModule, StashRecord
from monitoring.swarm.exporter import SwarmCollector, make_registry
from monitoring.swarm.page import render_page
from monitoring.swarm.rates import MeasuredRates
from monitoring.swarm.status import status_dict
from monitoring.swarm.view import build_view, select_claims
from peer.model.grid import ModelConfig, path_from_index, path_module_ids

GRID = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64, n_levels=2, modules_per_level=2)
# path 0 = trunk l0m0 l1m0, 1 = trunk l0m0 l1m1, 2 = trunk l0m1 l1m0, 3 = trunk l0m1 l1m1


def claim(peer: str, path: int, modules: list[str] | None = None, **kw) -> ClaimRecord:
    """A claim on `path`, holding its path's modules unless `modules` says otherwise."""
    modules = path_module_ids(GRID, path_from_index(GRID, path)) if modules is None else modules
    return ClaimRecord(peer_id=peer, path=path, modules=modules, **kw)


def swarm() -> list[tuple[ClaimRecord, float]]:
    records = [
        claim("QmA", 0, ["trunk", "l0m0", "l1m0"], tokens_per_second=100.0, loss=3.0, step=40,
              module_rounds={"trunk": [4, 4], "l0m0": [4, 3], "l1m0": [4, 4]},
              sync_outcomes={"averaged": 5, "failed": 1}, bad_parts={"norm": 2}, bytes_sent=1000,
              software_version="0.3.0", reachability="direct", tokens_total=4000),
        claim("QmB", 1, ["trunk", "l0m0", "l1m1"], tokens_per_second=50.0, loss=2.0, step=30,
              module_rounds={"trunk": [1, 1], "l0m0": [1, 1], "l1m1": [1, 1]},
              sync_outcomes={"averaged": 3, "weird": 9}, software_version="0.2.0", reachability="relay"),
        claim("QmC", 2, ["trunk", "l0m1", "l1m0"], ready=False, tokens_per_second=70.0),
        claim("QmD", 3, ["trunk", "l0m1", "l1m1"], leaving=True, tokens_per_second=10.0),
    ]  # fmt: skip
    return [(r, 1e12) for r in records]


def test_view_counts_states_holders_orphans_and_lag():
    view = build_view("r", "f" * 64, GRID, select_claims(swarm()))
    assert view.by_state == {"joining": 1, "training": 2, "leaving": 1}
    assert view.path_holders == {0: 1, 1: 1, 2: 0, 3: 0}
    # only ready, staying peers hold a module: C is catching up, D is leaving
    assert view.module_holders == {"trunk": 2, "l0m0": 2, "l0m1": 0, "l1m0": 1, "l1m1": 1}
    assert view.orphaned == ["l0m1"]
    assert view.under_replicated == ["l0m1", "l1m0", "l1m1"]
    assert view.uncovered_paths == [2, 3]
    # fragment 0 of trunk: 4 vs 1 -> 3; l0m0: [4,3] vs [1,1] -> max(3, 2)
    assert view.module_round_spread == {"trunk": 3, "l0m0": 3, "l0m1": 0, "l1m0": 0, "l1m1": 0}
    assert view.tokens_per_second == 0.0  # nothing measured yet: claimed rates are not summed
    assert view.loss_by_path == {0: 3.0, 1: 2.0}
    # totals are summed over every live peer; a key no pathswarm peer writes is filed as "other"
    assert view.sync_outcomes == {"averaged": 8, "failed": 1, "other": 9}
    assert view.bad_parts == {"norm": 2}
    assert view.by_version == {"0.3.0": 1, "0.2.0": 1, "unknown": 2}
    assert view.by_reachability == {"direct": 1, "relay": 1, "unreachable": 0, "unknown": 2}
    assert view.grid[2] == {"trunk": 2, "l0m1": 0, "l1m0": 1}


def test_a_flooded_shard_is_capped_per_shard_admitted_claims_first_one_claim_per_peer():
    records = [(claim(f"Qm{i:05d}", 0), 1e12) for i in range(50)]
    records += [(claim("QmAdmitted", 0, step=5, admission="ok"), 1e12)]
    records += [(claim("QmAdmitted", 0, step=7, admission="ok"), 2e12)]
    records += [(claim("QmOtherShard", 1), 1e12)]
    selected = select_claims(records, "monitor", lambda peer, token: token == "ok", cap=10)
    assert selected.capped and selected.records_read == 53
    # shard 0 kept 10 records: both of the admitted peer's (one claim, its latest) and 8 others
    assert selected.claims["QmAdmitted"].step == 7
    assert len([p for p, c in selected.claims.items() if c.path == 0]) == 9
    # shard 1 is not crowded out by shard 0's flood
    assert "QmOtherShard" in selected.claims


def test_keepers_count_as_kept_copies_not_holders():
    stash = [StashRecord(peer_id="QmK", modules={"l0m1": KeptModule(fragment_rounds=[3], digest="a" * 64)})]
    view = build_view("r", "f" * 64, GRID, select_claims(swarm()), stash)
    assert view.module_kept["l0m1"] == 1 and view.module_holders["l0m1"] == 0


def scrape(collector: SwarmCollector) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(generate_latest(make_registry(collector)).decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_swarm_counters_only_grow_while_peers_restart_and_leave():
    collector = SwarmCollector()
    collector.publish(build_view("r", "f" * 64, GRID, select_claims(swarm())), 0.1, 2)
    first = scrape(collector)
    assert first["pathswarm_swarm_syncs_total"][(("outcome", "averaged"),)] == 8
    # A restarted (counts from zero again, now 2), B gone: the swarm total grows by A's new 2
    restarted = [(claim("QmA", 0, sync_outcomes={"averaged": 2}), 1e12)]
    collector.publish(build_view("r", "f" * 64, GRID, select_claims(restarted)), 0.1, 2)
    second = scrape(collector)
    assert second["pathswarm_swarm_syncs_total"][(("outcome", "averaged"),)] == 10
    assert second["pathswarm_monitor_dht_reads_total"][()] == 4
    # the departed peer's series went with it
    peers = {dict(k)["peer_id"] for k in second["pathswarm_swarm_peer_info"]}
    assert peers == {"QmA"}


def test_per_peer_series_are_capped_and_the_rest_counted():
    records = [(claim(f"Qm{i:04d}", i % 4), 1e12) for i in range(30)]
    measured = ({f"Qm{i:04d}": float(i) for i in range(30)}, set())
    collector = SwarmCollector(max_peer_series=5)
    collector.publish(build_view("r", "f" * 64, GRID, select_claims(records), rates=measured), 0.1, 2)
    metrics = scrape(collector)
    shown = {dict(k)["peer_id"] for k in metrics["pathswarm_swarm_peer_tokens_per_second"]}
    assert shown == {f"Qm{i:04d}" for i in range(25, 30)}  # the fastest
    assert metrics["pathswarm_swarm_peer_series_omitted"][()] == 25


@pytest.mark.timeout(60)
@pytest.mark.swarm
def test_metric_names_pass_promtool_lint():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    collector = SwarmCollector()
    collector.publish(build_view("r", "f" * 64, GRID, select_claims(swarm())), 0.1, 2)
    text = generate_latest(make_registry(collector))
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert b"pathswarm_swarm_modules_orphaned 1.0" in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags, says",
    [
        (["--run", "no way"], "--run"),
        (["--run", "r@xyz"], "pin"),
        (["--run", "r", "--http_port", "70000"], "--http_port"),
        (["--run", "r", "--max_peer_series", "-1"], "--max_peer_series"),
    ],
)
@pytest.mark.swarm
def test_bad_monitor_flags_fail_in_one_line_before_joining(flags, says):
    import sys

    cmd = [sys.executable, "-m", "peer", "monitor", "--initial_peers", "/ip4/127.0.0.1/tcp/9", *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr


def test_status_page_caps_its_peer_rows_and_finds_any_peer_by_id():
    import re

    from monitoring.swarm.page import MAX_PAGE_ROWS, render_page
    from monitoring.swarm.status import status_dict

    records = [(claim(f"Qm{i:05d}", i % 4), 1e12) for i in range(400)]
    measured = ({f"Qm{i:05d}": float(i) for i in range(400)}, set())
    status = status_dict(build_view("r", "f" * 64, GRID, select_claims(records), rates=measured), [])
    page = render_page(status)
    assert len(re.findall(r'<tr data-peer="', page)) == MAX_PAGE_ROWS
    assert 'data-peer="Qm00000"' not in page  # the slowest peer is beyond the cap...
    mine = render_page(status, mine="Qm00000")
    assert '<tr data-peer="Qm00000" class="mine">' in mine  # ...until its owner searches for it
    # nothing is loaded from elsewhere: no external scripts, styles, images or links but the JSON
    assert re.findall(r'(?:src|href)="([^"]*)"', page) == ["/api/status"]


def test_tokens_per_second_is_measured_from_counters_over_the_monitors_clock_not_claimed():
    def claims(totals: dict[str, int]):
        return select_claims([(claim(p, i, tokens_total=t, tokens_per_second=30_000.0), 1e12)
                              for i, (p, t) in enumerate(sorted(totals.items()))])  # fmt: skip

    rates = MeasuredRates()
    first = {"QmA": 1000, "QmB": 500, "QmC": 0, "QmD": 0}
    measured, flagged = rates.update(100.0, first)
    assert measured == dict.fromkeys(first, 0.0) and not flagged  # one reading is no rate yet
    # 10 s later: A trained 1,000 tokens, B stalled, C and D 1,200 and 900; each claims 30,000/s
    second = {"QmA": 2000, "QmB": 500, "QmC": 1200, "QmD": 900}
    measured, flagged = rates.update(110.0, second)
    assert measured == {"QmA": 100.0, "QmB": 0.0, "QmC": 120.0, "QmD": 90.0} and not flagged
    view = build_view("r", "f" * 64, GRID, claims(second), rates=(measured, flagged))
    assert view.tokens_per_second == 310.0  # the stall shows as a drop, the claims count for nothing
    assert {r.peer_id: r.claimed_tokens_per_second for r in view.peers}["QmA"] == 30_000.0
    # a counter racing ahead of the others is flagged and left out; one that went down starts over
    third = {"QmA": 3000, "QmB": 0, "QmC": 2400, "QmD": 1800_000}
    measured, flagged = rates.update(120.0, third)
    assert measured["QmB"] == 0.0 and flagged == {"QmD"}
    view = build_view("r", "f" * 64, GRID, claims(third), rates=(measured, flagged))
    assert view.tokens_per_second == 100.0 + 120.0 and view.implausible == 1


def test_a_claim_listing_every_module_hides_no_orphan_and_is_counted_refused():
    records = [(claim("QmA", 0), 1e12), (claim("QmLiar", 1, ["trunk", "l0m0", "l0m1", "l1m0", "l1m1"]), 1e12)]
    view = build_view("r", "f" * 64, GRID, select_claims(records))
    assert view.claims_refused == 1 and [p.peer_id for p in view.peers] == ["QmA"]
    assert view.orphaned == ["l0m1", "l1m1"]  # path 0 is trunk, l0m0, l1m0


def test_holders_without_admission_are_claimed_not_confirmed_once_the_run_admits_anyone():
    admitted = lambda peer, token: token == "ok"  # noqa: E731 - the creator's signature, as the poller checks it
    records = [(claim("QmA", 0, admission="ok"), 1e12), (claim("QmStranger", 3), 1e12)]  # 3: l0m1, l1m1
    view = build_view("r", "f" * 64, GRID, select_claims(records), admitted=admitted)
    assert view.module_holders["l0m1"] == 1 and view.module_holders_confirmed["l0m1"] == 0
    assert view.orphaned == ["l0m1", "l1m1"] and view.admitted == 1
    page = render_page(status_dict(view, []))
    assert 'data-module="l0m1" data-holders="0" data-claimed="1"' in page
    assert "orphaned (no confirmed training holder): l0m1, l1m1" in page
    # a poll where the admitted peer is gone: a monitor that saw admission still confirms nobody else
    stranger_only = select_claims(records[1:])
    alone = build_view("r", "f" * 64, GRID, stranger_only, admitted=admitted, seen_admission=True)
    assert alone.module_holders_confirmed["l0m1"] == 0 and "l0m1" in alone.orphaned
    # a run that never admitted anyone: every holder counts (nothing tells them apart)
    open_run = build_view("r", "f" * 64, GRID, stranger_only, admitted=admitted)
    assert open_run.module_holders_confirmed == open_run.module_holders


# --- the scheduler's plan (monitoring/swarm/plan.py) ----------------------------------------------


def _two_regions(cross_latency: float):
    """Four peers interleaved over two regions: fast links inside each, `cross` between them."""
    from dht.schema import ProbeRecord

    region = {"QmPa": 0, "QmPb": 1, "QmPc": 0, "QmPd": 1}
    fast, cross = [0.001, 1e9], [cross_latency, 1e5]
    return region, {
        p: ProbeRecord(peer_id=p, tokens_per_second=1e5, memory_bytes=1 << 34,
                       links={q: fast if region[p] == region[q] else cross for q in region if q != p})
        for p in region
    }  # fmt: skip


def test_the_monitor_shows_the_plan_its_predicted_round_and_the_moves_that_take_the_swarm_there():
    from monitoring.swarm.plan import plan_view
    from peer.config import RunManifest
    from peer.config.manifest import SchedulerConfig

    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64, n_levels=1, modules_per_level=2)
    m = RunManifest(name="planned", model=cfg, seq_len=32, scheduler=SchedulerConfig(replan_online=True))
    region, probes = _two_regions(0.1)
    # claims alone put each path's pair across the slow link
    mixed = {"QmPa": 0, "QmPb": 0, "QmPc": 1, "QmPd": 1}
    claims = {p: ClaimRecord(peer_id=p, path=k, modules=path_module_ids(cfg, path_from_index(cfg, k)))
              for p, k in mixed.items()}  # fmt: skip
    view = plan_view(m, "ab" * 32, claims, probes, measured_round_seconds=4.0)
    assert view.peers == view.probed == 4 and view.note == ""
    assert view.planned_round_seconds < view.current_round_seconds
    moved = {mv.peer_id for mv in view.moves}
    assert len(moved) == 2 and len({region[p] for p in moved}) == 2  # one of each region trades paths
    after = {p: next((mv.planned_path for mv in view.moves if mv.peer_id == p), k) for p, k in mixed.items()}
    assert all(len({region[p] for p in after if after[p] == k}) == 1 for k in (0, 1))  # region-pure pairs
    assert view.predicted_over_measured == pytest.approx(view.current_round_seconds / 4.0)
    # a peer without a probe record is still planned for (the snapshot's defaults), and counted
    assert plan_view(m, "ab" * 32, claims, {p: r for p, r in probes.items() if p != "QmPa"}).probed == 3
    # shown on the page
    moves = [vars(mv) for mv in view.moves]
    status = {"plan": {**vars(view), "moves": moves, "predicted_over_measured": 0.5}}
    from monitoring.swarm.page import plan_section

    html = plan_section(status)
    assert html.count("<tr data-move=") == 2 and "0.50" in html


def test_the_measured_round_time_is_the_median_peers_over_the_monitors_clock():
    from monitoring.swarm.plan import MeasuredRounds

    rounds = MeasuredRounds()
    assert rounds.update(0.0, {"a": 10, "b": 10, "c": 10}) is None  # one reading: nothing measured yet
    # a and b run a round every 5 s; c claims a round every 0.1 s: it is one peer of three
    assert rounds.update(10.0, {"a": 12, "b": 12, "c": 110}) == pytest.approx(5.0)
    assert rounds.update(20.0, {"a": 14, "b": 14, "c": 210}) == pytest.approx(5.0)
    # a stalls: its rounds stay, its seconds per round grow over the window
    assert rounds.update(30.0, {"a": 14, "b": 16, "c": 310}) == pytest.approx(30.0 / 6)
    # a counter that went down (a restart without its checkpoint) starts that peer over
    rounds.update(40.0, {"a": 1, "b": 18})
    assert rounds.update(50.0, {"a": 2, "b": 20}) == pytest.approx((10.0 + 50.0 / 10) / 2)
