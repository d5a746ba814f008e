"""Rounds a member sent its part of already (a restart, or a download that set its state back):
it sits them out, never signing a second report (peer/sync/sitting_out.py), and the others neither
wait for it nor split from it."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch

from peer.sync import wire
from peer.sync.sent_rounds import SentRounds
from peer.sync.wire import Kind
from tests.sync_members import MODULE, RUN_ID, fp32_bytes, send_delta, sync_group
from tests.test_round_deaths import _delivered
from tests.test_rounds import NUMEL, deltas_for

pytestmark = pytest.mark.swarm


def test_a_restarted_member_sits_a_round_it_sent_before_out_once_and_then_goes_on_alone(
    dht_factory, tmp_path
):
    """Its previous life sent round 0 and was killed; so was every other holder's (a churn run kills
    several at once), so nobody gets past round 0. It sits the round out once (no second report: that
    would be an equivocation), takes the holders' state, which is still at round 0, and comes to round
    0 again: it goes on alone at once instead of sitting it out again (a churn run spent minutes of
    35-second sit-outs of the same round), still sending nothing."""
    x = torch.full((NUMEL,), 0.01)
    with _restarted_pair(dht_factory, tmp_path, averaging_timeout=2.0, report_timeout=1.0) as members:
        restarted, other = members
        ids = [m.peer_id for m in members]
        first = restarted.runner.start((MODULE, 0, 0), x, 1.0, ids, "0" * 64).result(timeout=30)
        assert first.outcome == "behind" and first.ahead == [other.peer_id], (first.outcome, first.detail)
        started = time.monotonic()
        again = restarted.runner.start((MODULE, 0, 0), x, 1.0, ids, "0" * 64).result(timeout=30)
        seconds = time.monotonic() - started
        reports = other.service.call(_reports(other))
    assert again.outcome == "alone" and again.members == [restarted.peer_id], (again.outcome, again.detail)
    assert seconds < 1.5, seconds  # not another sit-out (3 s here, 35 s by default)
    assert restarted.peer_id not in reports and not other.service.inbox.banned(restarted.peer_id)


def test_a_restarted_member_whose_only_partner_is_gone_goes_on_alone_without_waiting_out_the_sit_out(
    dht_factory, tmp_path
):
    """Its previous life sent round 0 and was killed together with the module's other holder (a churn
    run's double kill), which is not back yet: nobody can get past the round. It sits the round out,
    finds by asking that the other's host refuses it, and goes on alone at once instead of waiting the
    averaging plus report timeouts (30 s here) with its training held at the round's end: a churn run
    at τ > 0 lost 20 s of a peer and four 5 s waits of the survivors so. Still no second report."""
    x = torch.full((NUMEL,), 0.01)
    with _restarted_pair(dht_factory, tmp_path, averaging_timeout=20.0, report_timeout=10.0) as members:
        restarted, gone = members
        ids = [m.peer_id for m in members]
        gone.service.shutdown()
        gone.dht.shutdown()
        members.remove(gone)
        started = time.monotonic()
        result = restarted.runner.start((MODULE, 0, 0), x, 1.0, ids, "0" * 64).result(timeout=60)
        seconds = time.monotonic() - started
    assert result.outcome == "alone", (result.outcome, result.detail)
    assert result.members == [restarted.peer_id]
    assert torch.equal(result.delta, x)
    assert seconds < 10.0, seconds  # probes from 0.5 s on, every second; the sit-out's wait is 30 s


def test_a_sitter_waits_for_a_partner_that_is_starting_and_takes_its_state_once_it_is_past_the_round(
    dht_factory, tmp_path
):
    """A partner that answers it is starting is not gone: it may have applied the round before it was
    killed, and a sitter that went on alone would split from it. The sitter waits; once the partner
    trains and sends a part of the next round, the sitter takes its state."""
    x = torch.full((NUMEL,), 0.01)
    with _restarted_pair(dht_factory, tmp_path, averaging_timeout=20.0, report_timeout=10.0) as members:
        restarted, partner = members
        ids = [m.peer_id for m in members]
        partner.service.training.clear()
        sitting = restarted.runner.start((MODULE, 0, 0), x, 1.0, ids, "0" * 64)
        time.sleep(3.0)  # asked from 0.5 s on, every second: it answers that it is starting
        waited = not sitting.done()
        partner.service.training.set()
        assert send_delta(partner, restarted, fp32_bytes(x), NUMEL, round_index=1).ok
        result = sitting.result(timeout=60)
    assert waited, (result.outcome, result.detail)
    assert result.outcome == "behind" and result.ahead == [partner.peer_id], (result.outcome, result.ahead)


def test_a_sitter_whose_partner_sends_a_part_of_an_earlier_round_goes_on_alone_without_waiting_for_it(
    dht_factory, tmp_path
):
    """Both holders were killed; the sitter's checkpoint was a round ahead of its partner's. The partner
    trains and answers probes, but it is behind the round: it cannot get past it before it takes the
    sitter's state, and its fragment's other rounds waited on the sitter's training, held at this
    round's end (a churn run held both 7.5 s, and the survivors 5 s for their next parts). Its part of
    the earlier round says so: the sitter goes on alone at once, still sending nothing."""
    SentRounds(tmp_path, RUN_ID).record(MODULE, 0, 1)
    x = torch.full((NUMEL,), 0.01)
    sent = {0: SentRounds(tmp_path, RUN_ID)}
    with sync_group(dht_factory, 2, NUMEL, averaging_timeout=20.0, report_timeout=10.0, sent=sent) as members:
        sitter, partner = members
        ids = [m.peer_id for m in members]
        sitter.service.call(_at_round(sitter, 1))
        started = time.monotonic()
        sitting = sitter.runner.start((MODULE, 0, 1), x, 1.0, ids, "0" * 64)
        ack = send_delta(partner, sitter, fp32_bytes(x), NUMEL, round_index=0)
        result = sitting.result(timeout=60)
        seconds = time.monotonic() - started
    assert not ack.ok and ack.reason.startswith("stale"), ack
    assert result.outcome == "alone" and result.members == [sitter.peer_id], (result.outcome, result.detail)
    assert seconds < 10.0, seconds  # the sit-out's wait is the averaging plus report timeouts, 30 s


async def _at_round(member, round_index: int) -> None:
    member.service.inbox.set_current(MODULE, 0, round_index)


def test_a_member_sitting_out_another_round_of_ours_is_not_waited_for_in_this_one(dht_factory):
    """A restarted holder sits out its round of one module (it sent it before it was killed) and waits,
    its training held at that round's end, until we are past it; we get past it only once this round
    of another module is done, which waited for that holder's part: a churn run's pairs held each
    other so until the straggler bound (5 s). Its notice says so: it is left out of this round at once."""
    from peer.sync.rounds import HELD

    x = torch.full((NUMEL,), 0.01)
    with sync_group(
        dht_factory, 2, NUMEL, averaging_timeout=20.0, report_timeout=5.0, also=("trunk",)
    ) as members:
        a, sitter = members
        ids = [m.peer_id for m in members]
        notice = wire.SitOut(run=RUN_ID[:16], key=wire.RoundKey(module=MODULE, fragment=0, round=0))
        frames = [wire.pack_header(Kind.SIT_OUT, notice)]
        assert sitter.service.call(sitter.service.request(a.peer_id, frames, 10), timeout=20).ok
        started = time.monotonic()
        result = a.runner.start(("trunk", 0, 0), x, 1.0, ids, "0" * 64).result(timeout=60)
        seconds = time.monotonic() - started
    assert result.outcome == "alone" and result.dropped == {sitter.peer_id: HELD}, (
        result.outcome,
        result.dropped,
    )
    assert seconds < 5.0, seconds  # the averaging timeout is 20 s


def test_a_sitter_takes_the_state_of_a_partner_that_says_it_applied_the_round_without_awaiting_its_part(
    dht_factory, tmp_path
):
    """The partner applied round 0 before both were killed, and restarted past it; its next part may
    be far off (it waits on another module's round that the sitter holds up: a churn run's two
    restarted holders stalled each other and the survivors for 10 s so). It answers the sit-out
    notice that it is past the round, and the sitter takes its state at once instead of waiting for
    that part or the averaging plus report timeouts (25 s here)."""
    x = torch.full((NUMEL,), 0.01)
    with _restarted_pair(dht_factory, tmp_path, averaging_timeout=20.0, report_timeout=5.0) as members:
        restarted, partner = members
        ids = [m.peer_id for m in members]
        partner.service.call(_apply_round_0(partner))
        started = time.monotonic()
        result = restarted.runner.start((MODULE, 0, 0), x, 1.0, ids, "0" * 64).result(timeout=60)
        seconds = time.monotonic() - started
        sat = partner.service.call(_sat_out(partner, restarted.peer_id))
    assert result.outcome == "behind" and result.ahead == [partner.peer_id], (result.outcome, result.ahead)
    assert seconds < 5.0, seconds
    assert not sat  # past it, the partner keeps no sit-out of a round it is done with


async def _apply_round_0(member) -> None:
    """What the member's path sync does once round 0 is applied: its window moves to round 1."""
    member.service.inbox.set_current(MODULE, 0, 1)


def test_a_sitter_takes_the_state_of_a_member_past_the_round_not_of_another_sitting_it_out(
    dht_factory, tmp_path
):
    """Two of three holders were killed after both sent round 0 and restarted; the third went on to
    round 1. Each restarted one sits round 0 out and must take the state of the one past it: the
    other sitter's state is at round 0 too, so taking it brought the round back, and the second time
    it went on alone with its own Δ while the third had applied the group's: a churn run's trunk
    split so (its two restarted holders took each other's states)."""
    x = torch.full((NUMEL,), 0.01)
    for i in (0, 1):
        (tmp_path / str(i)).mkdir()
        SentRounds(tmp_path / str(i), RUN_ID).record(MODULE, 0, 0)
    sent = {i: SentRounds(tmp_path / str(i), RUN_ID) for i in (0, 1)}
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=20.0, report_timeout=5.0, sent=sent) as members:
        first, second, past = members
        ids = [m.peer_id for m in members]
        sitting = [m.runner.start((MODULE, 0, 0), x, 1.0, ids, "0" * 64) for m in (first, second)]
        wait_until = time.monotonic() + 20  # both have said SIT_OUT to each other
        pairs = ((first, second), (second, first))
        while not all(m.service.call(_sat_out(m, o.peer_id)) for m, o in pairs):
            assert time.monotonic() < wait_until, "the sitters never heard each other's SIT_OUT"
            time.sleep(0.1)
        for m in (first, second):  # the third is past round 0: its part of round 1 reaches both
            assert send_delta(past, m, fp32_bytes(x), NUMEL, round_index=1).ok
        results = [f.result(timeout=60) for f in sitting]
    assert [r.outcome for r in results] == ["behind", "behind"], [(r.outcome, r.detail) for r in results]
    assert [r.ahead for r in results] == [[past.peer_id], [past.peer_id]], [r.ahead for r in results]


async def _sat_out(member, sitter) -> bool:
    return sitter in member.service.inbox.slot((MODULE, 0, 0)).sat_out


@contextmanager
def _restarted_pair(dht_factory, tmp_path, averaging_timeout: float, report_timeout: float):
    """Two members holding MODULE; the first is a restart whose previous life sent round 0 (its
    record of rounds sent is on disk in `tmp_path`)."""
    SentRounds(tmp_path, RUN_ID).record(MODULE, 0, 0)
    sent = {0: SentRounds(tmp_path, RUN_ID)}
    with sync_group(
        dht_factory, 2, NUMEL, averaging_timeout=averaging_timeout, report_timeout=report_timeout, sent=sent
    ) as members:
        yield members


async def _reports(member) -> list[str]:
    return list(member.service.inbox.slot((MODULE, 0, 0)).reports.reports)


def test_a_member_whose_state_was_set_back_to_a_round_it_sent_does_not_sign_that_round_again(dht_factory):
    """It sent its part and report for round 0 while the other holder was not in the round yet, and
    went on alone; then a download set its state back to round 0 (the holders were still in it).
    Running round 0 again would sign a second, different report, and the other holder, which holds
    both, would leave it out and ban it for ten minutes as an equivocator (a churn run banned honest
    peers four times so). It sits the round out instead: one report of it, and no ban."""
    deltas = deltas_for(2, seed=15)
    with sync_group(dht_factory, 2, NUMEL, averaging_timeout=2.0, report_timeout=1.0) as members:
        a, b = members
        ids = [m.peer_id for m in members]
        first = a.runner.start((MODULE, 0, 0), deltas[0], 1.0, ids, "0" * 64).result(timeout=30)
        assert b.service.call(_delivered(b, a.peer_id)), first.outcome  # b holds a's first part
        # a's state set back to round 0: a new Δ for it, while b runs round 0 at last
        again = a.runner.start((MODULE, 0, 0), 2 * deltas[0], 1.0, ids, "1" * 64)
        other = b.runner.start((MODULE, 0, 0), deltas[1], 1.0, ids, "0" * 64).result(timeout=30)
        again = again.result(timeout=30)
        reports = b.service.call(_equivocators(b))
        banned = b.service.inbox.banned(a.peer_id)
    assert again.outcome == "behind" and again.detail == "sent already", (again.outcome, again.detail)
    assert not reports and not banned, (reports, other.dropped)


async def _equivocators(member) -> list[str]:
    return list(member.service.inbox.slot((MODULE, 0, 0)).reports.equivocators)


def test_a_member_sitting_a_round_out_says_so_and_the_others_stop_waiting_for_it_at_once(
    dht_factory, tmp_path
):
    """A restarted member whose previous life sent round 0 sits it out; it is alive and answers the
    others' probes, so without a word from it they would wait for its part up to the averaging
    timeout (30 s here; a churn run lost 35 s per restart so). It says SIT_OUT: the other decides
    round 0 without it at once, and its next round's part ends the sitter's wait."""
    from peer.sync.rounds import SAT_OUT

    deltas = deltas_for(2, seed=16)
    with _restarted_pair(dht_factory, tmp_path, averaging_timeout=30.0, report_timeout=5.0) as members:
        restarted, other = members
        ids = [m.peer_id for m in members]
        started = time.monotonic()
        sitting = restarted.runner.start((MODULE, 0, 0), deltas[0], 1.0, ids, "0" * 64)
        decided = other.runner.start((MODULE, 0, 0), deltas[1], 1.0, ids, "0" * 64).result(timeout=60)
        decided_after = time.monotonic() - started
        other.runner.start((MODULE, 0, 1), deltas[1], 1.0, ids, "0" * 64)  # the other goes on
        sat = sitting.result(timeout=60)
        sat_after = time.monotonic() - started
    assert decided.outcome == "alone" and decided.dropped == {restarted.peer_id: SAT_OUT}, decided.dropped
    assert decided_after < 10.0, decided_after  # not the 30 s averaging timeout
    assert sat.outcome == "behind" and sat.ahead == [other.peer_id] and sat_after < 15.0, (
        sat.outcome,
        sat_after,
    )


def test_a_pair_killed_after_both_sent_a_round_applies_the_same_step_when_both_meet_it_again(
    dht_factory, tmp_path
):
    """Both holders of a module sent round 0, then both were killed (a churn run's double kill) and
    restarted at it. Each sits it out, sees the other sitting too, and nobody gets past it: the
    second time each went on alone with its own Δ and the copies split (a churn run's rounds_split).
    Now neither applies a part: the same step on both sides."""
    for i in (0, 1):
        (tmp_path / str(i)).mkdir()
        SentRounds(tmp_path / str(i), RUN_ID).record(MODULE, 0, 0)
    sent = {i: SentRounds(tmp_path / str(i), RUN_ID) for i in (0, 1)}
    deltas = deltas_for(2, seed=17)
    with sync_group(dht_factory, 2, NUMEL, averaging_timeout=20.0, report_timeout=5.0, sent=sent) as members:
        ids = [m.peer_id for m in members]
        first = [
            m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64)
            for m, d in zip(members, deltas, strict=True)
        ]
        first = [f.result(timeout=60) for f in first]
        # each took the other's state, still at round 0, and meets the round again
        again = [
            m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64)
            for m, d in zip(members, deltas, strict=True)
        ]
        again = [f.result(timeout=60) for f in again]
    assert [r.outcome for r in first] == ["behind", "behind"], [(r.outcome, r.detail) for r in first]
    assert [r.outcome for r in again] == ["excluded", "excluded"], [(r.outcome, r.detail) for r in again]
    assert torch.equal(again[0].delta, again[1].delta) and not again[0].delta.any()
