"""hivemind's all-reduce fault cases, on five real round members on loopback, plus "the part reached all
members but one": in every case the members that finish end the round with the same set of senders
and the same bits, the robust aggregate of exactly that set, and none of them reports `averaged` with
a different set (the failure a plain all-reduce shows: copies that differ after a round all reported
as averaged)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from peer.sync.aggregate import AggregatorConfig, Contribution, aggregate
from peer.sync.inbox import Refused
from tests.sync_members import MODULE, fp32_bytes, send_delta, sync_group

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

NUMEL = 3001
N = 5
KEY = (MODULE, 0, 0)
WEIGHTS = [1.0, 2.0, 1.5, 1.0, 3.0]


def deltas_for(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(NUMEL, generator=gen) * 0.01
    return [base + 0.003 * torch.randn(NUMEL, generator=gen) for _ in range(N)]


def _late(seconds: float, coro_fn):
    """`coro_fn`, started `seconds` late (a slow member)."""

    async def wrapped(*args, **kwargs):
        await asyncio.sleep(seconds)
        return await coro_fn(*args, **kwargs)

    return wrapped


def _fault(case: str, members, deltas, ids) -> tuple[dict, set[int]]:
    """Starts the round on every member with member 4 (F) failing as `case` says; returns the futures of
    the members that run it, by index, and the indices expected to finish it."""
    f = members[4]
    start = {i: True for i in range(N)}
    finishers = set(range(N))
    if case == "fail_before_sending":  # F never starts the round
        start[4], finishers = False, set(range(4))
    elif case == "reached_all_but_one":  # F's part reaches every member but member 0
        plain = members[0].service.inbox.check_delta_header

        def refuse_f(peer, header):
            if peer == f.peer_id:
                raise Refused("full", "as if the part had not arrived")
            return plain(peer, header)

        members[0].service.inbox.check_delta_header = refuse_f
    elif case == "slow_while_sending":  # F's part reaches members 2 and 3 a second and a half late
        request = f.service.request

        async def slow(peer, frames, *args, **kwargs):
            if peer in (ids[2], ids[3]):
                await asyncio.sleep(1.5)
            return await request(peer, frames, *args, **kwargs)

        f.service.request = slow
    elif case == "slow_while_reducing":  # F reports a second and a half late
        f.runner._report = _late(1.5, f.runner._report)
    elif case in ("crash_while_sending", "crash_before_reducing"):
        # F's part reaches members 0 and 1 (or all four), then F's process is gone: no report
        start[4], finishers = False, set(range(4))
        reached = [0, 1] if case == "crash_while_sending" else [0, 1, 2, 3]
        for i in reached:
            assert send_delta(f, members[i], fp32_bytes(deltas[4]), NUMEL, weight=WEIGHTS[4]).ok
        f.service.shutdown()
    elif case != "cancel":
        raise AssertionError(case)
    futures = {
        i: members[i].runner.start(KEY, deltas[i], WEIGHTS[i], ids, "0" * 64) for i in range(N) if start[i]
    }
    if case == "cancel":  # F's round is cancelled once its part is on its way
        time.sleep(0.3)
        futures.pop(4).cancel()
        finishers = set(range(4))
    return futures, finishers


@pytest.mark.parametrize(
    "case",
    [
        "fail_before_sending",
        "crash_while_sending",
        "slow_while_sending",
        "crash_before_reducing",
        "slow_while_reducing",
        "cancel",
        "reached_all_but_one",
    ],
)
def test_members_that_finish_a_faulty_round_agree_on_its_senders_and_bits(dht_factory, case):
    deltas = deltas_for(seed=len(case))
    config = AggregatorConfig(method="centered_clip")
    with sync_group(
        dht_factory, N, NUMEL, aggregator="centered_clip", averaging_timeout=8.0, admitted=list(range(N))
    ) as members:
        ids = [m.peer_id for m in members]
        futures, finishers = _fault(case, members, deltas, ids)
        results = {i: futures[i].result(timeout=60) for i in sorted(finishers)}
    outcomes = {i: (r.outcome, r.members, r.detail) for i, r in results.items()}
    assert all(r.outcome == "averaged" for r in results.values()), outcomes
    sets = {tuple(r.members) for r in results.values()}
    assert len(sets) == 1, outcomes  # one agreed set of senders
    agreed = next(iter(sets))
    # everyone's part that reached a majority of the members is in: a crash after sending to two of
    # four leaves it out everywhere, one that reached all is in everywhere
    if case in ("crash_while_sending", "fail_before_sending", "cancel"):
        assert ids[4] not in agreed or case == "cancel", agreed
    else:
        assert ids[4] in agreed, (case, agreed)
    assert set(ids[:4]) <= set(agreed)
    reference = results[min(results)].delta
    assert all(torch.equal(r.delta, reference) for r in results.values())
    parts = [Contribution(p, deltas[ids.index(p)].numpy(), WEIGHTS[ids.index(p)]) for p in agreed]
    assert torch.equal(reference, torch.from_numpy(aggregate(parts, config)))
