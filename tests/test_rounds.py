"""Sync rounds between real peers on loopback: the average every member applies, bit for bit, and
what happens to members that are missing, late, malformed, hostile or equivocating."""

from __future__ import annotations

import asyncio
import struct
import time

import pytest
import torch

from peer.codecs.formats import make_codec
from peer.sync import wire
from peer.sync.aggregate import AggregatorConfig, Contribution, aggregate
from peer.sync.inbox import BAN_AFTER_BAD_PARTS, BAN_SECONDS, Inbox
from peer.sync.strays import StrayWatch
from peer.sync.wire import Kind
from tests.sync_members import MODULE, RUN_ID, fp32_bytes, restart, run_round, send_delta, sync_group

pytestmark = pytest.mark.swarm

NUMEL = 6077


def deltas_for(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(NUMEL, generator=gen) * 0.01 * (i + 1) for i in range(n)]


@pytest.mark.parametrize("codec", ["fp32", "fp16", "nf4"])
def test_members_end_a_round_with_the_same_bits_the_projects_aggregator_gives(dht_factory, codec):
    deltas, weights = deltas_for(4), [1.0, 2.0, 3.0, 30.0]  # the last weight is over the cap
    c = make_codec(codec)
    decoded = [c.decode(c.encode(d), NUMEL) for d in deltas]
    with sync_group(dht_factory, 4, NUMEL, codec=codec, aggregator="centered_clip") as members:
        parts = [
            Contribution(m.peer_id, x.numpy(), w) for m, x, w in zip(members, decoded, weights, strict=True)
        ]
        expected = torch.from_numpy(aggregate(parts, AggregatorConfig(method="centered_clip")))
        results = run_round(members, deltas, weights)
    assert [r.outcome for r in results] == ["averaged"] * 4, [r.detail for r in results]
    assert all(r.group_size == 4 and not r.dropped for r in results)
    # not "close": the same bits on every member, so their global copies never walk apart, and the
    # bits of the run's robust aggregator over the decoded parts (not some other average)
    assert all(torch.equal(r.delta, expected) for r in results)
    plain = sum(w * d.double() for w, d in zip(weights, decoded, strict=True)) / sum(weights)
    assert float((expected.double() - plain).abs().max()) > 1e-4  # the cap did bite
    assert all(r.bytes_sent > 0 and r.bytes_received > 0 for r in results)


def test_robust_aggregator_bounds_a_member_sending_1000_times_its_gradient(dht_factory):
    deltas = deltas_for(4, seed=1)
    honest = torch.stack(deltas[:3]).mean(0)
    deltas[3] = deltas[3] * 1000
    errors = {}
    for method in ("mean", "centered_clip"):
        with sync_group(dht_factory, 4, NUMEL, aggregator=method) as members:
            results = run_round(members, deltas, [1.0] * 4)
        assert all(torch.equal(r.delta, results[0].delta) for r in results)
        errors[method] = float((results[0].delta - honest).norm() / honest.norm())
    assert errors["mean"] > 100
    assert errors["centered_clip"] < 1.0, errors


def test_a_member_that_never_sends_is_left_out_by_all_and_the_others_average(dht_factory):
    deltas = deltas_for(3, seed=2)
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=6.0) as members:
        ids = [m.peer_id for m in members]
        started = time.monotonic()
        futures = [
            m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64)
            for m, d in zip(members[:2], deltas, strict=False)
        ]
        results = [f.result(timeout=30) for f in futures]
        seconds = time.monotonic() - started
    assert [r.outcome for r in results] == ["averaged", "averaged"]
    assert all(r.members == sorted(ids[:2]) and r.dropped == {ids[2]: "missing"} for r in results)
    assert torch.equal(results[0].delta, results[1].delta)
    assert torch.allclose(results[0].delta, (deltas[0] + deltas[1]) / 2, atol=1e-7)
    assert seconds < 6.0 + 2.0 + 3.0  # the averaging timeout, the report timeout, and slack


def test_a_member_that_leaves_mid_round_is_not_waited_for_until_the_timeout(dht_factory):
    # it took our outer gradients, then announced it is leaving without sending its own: the others
    # see its claim go and end the round at once, not at the averaging timeout (a peer told to stop
    # would otherwise wait that long too)
    deltas, left = deltas_for(3, seed=5), set()
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=30.0, left=left) as members:
        ids = [m.peer_id for m in members]
        started = time.monotonic()
        futures = [
            m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64)
            for m, d in zip(members[:2], deltas, strict=False)
        ]
        time.sleep(2.0)
        assert not any(f.done() for f in futures)  # still waiting for the third
        left.add(ids[2])
        results = [f.result(timeout=40) for f in futures]
        seconds = time.monotonic() - started
    assert [r.outcome for r in results] == ["averaged", "averaged"]
    assert all(r.dropped == {ids[2]: "left (its claim is gone)"} for r in results), results[0].dropped
    assert torch.equal(results[0].delta, results[1].delta)
    assert seconds < 2.0 + 2.0 + 3.0, seconds  # the wait before it left, the report timeout, slack


def test_a_member_that_says_it_leaves_the_module_is_not_waited_for(dht_factory):
    # moving to another path (or stopping), it tells the module's other holders first: their rounds
    # end without it at once, before its claim has changed anywhere
    deltas = deltas_for(3, seed=8)
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=30.0) as members:
        ids = [m.peer_id for m in members]
        futures = [
            m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64)
            for m, d in zip(members[:2], deltas, strict=False)
        ]
        time.sleep(1.0)
        assert not any(f.done() for f in futures)  # still waiting for the third
        started = time.monotonic()
        bye = wire.pack_header(Kind.BYE, wire.Bye(run=RUN_ID[:16], modules=[MODULE]))
        for m in members[:2]:
            assert members[2].service.call(members[2].service.request(m.peer_id, [bye], 10), 20).ok
        results = [f.result(timeout=40) for f in futures]
        seconds = time.monotonic() - started
    assert [r.outcome for r in results] == ["averaged", "averaged"]
    assert all(r.dropped == {ids[2]: "left (its claim is gone)"} for r in results), results[0].dropped
    assert seconds < 5.0


def test_a_late_member_applies_the_average_the_others_agreed_on(dht_factory):
    deltas = deltas_for(3, seed=3)
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=3.0) as members:
        ids = [m.peer_id for m in members]
        early = [
            m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64)
            for m, d in zip(members[:2], deltas, strict=False)
        ]
        early_results = [f.result(timeout=30) for f in early]
        late = members[2].runner.start((MODULE, 0, 0), deltas[2], 1.0, ids, "0" * 64).result(timeout=30)
    assert late.outcome == "excluded" and ids[2] not in late.members
    assert all(torch.equal(late.delta, r.delta) for r in early_results)


def _round_with_copies(members, copies: list[str], round_index: int = 0):
    ids = [m.peer_id for m in members]
    deltas = deltas_for(len(members), seed=4)
    futures = [
        m.runner.start((MODULE, 0, round_index), d, 1.0, ids, c)
        for m, d, c in zip(members, deltas, copies, strict=True)
    ]
    return [f.result(timeout=60) for f in futures]


def test_a_copy_outside_a_majority_is_repaired_and_copies_without_one_are_merged(dht_factory):
    a, b = "a" * 64, "b" * 64
    with sync_group(dht_factory, 4, NUMEL) as members:
        ids = [m.peer_id for m in members]
        # three agree: the odd one out repairs from them, nobody else does, nothing is merged
        results = _round_with_copies(members, [a, a, a, b])
        assert [r.repair_from for r in results] == [[], [], [], sorted(ids[:3])]
        assert all(not r.merge_with for r in results)
        # a healed partition, two against two: no camp is picked, every member merges all copies
        copies = [b, a, b, a]
        results = _round_with_copies(members, copies, round_index=1)
        assert [r.repair_from for r in results] == [[]] * 4
        for r in results:  # every voter's copy, ours included: every member merges the same ones
            assert r.merge_with == dict(zip(ids, copies, strict=True))
    with sync_group(dht_factory, 2, NUMEL) as pair:
        # one against one: neither copy wins (a lone peer could grind a small digest); both merge
        results = _round_with_copies(pair, [b, a])
        assert [r.repair_from for r in results] == [[], []]
        assert [sorted(r.merge_with.values()) for r in results] == [[a, b], [a, b]]


def test_malformed_and_nonfinite_parts_are_refused_and_their_sender_left_out(dht_factory):
    deltas = deltas_for(3, seed=4)
    with sync_group(dht_factory, 3, NUMEL, max_delta_norm=1e3) as members:
        a, b, hostile = members
        nan = torch.full((NUMEL,), float("nan"))
        assert not send_delta(hostile, a, fp32_bytes(nan), NUMEL).ok
        huge = torch.full((NUMEL,), 1e3)
        assert not send_delta(hostile, b, fp32_bytes(huge), NUMEL).ok
        short = send_delta(hostile, a, fp32_bytes(deltas[2])[:-4], NUMEL)
        assert not short.ok and "shape" in short.reason
        oversized = send_delta(hostile, a, b"", NUMEL, payload_bytes=2**35)
        assert not oversized.ok  # refused from its header, before a byte of payload is read
        ids = [m.peer_id for m in members]
        futures = [
            m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64)
            for m, d in zip((a, b), deltas, strict=False)
        ]
        results = [f.result(timeout=30) for f in futures]
        refused = dict(a.service.refused) | dict(b.service.refused)
    assert {"nonfinite", "norm", "shape"} <= set(refused), refused
    assert all(r.members == sorted([a.peer_id, b.peer_id]) for r in results)
    assert torch.equal(results[0].delta, results[1].delta)


def test_a_member_that_banned_a_sender_refuses_its_traffic_yet_applies_the_groups_bits(dht_factory):
    deltas = deltas_for(3, seed=6)
    nan = fp32_bytes(torch.full((NUMEL,), float("nan")))
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=30.0) as members:
        a, b, hostile = members
        assert not send_delta(hostile, a, nan, NUMEL).ok
        assert not send_delta(hostile, a, nan, NUMEL).ok
        # two bad parts are not yet a ban: a well-formed part is still taken
        assert send_delta(hostile, a, fp32_bytes(deltas[2]), NUMEL).ok
        assert not send_delta(hostile, a, nan, NUMEL, round_index=1).ok
        banned = send_delta(hostile, a, fp32_bytes(deltas[2]), NUMEL, round_index=1)
        assert not banned.ok and "banned" in banned.reason
        # the next round: a refuses everything the banned sender offers it, b takes its well-formed
        # part. A ban is one member's: it cannot veto a part the majority took (else one member could
        # veto anyone), so a takes that part from b and every member applies the same bits
        started = time.monotonic()
        results = run_round(members, deltas, [1.0] * 3, round_index=1)
        seconds = time.monotonic() - started
        assert b.service.refused["banned"] == 0 and a.service.refused["banned"] >= 2
    # nobody waits out the averaging timeout for the part a refused
    assert seconds < 15.0
    assert all(r.outcome == "averaged" and r.group_size == 3 for r in results), [r.dropped for r in results]
    assert all(torch.equal(r.delta, results[0].delta) for r in results)
    assert torch.allclose(results[0].delta, sum(deltas) / 3, atol=1e-7)


def test_a_ban_lasts_its_time_and_then_ends():
    now = [1000.0]
    inbox = Inbox({MODULE: [NUMEL]}, make_codec("fp32"), lambda p, m: True, 8, 0.0, clock=lambda: now[0])
    for _ in range(BAN_AFTER_BAD_PARTS - 1):
        inbox.strike("peer", "nonfinite")
    assert not inbox.banned("peer")
    inbox.strike("peer", "stale")  # what honest peers earn does not count towards a ban
    assert not inbox.banned("peer")
    inbox.strike("peer", "norm")
    assert inbox.banned("peer")
    now[0] += BAN_SECONDS - 1
    assert inbox.banned("peer")
    now[0] += 2
    assert not inbox.banned("peer")


def test_a_sender_that_sends_different_bytes_to_different_members_is_dropped_by_both(dht_factory):
    deltas = deltas_for(3, seed=5)
    with sync_group(dht_factory, 3, NUMEL) as members:
        a, b, hostile = members
        assert send_delta(hostile, a, fp32_bytes(deltas[2]), NUMEL).ok
        assert send_delta(hostile, b, fp32_bytes(-deltas[2]), NUMEL).ok
        ids = [m.peer_id for m in members]
        futures = [
            m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64)
            for m, d in zip((a, b), deltas, strict=False)
        ]
        results = [f.result(timeout=30) for f in futures]
    for r in results:
        assert r.members == sorted([a.peer_id, b.peer_id]) and "disputed" in r.dropped[hostile.peer_id]
    assert torch.equal(results[0].delta, results[1].delta)
    assert torch.allclose(results[0].delta, (deltas[0] + deltas[1]) / 2, atol=1e-7)


def test_a_frame_longer_than_its_cap_is_dropped_before_it_is_read(dht_factory):
    with sync_group(dht_factory, 2, NUMEL) as members:
        a, b = members

        async def flood():
            from hivemind.p2p import PeerID

            _, reader, writer = await a.service.p2p.call_binary_stream_handler(
                PeerID.from_base58(b.peer_id), wire.PROTOCOL
            )
            # a DELTA frame claiming 4 GiB of header: the receiver must close without reading it
            writer.write(bytes([Kind.DELTA]) + struct.pack(">I", 2**32 - 1) + b"x" * 1024)
            await writer.drain()
            data = await reader.read()
            writer.close()
            return data

        assert a.service.call(flood(), timeout=20) == b""
        deadline = time.monotonic() + 5
        while not b.service.refused["protocol"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert b.service.refused["protocol"] == 1


def test_rounds_outside_the_window_are_refused(dht_factory):
    with sync_group(dht_factory, 2, NUMEL) as members:
        a, b = members
        x = fp32_bytes(torch.zeros(NUMEL))
        assert send_delta(a, b, x, NUMEL, round_index=2).ok  # a holder up to two rounds ahead is kept
        ahead = send_delta(a, b, x, NUMEL, round_index=3)
        assert not ahead.ok and "ahead" in ahead.reason
        assert b.service.inbox.seen_ahead[(MODULE, 0)] == 3
        b.service.call(_set_current(b, 2))
        stale = send_delta(a, b, x, NUMEL, round_index=1)
        assert not stale.ok and "stale" in stale.reason
        wrong_run = wire.DeltaHeader(
            run="cd" * 8, key=wire.RoundKey(module=MODULE, fragment=0, round=2), weight=1.0, codec="fp32",
            numel=NUMEL, payload_bytes=len(x),
        )  # fmt: skip
        ack = a.service.call(
            a.service.request(
                b.peer_id, [wire.pack_header(Kind.DELTA, wrong_run), wire.pack(Kind.PAYLOAD, x)], 10
            )
        )
        assert not ack.ok and "run" in ack.reason
    assert RUN_ID[:16] != "cd" * 8


async def _set_current(member, round_index):
    member.service.inbox.set_current(MODULE, 0, round_index)


def test_a_member_whose_rounds_ran_far_ahead_of_most_members_learns_they_lag_and_one_joiner_does_not_say_so(
    dht_factory,
):
    """A lone lineage (a healed partition's half of one) sends a round the others refuse as beyond
    their lookahead: its result names them as lagging, so `PathSync` takes their state after
    `STRAY_ROUNDS` such rounds. Where as many members took the round as refused it (a joiner still
    downloading beside a holder in step), nobody is lagging."""
    x = torch.full((NUMEL,), 0.01)
    with sync_group(dht_factory, 4, NUMEL, averaging_timeout=2.0) as members:
        lone, *rest = members
        for m in rest:
            m.service.call(_set_current(m, 5))
        result = lone.runner.start((MODULE, 0, 12), x, 1.0, [m.peer_id for m in members], "0" * 64)
        result = result.result(timeout=60)
        assert result.outcome == "alone"
        assert result.lagging == sorted(m.peer_id for m in rest), result.dropped
        assert all(why.startswith("refused (ahead") for why in result.dropped.values())
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=2.0) as members:
        a, b, joiner = members
        for m in (a, b):
            m.service.call(_set_current(m, 7))
        ids = [m.peer_id for m in members]
        futures = [m.runner.start((MODULE, 0, 7), x, 1.0, ids, "0" * 64) for m in (a, b)]
        results = [f.result(timeout=60) for f in futures]
    assert [r.outcome for r in results] == ["averaged"] * 2, [r.detail for r in results]
    assert all(r.lagging == [] for r in results)
    assert all(r.dropped[joiner.peer_id].startswith("refused (ahead") for r in results)


def test_a_fragment_strays_only_after_rounds_in_a_row_whose_lagging_members_outnumber_the_rest():
    watch = StrayWatch(rounds=2)
    assert not watch.strayed("trunk", 0, ["b", "c"])
    assert not watch.strayed("trunk", 0, [])  # a round in step starts the count again
    assert not watch.strayed("trunk", 0, ["b", "c"])
    assert not watch.strayed("trunk", 1, ["b", "c"])  # fragments count apart
    assert watch.strayed("trunk", 0, ["b", "c"])
    assert not watch.strayed("trunk", 0, ["b", "c"])  # and once taken, the count starts again


def test_a_joiner_whose_holder_decided_the_round_without_it_learns_so_at_once_instead_of_waiting(dht_factory):
    """A holder that did not see a joiner yet decides its round alone; the joiner's outer gradient
    for that round then comes too late and is refused as stale, so the joiner is `behind` (it takes
    the holder's state) at once, not after the averaging timeout waiting for a part that never comes.
    A member the round counted is still taken late (it applies the aggregate, `excluded`)."""
    x = torch.full((NUMEL,), 0.01)
    with sync_group(dht_factory, 2, NUMEL, averaging_timeout=30.0) as members:
        holder, joiner = members
        for m in members:
            m.service.call(_set_current(m, 4))
        alone = holder.runner.start((MODULE, 0, 4), x, 1.0, [holder.peer_id], "0" * 64).result(timeout=60)
        assert alone.outcome == "alone"
        ids = [holder.peer_id, joiner.peer_id]
        late = joiner.runner.start((MODULE, 0, 4), x, 1.0, ids, "0" * 64).result(timeout=60)
        why = (late.outcome, late.detail, late.dropped)
        assert late.outcome == "behind" and late.ahead == [holder.peer_id], why
        assert late.seconds < 15, late.seconds
        # a round that counts the joiner takes its part
        assert send_delta(joiner, holder, fp32_bytes(x), NUMEL, round_index=5).ok
        nxt = holder.runner.start((MODULE, 0, 5), x, 1.0, ids, "0" * 64).result(timeout=60)
        assert nxt.outcome == "averaged" and nxt.members == sorted(ids), (nxt.outcome, nxt.detail)


def test_a_peer_restarted_mid_round_never_signs_a_second_report_for_it_and_is_not_banned(
    dht_factory, tmp_path
):
    """A member killed after it sent its part and report, restarted (same key, its record of sent
    rounds read back from disk) while the others still wait for a fourth member, would send a new
    part and sign a new report for the same round: the others would catch it equivocating and ban it
    for BAN_SECONDS. It sits the round out instead and takes the holders' state; the others count the
    part of its first life."""
    from peer.sync.sent_rounds import SentRounds

    deltas = deltas_for(3, seed=11)
    key = (MODULE, 0, 0)
    paths, sent = {2: str(tmp_path / "c.key")}, {2: SentRounds(tmp_path, RUN_ID)}
    with sync_group(
        dht_factory, 4, NUMEL, averaging_timeout=12.0, identity_paths=paths, sent=sent
    ) as members:
        a, b, c, silent = members
        everyone = [m.peer_id for m in members]
        futures = [
            m.runner.start(key, d, 1.0, everyone, "0" * 64) for m, d in zip((a, b), deltas, strict=False)
        ]
        # c does not see the silent member: it gathers, reports and decides while a and b still wait
        c_ids = [a.peer_id, b.peer_id, c.peer_id]
        assert c.runner.start(key, deltas[2], 1.0, c_ids, "0" * 64).result(timeout=60).outcome == "averaged"
        assert c.peer_id in a.service.call(_reports_of(a, key))
        # killed, and restarted from a checkpoint taken before the round
        again = restart(dht_factory, members, 2, str(tmp_path / "c.key"), SentRounds(tmp_path, RUN_ID))()
        assert again.peer_id == c.peer_id
        redo = again.runner.start(key, deltas[2] * 3, 1.0, c_ids, "0" * 64).result(timeout=60)
        results = [f.result(timeout=60) for f in futures]
    assert redo.outcome == "behind" and sorted(redo.ahead) == sorted([a.peer_id, b.peer_id]), redo
    for r in results:
        assert r.outcome == "averaged" and r.dropped == {silent.peer_id: "missing"}, (r.outcome, r.dropped)
        assert torch.allclose(r.delta, sum(deltas) / 3, atol=1e-6)
    assert not a.service.inbox.banned(c.peer_id) and not b.service.inbox.banned(c.peer_id)


async def _reports_of(member, key) -> list[str]:
    return list(member.service.inbox.slot(key).reports.reports)


def test_a_member_that_answers_our_resent_part_as_a_duplicate_is_counted_as_holding_it(dht_factory):
    """Our first send's ACK lost on our side, the part resent (`answer`): the member says "duplicate",
    which means it holds our part for this round, as an "ok" would; it is not recorded as refusing it."""
    with sync_group(dht_factory, 2, NUMEL) as (a, b):
        header = wire.DeltaHeader(
            run=RUN_ID[:16], key=wire.RoundKey(module=MODULE, fragment=0, round=0), weight=1.0,
            codec="fp32", numel=NUMEL, payload_bytes=NUMEL * 4, admission=a.token,
        )  # fmt: skip
        frames = [wire.pack_header(Kind.DELTA, header), wire.pack(Kind.PAYLOAD, fp32_bytes(deltas_for(1)[0]))]
        key = (MODULE, 0, 0)

        async def send() -> tuple[dict, set]:
            failed, took = {}, set()
            deadline = asyncio.get_running_loop().time() + 10.0
            await a.runner._send(b.peer_id, frames, deadline, failed, key, took=took)
            return failed, took

        assert a.service.call(send(), timeout=20) == ({}, {b.peer_id})  # it took our part
        assert a.service.call(send(), timeout=20) == ({}, {b.peer_id})  # "duplicate": it holds it
        assert a.peer_id in b.service.inbox.slot(key).deliveries
