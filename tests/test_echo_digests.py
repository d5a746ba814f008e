"""The echo names a round's reports by digest and carries only those its member lacks.

Relaying every report to every member cost each member of a group of n about n² signed reports a
round (1.4 kB each: 17 kB of a 4-member round's 82 kB with a sparse part); the digests keep what
the echo is for: every member ends up holding every report another member holds, and a member
that signed two reports is caught by whoever sees both.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hivemind.utils.crypto import RSAPrivateKey

from dht.identity import peer_id_of_key
from peer.sync import wire
from peer.sync.reports import RoundReports, missing_reports, report_digest, send_echo, sign_report
from peer.sync.wire import Kind
from tests.sync_members import MODULE, RUN_ID, sync_group

KEY = (MODULE, 0, 0)
ROUND = wire.RoundKey(module=MODULE, fragment=0, round=0)
RUN = RUN_ID[:16]


def signed(key: RSAPrivateKey, received: dict[str, str]) -> wire.Report:
    report = wire.Report(run=RUN, key=ROUND, received=received, state_digest="0" * 64)
    return sign_report(report, key, peer_id_of_key(key))


async def _hold(member, reports: list[wire.Report]) -> None:
    for r in reports:
        assert member.service.inbox.slot(KEY).reports.add(r)


async def _echo(sender, to, held: list[wire.Report]) -> int:
    """`sender` echoes `held` to `to` as a round does; returns the bytes the round would count."""
    echo = wire.Echo(run=RUN, key=ROUND, held=[(r.reporter, report_digest(r)) for r in held])
    sent, gone = {KEY: 0}, {}
    deadline = asyncio.get_running_loop().time() + 10
    await send_echo(sender.service, to.peer_id, echo, held, deadline, KEY, None, sent, gone)
    assert not gone, gone
    return sent[KEY]


async def _slot_of(member) -> tuple[dict, dict, set]:
    slot = member.service.inbox.slot(KEY)
    return dict(slot.reports.reports), dict(slot.reports.equivocators), set(slot.echoes)


@pytest.mark.swarm
@pytest.mark.timeout(90)
def test_an_echo_names_reports_by_digest_and_sends_only_those_its_member_lacks(dht_factory):
    x, y, z = RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()
    rx, ry, rz = (signed(k, {peer_id_of_key(k): "1" * 64}) for k in (x, y, z))
    with sync_group(dht_factory, 2, 16) as (a, b):
        a.service.call(_hold(a, [rx, ry, rz]))
        b.service.call(_hold(b, [rx]))
        nbytes = a.service.call(_echo(a, b, [rx, ry, rz]), 20)
        reports, caught, echoes = b.service.call(_slot_of(b))
    assert sorted(reports) == sorted(r.reporter for r in (rx, ry, rz)) and not caught
    assert reports[ry.reporter] == ry and reports[rz.reporter] == rz
    assert echoes == {a.peer_id}
    header = wire.pack_header(
        Kind.ECHO, wire.Echo(run=RUN, key=ROUND, held=[(r.reporter, report_digest(r)) for r in (rx, ry, rz)])
    )
    lacked = sum(len(wire.pack_header(Kind.REPORT, r)) for r in (ry, rz))
    assert nbytes == len(header) + lacked  # the names of all three, the bodies of the two it lacked


@pytest.mark.swarm
@pytest.mark.timeout(90)
def test_a_member_that_holds_every_named_report_takes_the_echo_without_any_report_body(dht_factory):
    x, y = RSAPrivateKey(), RSAPrivateKey()
    rx, ry = (signed(k, {peer_id_of_key(k): "2" * 64}) for k in (x, y))
    with sync_group(dht_factory, 2, 16) as (a, b):
        a.service.call(_hold(a, [rx, ry]))
        b.service.call(_hold(b, [ry, rx]))
        nbytes = a.service.call(_echo(a, b, [rx, ry]), 20)
        _, _, echoes = b.service.call(_slot_of(b))
    header = wire.pack_header(
        Kind.ECHO, wire.Echo(run=RUN, key=ROUND, held=[(r.reporter, report_digest(r)) for r in (rx, ry)])
    )
    assert echoes == {a.peer_id} and nbytes == len(header)


@pytest.mark.swarm
@pytest.mark.timeout(90)
def test_a_reporter_named_by_another_digest_than_the_members_copy_is_caught_through_the_echo(dht_factory):
    """An equivocator told a member "I received nobody" and the echoer "I received myself": the
    member asks for the copy of the other digest and holds both, the evidence."""
    x = RSAPrivateKey()
    told_member = signed(x, {})
    told_echoer = signed(x, {peer_id_of_key(x): "3" * 64})
    with sync_group(dht_factory, 2, 16) as (a, b):
        a.service.call(_hold(a, [told_echoer]))
        b.service.call(_hold(b, [told_member]))
        a.service.call(_echo(a, b, [told_echoer]), 20)
        _, caught, _ = b.service.call(_slot_of(b))
    assert list(caught) == [told_echoer.reporter]


def test_a_member_cannot_ask_an_echoer_for_one_report_twice_or_out_of_order():
    for indices in ([0, 0], [2, 1], []):
        with pytest.raises(wire.WireError, match="Need"):
            wire.parse(wire.Need, msgpack.packb({"indices": indices}))
    assert wire.parse(wire.Need, msgpack.packb({"indices": [0, 3]})).indices == [0, 3]


def test_an_echo_naming_a_malformed_digest_is_refused():
    with pytest.raises(wire.WireError, match="Echo"):
        wire.parse(
            wire.Echo, msgpack.packb({"run": RUN, "key": ROUND.model_dump(), "held": [["peer", "not hex"]]})
        )


def test_a_hostile_echo_naming_many_digests_is_asked_only_for_what_can_matter():
    """One other digest of a reporter we hold is the evidence, two of one we do not are an
    equivocator's pair, and reporters beyond the round's room would be refused: an echo that names
    a thousand reports makes a member read at most those."""
    x = RSAPrivateKey()
    held = RoundReports()
    assert held.add(signed(x, {}))
    ours = peer_id_of_key(x)
    named = [(ours, f"{i:064x}") for i in range(5)] + [("Y", f"{i:064x}") for i in range(5)]
    named += [("Z", "a" * 64), ("W", "b" * 64), ("stranger", "c" * 64)]
    wanted = missing_reports(held, named, lambda reporter: reporter != "stranger", room=2)
    assert [named[i] for i in wanted] == [named[0], named[5], named[6], named[10]]
    assert missing_reports(held, named, lambda reporter: True, room=0) == [0]
