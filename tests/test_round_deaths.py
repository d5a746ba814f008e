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
    deltas = deltas_for(3, seed=14)
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=40.0, report_timeout=30.0) as members:
        ids = [m.peer_id for m in members]
        a, b, dead = members
        for m in (a, b):
            assert send_delta(dead, m, fp32_bytes(deltas[2]), NUMEL).ok
        dead.service.shutdown()
        dead.dht.shutdown()
        members.remove(dead)
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


async def _delivered(member, sender) -> bool:
    return sender in member.service.inbox.slot((MODULE, 0, 0)).deliveries
