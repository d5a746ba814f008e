"""A holder whose part reaches a member after that member's gather is sent the member's part too: it
counts the member in its round and would otherwise wait for that part until the averaging timeout.
Real members (DHT nodes, sync services, round runners)."""

from __future__ import annotations

import time

import pytest
import torch

from peer.sync.probe import request_report
from tests.sync_members import MODULE, fp32_bytes, restart, run_round, send_delta, sync_group
from tests.test_rounds import NUMEL, deltas_for

pytestmark = pytest.mark.swarm

AVERAGING_TIMEOUT = 20.0


@pytest.mark.timeout(120)
def test_a_holder_whose_part_came_after_a_members_gather_gets_that_members_part_and_does_not_wait_the_timeout(
    dht_factory,
):
    """scheduler_live (session 26): two peers became ready 3 s after the others; a peer that began its
    round before their claims said ready took their parts during its report phase and averaged them,
    but never sent them its own part, and they waited for it until the averaging timeout (60 s).
    Here A and B start a round whose members are A, B and D (D sent its part and never reports, so
    A's and B's report phase lasts the report timeout); C, which counts A and B as members, starts
    a second later, after their gathers."""
    with sync_group(
        dht_factory, 4, NUMEL, averaging_timeout=AVERAGING_TIMEOUT, report_timeout=4.0
    ) as members:
        a, b, c, d = members
        deltas = deltas_for(4, seed=90)
        for m in (a, b):
            assert send_delta(d, m, fp32_bytes(deltas[3]), NUMEL).ok
        ids_ab = [a.peer_id, b.peer_id, d.peer_id]
        futures = [
            m.runner.start((MODULE, 0, 0), x, 1.0, ids_ab, "0" * 64)
            for m, x in zip((a, b), deltas[:2], strict=True)
        ]
        time.sleep(1.0)  # A and B have gathered (B's part and D's came at once) and wait for D's report
        started = time.monotonic()
        late = c.runner.start((MODULE, 0, 0), deltas[2], 1.0, [a.peer_id, b.peer_id, c.peer_id], "0" * 64)
        result = late.result(timeout=60)
        seconds = time.monotonic() - started
        [f.result(timeout=60) for f in futures]
    assert {a.peer_id, b.peer_id} <= set(result.members), (result.outcome, result.detail, result.dropped)
    assert seconds < AVERAGING_TIMEOUT / 2, (seconds, result.outcome, result.dropped)


@pytest.mark.timeout(120)
def test_a_restarted_holder_that_our_part_did_not_reach_gets_it_when_its_own_part_comes(
    dht_factory, tmp_path
):
    """goodput's churn arm: a restarted peer was still starting when the others sent it their parts
    (unreachable), then joined the same round and sent its own; they took its part but never sent
    theirs again, so it waited for them until the straggler bound (5 s) — and a member that had its
    part waited as long for its report, and the rest of the group for that member's echo. Here A and
    B start a round of A, B, C and D while C is down (D's part came and its report never does, so
    their report phase lasts the report timeout); C, started again with the same key, joins the round."""
    path = str(tmp_path / "c.key")
    with sync_group(
        dht_factory,
        4,
        NUMEL,
        averaging_timeout=AVERAGING_TIMEOUT,
        report_timeout=6.0,
        identity_paths={2: path},
    ) as members:
        a, b, c, d = members
        start_c = restart(dht_factory, members, 2, path)
        deltas = deltas_for(4, seed=91)
        for m in (a, b):
            assert send_delta(d, m, fp32_bytes(deltas[3]), NUMEL).ok
        everyone = [a.peer_id, b.peer_id, c.peer_id, d.peer_id]
        futures = [
            m.runner.start((MODULE, 0, 0), x, 1.0, everyone, "0" * 64)
            for m, x in zip((a, b), deltas[:2], strict=True)
        ]
        time.sleep(1.0)  # A and B found C unreachable and wait for D's report
        again = start_c()
        started = time.monotonic()
        late = again.runner.start(
            (MODULE, 0, 0), deltas[2], 1.0, [a.peer_id, b.peer_id, again.peer_id], "0" * 64
        )
        result = late.result(timeout=60)
        seconds = time.monotonic() - started
        [f.result(timeout=60) for f in futures]
    assert {a.peer_id, b.peer_id} <= set(result.members), (result.outcome, result.detail, result.dropped)
    assert seconds < AVERAGING_TIMEOUT / 2, (seconds, result.outcome, result.dropped)


@pytest.mark.timeout(120)
def test_a_restarted_holder_answered_after_our_report_gets_the_report_too_and_keeps_the_same_copy(
    dht_factory, tmp_path
):
    """The same restart where our report went out before the holder's part came: it is sent our part
    and our report. With the part alone it decided on its own report, which counts its part and ours,
    while our report (and so the round's voters) leaves its part out: the pair's copies split (the
    churn arm's `rounds_split`). A's round has A, R (down) and D (its part came, its report never
    does, so A decides at the report timeout); R, started again with the same key, counts A and R."""
    path = str(tmp_path / "r.key")
    with sync_group(
        dht_factory,
        3,
        NUMEL,
        averaging_timeout=AVERAGING_TIMEOUT,
        report_timeout=6.0,
        identity_paths={1: path},
    ) as members:
        a, r, d = members
        start_r = restart(dht_factory, members, 1, path)
        deltas = deltas_for(3, seed=92)
        assert send_delta(d, a, fp32_bytes(deltas[2]), NUMEL).ok
        first = a.runner.start((MODULE, 0, 0), deltas[0], 1.0, [a.peer_id, r.peer_id, d.peer_id], "0" * 64)
        time.sleep(1.0)  # A found R unreachable, reported {A, D} and waits for D's report
        again = start_r()
        late = again.runner.start((MODULE, 0, 0), deltas[1], 1.0, [a.peer_id, again.peer_id], "0" * 64)
        ours, theirs = first.result(timeout=60), late.result(timeout=60)
    assert torch.equal(ours.delta, theirs.delta), (ours.outcome, ours.members, theirs.outcome, theirs.members)


@pytest.mark.timeout(120)
def test_a_restarted_holder_whose_copy_of_a_members_report_was_lost_asks_for_it_and_keeps_the_same_copy(
    dht_factory, tmp_path, monkeypatch
):
    """goodput's churn arm, session 37: a survivor decided its round alone (the restarted holder was
    still down), then took the restarted holder's part and answered it with its
    own part and report; the report never arrived, the restarted holder decided on its own report
    after the report timeout, counted both parts and averaged/2 while the survivor had applied its
    own: split. Here every report push fails (`sync.push_report`), so the restarted holder has the
    survivor's report only if it asks for it."""
    monkeypatch.setenv("PATHSWARM_FAULTS", "sync.push_report=raise")
    path = str(tmp_path / "r.key")
    with sync_group(
        dht_factory, 2, NUMEL, averaging_timeout=AVERAGING_TIMEOUT, report_timeout=6.0,
        identity_paths={1: path},
    ) as members:  # fmt: skip
        a, r = members
        start_r = restart(dht_factory, members, 1, path)
        deltas = deltas_for(2, seed=93)
        first = a.runner.start((MODULE, 0, 0), deltas[0], 1.0, [a.peer_id, r.peer_id], "0" * 64)
        ours = first.result(timeout=60)  # alone: R is down
        again = start_r()
        late = again.runner.start((MODULE, 0, 0), deltas[1], 1.0, [a.peer_id, again.peer_id], "0" * 64)
        theirs = late.result(timeout=60)
    assert ours.outcome == "alone", (ours.outcome, ours.detail)
    assert torch.equal(ours.delta, theirs.delta), (theirs.outcome, theirs.members, theirs.detail)


@pytest.mark.timeout(120)
def test_a_members_report_is_told_to_holders_of_the_module_only_and_never_before_it_is_signed(dht_factory):
    """`Kind.REPORT_REQUEST` serves a signed report of ours: to a holder of the module, once we signed
    it; a key without a claim on the module (a stranger scraping reports) and a round we have not
    reported are answered with nothing."""
    left: set[str] = set()
    with sync_group(dht_factory, 3, NUMEL, report_timeout=2.0, left=left) as members:
        a, b, stranger = members
        left.add(stranger.peer_id)
        key = (MODULE, 0, 0)
        assert b.service.call(request_report(b.service, key, a.peer_id, 5.0), 10) is None
        run_round([a, b], deltas_for(2, seed=94), [1.0, 1.0])
        told = b.service.call(request_report(b.service, key, a.peer_id, 5.0), 10)
        assert told is not None and told.reporter == a.peer_id and told.key.as_tuple() == key
        assert stranger.service.call(request_report(stranger.service, key, a.peer_id, 5.0), 10) is None
        assert b.service.call(request_report(b.service, (MODULE, 0, 1), a.peer_id, 5.0), 10) is None
