"""A member that answers but does not send its part is waited for as long as the recent rounds
measured (peer/sync/stragglers.py), not the whole averaging timeout; the others' copies stay equal."""

from __future__ import annotations

import time

import pytest
import torch

from peer.sync.sent_rounds import SentRounds
from peer.sync.stragglers import MIN_ROUNDS, MIN_SECONDS, StragglerBound
from tests.sync_members import MODULE, RUN_ID, make_member, sync_group
from tests.test_rounds import NUMEL, deltas_for

pytestmark = pytest.mark.swarm


def _pace(members, ids, seed: int) -> None:
    """MIN_ROUNDS full rounds: the pace the bound is measured from (the outer loop's rounds)."""
    for r in range(MIN_ROUNDS):
        for m in members:
            m.service.inbox.set_current(MODULE, 0, r)
        pairs = zip(members, deltas_for(len(members), seed=seed + r), strict=True)
        futures = [m.runner.start((MODULE, 0, r), d, 1.0, ids, "0" * 64) for m, d in pairs]
        assert [f.result(timeout=60).outcome for f in futures] == ["averaged"] * len(members)


@pytest.mark.timeout(120)
def test_a_live_member_that_sends_nothing_is_waited_for_as_long_as_recent_rounds_took_not_the_timeout(
    dht_factory,
):
    """After a few full rounds, one member stays silent in the next (alive: it answers probes, it is
    stuck elsewhere, as a restarted churn peer was for three 30 s timeouts in a row). The others leave
    it out as late after MIN_SECONDS (the rounds here take well under a second), far below the 40 s
    timeout, and end with the same bits: the average of their two parts."""
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=40.0) as members:
        ids = [m.peer_id for m in members]
        _pace(members, ids, seed=20)
        for m in members:
            m.service.inbox.set_current(MODULE, 0, MIN_ROUNDS)
        deltas = deltas_for(3, seed=30)
        started = time.monotonic()
        pairs = zip(members[:2], deltas, strict=False)  # the third stays silent
        futures = [m.runner.start((MODULE, 0, MIN_ROUNDS), d, 1.0, ids, "0" * 64) for m, d in pairs]
        results = [f.result(timeout=60) for f in futures]
        seconds = time.monotonic() - started
        # the silent member never sent: the others are not running ahead of it, the wait stays
        assert [m.runner.stragglers.seconds() for m in members[:2]] == [MIN_SECONDS] * 2
    assert [r.outcome for r in results] == ["averaged", "averaged"], [r.detail for r in results]
    assert all(r.dropped[ids[2]].startswith("late") for r in results), results[0].dropped
    assert torch.equal(results[0].delta, results[1].delta)
    assert torch.allclose(results[0].delta, (deltas[0] + deltas[1]) / 2, atol=1e-6)
    assert MIN_SECONDS <= seconds < MIN_SECONDS + 8.0, seconds  # not the 40 s timeout


@pytest.mark.timeout(120)
def test_a_member_whose_whole_group_is_catching_up_goes_on_alone_after_the_bound_not_the_timeout(dht_factory):
    """No other part comes at all: the other members are alive but rounds behind, catching up (a churn
    run's survivor waited 30 s a round, three rounds in a row, for peers restarted from older
    checkpoints). It goes on alone after the bound; they find the round over and take its state."""
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=40.0) as members:
        ids = [m.peer_id for m in members]
        _pace(members, ids, seed=40)
        members[0].service.inbox.set_current(MODULE, 0, MIN_ROUNDS)
        started = time.monotonic()
        own = deltas_for(1, seed=50)[0]
        result = members[0].runner.start((MODULE, 0, MIN_ROUNDS), own, 1.0, ids, "0" * 64).result(timeout=60)
        seconds = time.monotonic() - started
    assert result.outcome == "alone" and torch.equal(result.delta, own), result.detail
    assert all(result.dropped[i].startswith("late") for i in ids[1:]), result.dropped
    assert MIN_SECONDS <= seconds < MIN_SECONDS + 8.0, seconds


@pytest.mark.timeout(120)
def test_no_member_is_cut_short_before_the_recent_rounds_were_measured(dht_factory):
    """A new group knows no pace yet: a member that is 8 s late to the very first round (a joiner
    still loading) is waited for, and its part is in the average."""
    deltas = deltas_for(3, seed=31)
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=40.0) as members:
        ids = [m.peer_id for m in members]
        pairs = zip(members[:2], deltas, strict=False)
        futures = [m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64) for m, d in pairs]
        time.sleep(MIN_SECONDS + 3.0)
        late = members[2].runner.start((MODULE, 0, 0), deltas[2], 1.0, ids, "0" * 64)
        results = [f.result(timeout=60) for f in [*futures, late]]
    assert [r.outcome for r in results] == ["averaged"] * 3, [r.detail for r in results]
    assert torch.allclose(results[0].delta, sum(deltas) / 3, atol=1e-6)


@pytest.mark.timeout(120)
def test_a_part_on_its_way_over_a_slow_link_is_waited_for_past_the_recent_rounds_pace(dht_factory):
    """After a few fast rounds a member's link slows down (the WAN lab's regions changed): its header
    comes at once but its payload takes longer than the pace allows. Its part is on its way, not held
    back, so the others wait for it: left out as late at some members and in time at others, it split
    the copies in the scheduler_live run (docs/benchmarks/scheduler_live.md). All three average."""
    slow_weight = 2.0  # tells the slow member's part apart where the receivers decode it
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=40.0) as members:
        ids = [m.peer_id for m in members]
        _pace(members, ids, seed=60)
        for m in members[:2]:
            decode = m.service.inbox.decode

            def slow_decode(header, payload, decode=decode):  # the payload arrives late
                if header.weight == slow_weight:
                    time.sleep(MIN_SECONDS + 2.0)
                return decode(header, payload)

            m.service.inbox.decode = slow_decode
        for m in members:
            m.service.inbox.set_current(MODULE, 0, MIN_ROUNDS)
        deltas = deltas_for(3, seed=70)
        weights = [1.0, 1.0, slow_weight]
        started = time.monotonic()
        futures = [
            m.runner.start((MODULE, 0, MIN_ROUNDS), d, w, ids, "0" * 64)
            for m, d, w in zip(members, deltas, weights, strict=True)
        ]
        results = [f.result(timeout=60) for f in futures]
        seconds = time.monotonic() - started
    assert [r.outcome for r in results] == ["averaged"] * 3, [(r.detail, r.dropped) for r in results]
    assert all(sorted(r.members) == sorted(ids) for r in results), [r.members for r in results]
    assert torch.equal(results[0].delta, results[1].delta) and torch.equal(results[0].delta, results[2].delta)
    assert MIN_SECONDS + 2.0 <= seconds < 40.0, seconds


def test_a_member_that_left_its_group_out_as_late_waits_longer_next_round_instead_of_running_ahead():
    """A group whose links slowed down is not stuck, only slower than the pace: a member that leaves
    them all out as late each round runs ahead alone for good (a scheduler_live peer went alone 11
    rounds in a row). Each round cut short doubles the next wait; a full round sets the pace again."""
    bound = StragglerBound()
    for _ in range(MIN_ROUNDS):
        bound.record(0.2)
    assert bound.seconds() == MIN_SECONDS
    bound.cut_short()
    assert bound.seconds() == 2 * MIN_SECONDS
    bound.cut_short()
    assert bound.seconds() == 4 * MIN_SECONDS
    bound.record(3.0)  # the group came: the new, slower pace
    assert bound.seconds() == pytest.approx(MIN_SECONDS)  # 4 x the median 0.2 s is below the floor
    for _ in range(20):
        bound.cut_short()
    assert bound.seconds() < 1000  # bounded; the averaging timeout caps the wait itself


@pytest.mark.timeout(120)
def test_a_member_whose_late_partner_came_after_all_waits_longer_instead_of_running_ahead(dht_factory):
    """A group slower than the pace (its links slowed down): the third member's part comes 2 s after
    the wait, for a round the other two already decided. Seeing it come after all, they wait twice
    as long from then on, and the next round, as slow, has all three in it instead of leaving the
    third out again (a scheduler_live peer ran ahead alone for 11 rounds that way)."""
    delay = MIN_SECONDS + 2.0
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=40.0) as members:
        ids = [m.peer_id for m in members]
        _pace(members, ids, seed=80)
        results = {}
        for r in (MIN_ROUNDS, MIN_ROUNDS + 1):
            for m in members:
                m.service.inbox.set_current(MODULE, 0, r)
            deltas = deltas_for(3, seed=90 + r)
            started = time.monotonic()
            pairs = zip(members[:2], deltas, strict=False)
            fast = [m.runner.start((MODULE, 0, r), d, 1.0, ids, "0" * 64) for m, d in pairs]
            if r == MIN_ROUNDS:  # decided without it (however loaded the machine): the outer loop moves on
                for f in fast:
                    f.result(timeout=60)
            time.sleep(max(0.0, started + delay - time.monotonic()))
            if all(f.done() for f in fast):
                for m in members[:2]:
                    m.service.inbox.set_current(MODULE, 0, r + 1)
            slow = members[2].runner.start((MODULE, 0, r), deltas[2], 1.0, ids, "0" * 64)
            results[r] = [f.result(timeout=60) for f in [*fast, slow]]
            # the slow member's part reached the others after their round (sent on, not waited for)
            seen_by = time.monotonic() + 30.0
            while r == MIN_ROUNDS and time.monotonic() < seen_by:
                came = [m.service.inbox.came_after.get((MODULE, 0), {}).get(ids[2]) for m in members[:2]]
                if came == [r, r]:
                    break
                time.sleep(0.05)
    first, second = results[MIN_ROUNDS], results[MIN_ROUNDS + 1]
    assert all(res.dropped.get(ids[2], "").startswith("late") for res in first[:2]), first[0].dropped
    # the next round waited for it: all three averaged, the same bits everywhere
    assert [res.outcome for res in second] == ["averaged"] * 3, [(res.detail, res.dropped) for res in second]
    assert all(torch.equal(res.delta, second[0].delta) for res in second)


@pytest.mark.timeout(120)
def test_a_member_restarted_from_its_checkpoint_directory_keeps_the_pace_its_rounds_measured(
    dht_factory, tmp_path
):
    """A peer killed after a few full rounds and started again with --resume reads its round pace back
    with its record of rounds sent: its first round waits for a silent member as long as the recent
    rounds allow, not the whole timeout (a churn run's restarted peer sat 33 s in its first round)."""
    kept = SentRounds(tmp_path, RUN_ID)
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=40.0, sent={0: kept}) as members:
        _pace(members, [m.peer_id for m in members], seed=100)
        measured = members[0].runner.stragglers.seconds()
        group = members[0].group
    assert measured is not None
    dht, key = dht_factory()
    restarted = make_member(dht, key, group, sent=SentRounds(tmp_path, RUN_ID))
    try:
        assert restarted.runner.stragglers.seconds() == measured
    finally:
        restarted.service.shutdown()
