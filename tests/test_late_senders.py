"""A holder whose part reaches a member after that member's gather is sent the member's part too: it
counts the member in its round and would otherwise wait for that part until the averaging timeout.
Real members (DHT nodes, sync services, round runners)."""

from __future__ import annotations

import time

import pytest

from tests.sync_members import MODULE, fp32_bytes, send_delta, sync_group
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
