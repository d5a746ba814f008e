"""What strangers and colluders can do to a round, tried between real peers on loopback: no report
vetoes a sender, "you are behind" from one key is not followed, keys on probation neither vote on
copies nor steer the aggregate, a member that tells members different things is caught by all, a
pair's caps come from the receiver, and a part that reached all members but one reaches it too."""

from __future__ import annotations

import pytest
import torch

from peer.sync.aggregate import AggregatorConfig, Contribution, aggregate
from peer.sync.inbox import Refused
from peer.sync.reports import RoundReports
from tests.sync_members import MODULE, fp32_bytes, run_round, send_delta, send_report, sync_group

pytestmark = pytest.mark.swarm

NUMEL = 4099


def deltas_for(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(NUMEL, generator=gen) * 0.01
    return [base + 0.002 * torch.randn(NUMEL, generator=gen) for _ in range(n)]


def _start(members, deltas, weights=None, digests=None, round_index: int = 0):
    ids = [m.peer_id for m in members]
    weights = weights or [1.0] * len(members)
    digests = digests or ["0" * 64] * len(members)
    return [
        m.runner.start((MODULE, 0, round_index), d, w, ids, s)
        for m, d, w, s in zip(members, deltas, weights, digests, strict=True)
    ]


def test_one_report_that_omits_every_other_sender_vetoes_nobody(dht_factory):
    deltas = deltas_for(4, seed=1)
    with sync_group(dht_factory, 4, NUMEL, aggregator="centered_clip", admitted=[0, 1, 2, 3]) as members:
        *honest, attacker = members
        ids = [m.peer_id for m in members]
        payload = fp32_bytes(deltas[3] * 50)
        from peer.sync.inbox import delivery_digest

        own = delivery_digest(1.0, attacker.token, payload)
        for h in honest:  # its part, and one identical report to everyone listing only its own delivery
            assert send_delta(attacker, h, payload, NUMEL).ok
            assert send_report(attacker, h, {attacker.peer_id: own}).ok
        futures = [
            m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64)
            for m, d in zip(honest, deltas, strict=False)
        ]
        results = [f.result(timeout=60) for f in futures]
    assert all(r.outcome == "averaged" and r.group_size == 4 for r in results), [r.dropped for r in results]
    assert all(torch.equal(r.delta, results[0].delta) for r in results)
    # the attacker's part is in, bounded by the robust aggregator: the result is near the honest mean
    honest_mean = torch.stack(deltas[:3]).mean(0)
    assert float((results[0].delta - honest_mean).norm() / honest_mean.norm()) < 0.5


def test_one_key_answering_stale_to_everything_is_left_out_not_followed(dht_factory):
    deltas = deltas_for(3, seed=2)
    with sync_group(dht_factory, 3, NUMEL, admitted=[0, 1, 2]) as members:
        a, b, liar = members

        def stale(*args, **kwargs):
            raise Refused("stale", "round 0 is over (ours is 99)")

        liar.service.inbox.check_delta_header = stale
        results = run_round(members, deltas, [1.0] * 3)
    for r in results[:2]:  # not "behind": the two others averaged, and apply the same bits
        assert r.outcome == "averaged" and not r.ahead and r.group_size >= 2, (r.outcome, r.detail)
    assert torch.equal(results[0].delta, results[1].delta)


def test_keys_on_probation_neither_repair_nor_merge_copies_nor_steer_the_aggregate(dht_factory):
    deltas = deltas_for(4, seed=3)
    # two sybils flip and inflate their outer gradients and claim a made-up copy, with a huge weight
    deltas[2] = deltas[3] = -20 * deltas[0]
    good, fake = "a" * 64, "f" * 64
    with sync_group(dht_factory, 4, NUMEL, aggregator="centered_clip", admitted=[0, 1]) as members:
        results = [
            f.result(timeout=60)
            for f in _start(members, deltas, weights=[1.0, 1.0, 1e6, 1e6], digests=[good, good, fake, fake])
        ]
    admitted = [Contribution(m.peer_id, d.numpy(), 1.0) for m, d in zip(members[:2], deltas, strict=False)]
    admitted_only = torch.from_numpy(aggregate(admitted, AggregatorConfig(method="centered_clip")))
    for r in results[:2]:
        assert not r.repair_from and not r.merge_with  # two sybils are no majority: only admitted keys vote
    assert [r.repair_from for r in results[2:]] == [sorted(m.peer_id for m in members[:2])] * 2
    # pointing away from the admitted members' aggregate, their parts add nothing at all: the same bits
    assert all(torch.equal(r.delta, admitted_only) for r in results)


def test_a_key_on_probation_adds_at_most_one_small_members_share_of_the_admitted_direction(dht_factory):
    deltas = deltas_for(3, seed=4)
    gen = torch.Generator().manual_seed(9)
    # a part at a small angle to the honest direction, 100x as long, claiming 10^6 tokens
    deltas[2] = 100 * (deltas[0] + 0.5 * deltas[0].norm() * torch.randn(NUMEL, generator=gen) / NUMEL**0.5)
    with sync_group(dht_factory, 3, NUMEL, aggregator="centered_clip", admitted=[0, 1]) as members:
        results = [f.result(timeout=60) for f in _start(members, deltas, weights=[1.0, 1.0, 1e6])]
    assert all(torch.equal(r.delta, results[0].delta) for r in results)
    admitted_mean = (deltas[0] + deltas[1]) / 2
    # rescaled to the admitted result's norm, weighed at most like the smallest admitted member (1/3 of
    # the total): it can move the result by at most 2/3 of that norm, never scale it
    moved = float((results[0].delta - admitted_mean).norm())
    assert 0 < moved <= 2 / 3 * float(admitted_mean.norm())
    assert float(results[0].delta.norm()) <= 1.01 * float(admitted_mean.norm())


def test_a_member_that_sends_members_different_reports_is_caught_by_all_and_left_out(dht_factory):
    deltas = deltas_for(4, seed=5)
    with sync_group(dht_factory, 4, NUMEL, admitted=[0, 1, 2, 3]) as members:
        *honest, liar = members
        ids = [m.peer_id for m in members]
        from peer.sync.inbox import delivery_digest

        payload = fp32_bytes(deltas[3])
        digest = delivery_digest(1.0, liar.token, payload)
        for h in honest:
            assert send_delta(liar, h, payload, NUMEL).ok
        # to the first member: "I received nobody"; to the others: "I received only myself"
        assert send_report(liar, honest[0], {}).ok
        for h in honest[1:]:
            assert send_report(liar, h, {liar.peer_id: digest}).ok
        futures = [
            m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64)
            for m, d in zip(honest, deltas, strict=False)
        ]
        results = [f.result(timeout=60) for f in futures]
        banned = [h.service.inbox.banned(liar.peer_id) for h in honest]
    assert all(r.outcome == "averaged" and r.group_size == 3 for r in results), [r.dropped for r in results]
    assert all("equivocated" in r.dropped[liar.peer_id] for r in results)
    assert all(torch.equal(r.delta, results[0].delta) for r in results)
    assert all(banned)


def test_a_member_of_a_pair_can_neither_scale_nor_reverse_the_others_update(dht_factory):
    deltas = deltas_for(2, seed=6)
    deltas[1] = -deltas[0] * 100  # the other member: reversed, a hundred times the norm, 10^6 the weight
    with sync_group(dht_factory, 2, NUMEL, aggregator="centered_clip", admitted=[0, 1]) as members:
        results = [f.result(timeout=60) for f in _start(members, deltas, weights=[1.0, 1e6])]
    assert all(r.outcome == "averaged" and r.group_size == 2 for r in results)
    assert torch.equal(results[0].delta, results[1].delta)  # the same bits on both
    assert float(results[0].delta.norm()) <= float(deltas[0].norm()) * 1.0001
    # cancelled at worst (up to rounding), never reversed
    assert float(results[0].delta.double() @ deltas[0].double()) >= -1e-6 * float(deltas[0].norm()) ** 2


def test_a_part_that_reached_all_members_but_one_reaches_that_one_too(dht_factory):
    deltas = deltas_for(4, seed=7)
    with sync_group(dht_factory, 4, NUMEL, aggregator="centered_clip", admitted=[0, 1, 2, 3]) as members:
        deprived, sender = members[0], members[3]
        plain = deprived.service.inbox.check_delta_header

        def refuse_one(peer, header):
            if peer == sender.peer_id:
                raise Refused("full", "as if the part had not arrived")
            return plain(peer, header)

        deprived.service.inbox.check_delta_header = refuse_one
        results = run_round(members, deltas, [1.0] * 4)
    assert all(r.outcome == "averaged" and r.group_size == 4 for r in results), [r.detail for r in results]
    assert all(torch.equal(r.delta, results[0].delta) for r in results)


def test_reports_not_signed_by_their_reporter_are_refused():
    from hivemind.utils.crypto import RSAPrivateKey

    from dht.identity import peer_id_of_key
    from peer.sync import wire
    from peer.sync.reports import sign_report

    key, other = RSAPrivateKey(), RSAPrivateKey()
    report = wire.Report(
        run="ab" * 8,
        key=wire.RoundKey(module=MODULE, fragment=0, round=0),
        received={},
        state_digest="0" * 64,
    )
    signed = sign_report(report, key, peer_id_of_key(key))
    reports = RoundReports()
    assert reports.add(signed)
    assert not reports.add(signed.model_copy(update={"reporter": peer_id_of_key(other)}))
    # signed by another key in the name of this one: the key's own hash is not the reporter's id
    assert not reports.add(sign_report(report, other, peer_id_of_key(key)))
    assert not reports.add(signed.model_copy(update={"state_digest": "1" * 64}))  # altered after signing
    assert list(reports.reports) == [peer_id_of_key(key)] and not reports.equivocators
