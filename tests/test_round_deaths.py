"""Members that die in the middle of a round (a churn run's kills): the others find out by probing
them (peer/sync/probe.py) and end the round without waiting for a timeout."""

from __future__ import annotations

import time

import pytest
import torch

from tests.sync_members import MODULE, fp32_bytes, send_delta, sync_group
from tests.test_rounds import NUMEL, deltas_for

pytestmark = pytest.mark.swarm


def test_a_member_killed_after_it_took_our_part_is_not_waited_for_until_the_timeout(dht_factory):
    """It took our outer gradients, then died without a word (no part, no leaving claim): the others
    ask whether it still answers, its host refuses the connection, and they end the round at once,
    not at the averaging timeout (the goodput churn runs spent most of their time in such waits)."""
    deltas = deltas_for(3, seed=13)
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=40.0) as members:
        ids = [m.peer_id for m in members]
        dead = members[2]
        started = time.monotonic()
        futures = [
            m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64)
            for m, d in zip(members[:2], deltas, strict=False)
        ]
        wait_until = time.monotonic() + 20
        while any(dead.service.call(_delivered(dead, m.peer_id)) is False for m in members[:2]):
            assert time.monotonic() < wait_until, "the parts never reached the member about to die"
            time.sleep(0.1)
        dead.service.shutdown()
        dead.dht.shutdown()
        members.remove(dead)
        results = [f.result(timeout=60) for f in futures]
        seconds = time.monotonic() - started
    assert [r.outcome for r in results] == ["averaged", "averaged"]
    assert all(r.dropped.get(dead.peer_id, "").startswith("unreachable") for r in results), results[0].dropped
    assert torch.equal(results[0].delta, results[1].delta)
    assert seconds < 15.0, seconds  # probes every PROBE_SECONDS (peer/sync/probe.py); the timeout is 40 s


def test_a_member_killed_after_its_part_came_is_not_waited_for_until_the_report_timeout(dht_factory):
    """Its part reached the others, then it died before it reported (a churn run's kill, mid-round):
    the others wait for its report only until their probe finds its host refusing connections, not
    for the whole report timeout; its part, which both received, is in the average."""

    def kill(members, dead) -> None:
        dead.service.shutdown()
        dead.dht.shutdown()
        members.remove(dead)

    _its_part_counts_without_its_report(dht_factory, seed=14, silence=kill)


def test_a_member_restarted_after_its_part_came_is_not_waited_for_a_report_that_died_with_it(dht_factory):
    """Its part reached the others, then it was killed before it reported and restarted at once (a
    churn run's kill with a 2 s restart): its new life answers their question for its report, but
    has none and never will (a report is signed once, by the life that sent the part). The others
    waited for it until its first step sat the round out: every survivor held 5 s. While it is
    starting it says so, and they decide without its report: its part, which both received, counts."""

    def restart(members, restarted) -> None:
        restarted.service.training.clear()  # its new life, before its first step

    _its_part_counts_without_its_report(dht_factory, seed=19, silence=restart)


def test_a_member_killed_after_it_reported_is_not_waited_for_its_echo_until_the_report_timeout(
    dht_factory,
):
    """Its part and its signed report reached the others, then it died before it relayed the reports
    it held (a churn run's kill between the two): every other member waited the whole report timeout
    for that echo (5 s stalls of the whole swarm right after a kill). Their echo to it fails, their
    probe finds its host refusing, and they decide at once: its part, which every report lists, counts."""
    from peer.sync.inbox import delivery_digest
    from tests.sync_members import send_report

    deltas = deltas_for(3, seed=23)
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=40.0, report_timeout=30.0) as members:
        ids = [m.peer_id for m in members]
        a, b, third = members
        payload = fp32_bytes(deltas[2])
        for m in (a, b):
            assert send_delta(third, m, payload, NUMEL).ok
        started = time.monotonic()
        pairs = zip((a, b), deltas[:2], strict=True)
        futures = [m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64) for m, d in pairs]
        wait_until = time.monotonic() + 20
        while not all(third.service.call(_delivered(third, m.peer_id)) for m in (a, b)):
            assert time.monotonic() < wait_until, "the parts never reached the member about to die"
            time.sleep(0.05)
        received = third.service.call(_digests(third))
        received[third.peer_id] = delivery_digest(1.0, third.token, payload)
        for m in (a, b):  # its report lists both parts: both wait for its echo
            assert send_report(third, m, received).ok
        third.service.shutdown()
        third.dht.shutdown()
        members.remove(third)
        results = [f.result(timeout=60) for f in futures]
        seconds = time.monotonic() - started
    assert [r.outcome for r in results] == ["averaged", "averaged"], [r.detail for r in results]
    assert all(r.members == sorted(ids) for r in results), results[0].dropped
    assert torch.equal(results[0].delta, results[1].delta)
    assert torch.allclose(results[0].delta, sum(deltas) / 3, atol=1e-6)
    assert seconds < 15.0, seconds  # the report timeout, which bounds the echo wait, is 30 s


async def _digests(member) -> dict[str, str]:
    return {s: d.digest for s, d in member.service.inbox.slot((MODULE, 0, 0)).deliveries.items()}


def _its_part_counts_without_its_report(dht_factory, seed: int, silence) -> None:
    """The third member's part reaches the other two, then `silence(members, third)` (it never
    reports); the two average all three parts alike, well before the 30 s report timeout."""
    deltas = deltas_for(3, seed=seed)
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=40.0, report_timeout=30.0) as members:
        ids = [m.peer_id for m in members]
        a, b, third = members
        for m in (a, b):
            assert send_delta(third, m, fp32_bytes(deltas[2]), NUMEL).ok
        silence(members, third)
        started = time.monotonic()
        pairs = zip((a, b), deltas[:2], strict=True)
        futures = [m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64) for m, d in pairs]
        results = [f.result(timeout=60) for f in futures]
        seconds = time.monotonic() - started
    assert [r.outcome for r in results] == ["averaged", "averaged"], [r.detail for r in results]
    assert all(r.members == sorted(ids) for r in results), results[0].dropped
    assert torch.equal(results[0].delta, results[1].delta)
    assert torch.allclose(results[0].delta, sum(deltas) / 3, atol=1e-6)
    assert seconds < 15.0, seconds  # the report timeout is 30 s


def test_a_member_still_starting_is_left_out_at_once_and_waited_for_once_it_trains(dht_factory):
    """A restarted peer's host answers seconds before its first step (its state, its data): the
    others' rounds waited for its part up to the straggler bound, 4-5 s after each restart of a churn
    run at τ = 10. Until it trains it answers their probe that it is starting and is left out at once;
    once it trains it is waited for as any member (here until its part comes)."""
    from peer.sync.probe import STARTING_WHY

    deltas = deltas_for(2, seed=18)
    with sync_group(dht_factory, 2, NUMEL, averaging_timeout=20.0) as members:
        a, b = members
        ids = [m.peer_id for m in members]
        b.service.training.clear()
        started = time.monotonic()
        first = a.runner.start((MODULE, 0, 0), deltas[0], 1.0, ids, "0" * 64).result(timeout=60)
        seconds = time.monotonic() - started
        b.service.training.set()
        second = a.runner.start((MODULE, 0, 1), deltas[0], 1.0, ids, "0" * 64)
        time.sleep(3.0)  # probed three times meanwhile: it answers, so its part is waited for
        other = b.runner.start((MODULE, 0, 1), deltas[1], 1.0, ids, "0" * 64).result(timeout=60)
        second = second.result(timeout=60)
    assert first.outcome == "alone" and first.dropped == {b.peer_id: STARTING_WHY}, (
        first.outcome,
        first.dropped,
    )
    assert seconds < 5.0, seconds  # the averaging timeout is 20 s, and no straggler bound is measured yet
    assert [second.outcome, other.outcome] == ["averaged", "averaged"], (second.dropped, other.dropped)
    assert torch.equal(second.delta, other.delta)


async def _delivered(member, sender) -> bool:
    return sender in member.service.inbox.slot((MODULE, 0, 0)).deliveries
