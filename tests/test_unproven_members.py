"""A flood of claims does not make every round dial every claimant: holders with neither standing nor
a part offered lately are tried a few per round (`peer.sync.outer.MAX_UNPROVEN_MEMBERS`, fewer where
the round has a member with standing or heard from), and one a round failed to reach not again until
the heard-from window passes, on real members over real DHT
nodes and P2P streams."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from dht.identity import peer_id_of_key
from monitoring.metrics import PeerMetrics
from peer.codecs.formats import make_codec
from peer.config import RunManifest, SyncConfig
from peer.model.grid import ModelConfig
from peer.run.admission import AdmissionCheck, sign_admission
from peer.sync.dial_budget import DialBudget
from peer.sync.inbox import Inbox
from peer.sync.outer import MAX_UNPROVEN_MEMBERS, MAX_UNPROVEN_WITH_COMPANY, StreamingOuter
from peer.sync.standing import Standing
from tests.sync_members import CREATOR, MODULE, RUN_ID, sync_group

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

NUMEL = 64
#: free keys whose claims name them holders of the module; no peer runs behind any of them
FLOOD = 3 * MAX_UNPROVEN_MEMBERS


def _outer(manifest: RunManifest, member, budget: DialBudget) -> StreamingOuter:
    """A member's outer loop with no modules of its own: only whom its rounds take in is asked."""
    metrics = PeerMetrics("t", member.peer_id, "0", "t")
    return StreamingOuter({}, manifest, member.peer_id, metrics, member.runner, dial_budget=budget)


@contextmanager
def _flooded_pair(dht_factory):
    """Two real members of a module, member 0 admitted and member 1 on probation (it counts once its
    first part reached member 0), whose claim view also names FLOOD fakes as holders; yields
    (manifest, members, their ids, the view's holders, the fakes)."""
    fakes = [peer_id_of_key(RSAPrivateKey()) for _ in range(FLOOD)]
    manifest = RunManifest(
        name="t", model=ModelConfig(), seq_len=32, sync=SyncConfig(averaging_timeout_seconds=10)
    )
    with sync_group(dht_factory, 2, NUMEL, admitted=[0], averaging_timeout=10.0) as members:
        ids = [m.peer_id for m in members]
        yield manifest, members, ids, {MODULE: [*ids, *fakes]}, fakes


def test_claimants_never_heard_from_are_tried_a_few_per_round_while_real_holders_average(dht_factory):
    with _flooded_pair(dht_factory) as (manifest, members, ids, holders, fakes):
        # rounds a minute apart, as a real run's are (the budget in time is the next test's)
        clock = [0.0]
        loops = [_outer(manifest, m, DialBudget(clock=lambda: clock[0])) for m in members]
        tried: list[set[str]] = [set(), set()]
        together = 0
        for round_index in range(4):
            clock[0] += 60.0
            groups = [loop.members_of(MODULE, holders) for loop in loops]
            for i, group in enumerate(groups):
                in_group = set(group) & set(fakes)
                if i == 1 or round_index > 0:
                    # a member with standing (member 0) or heard from (member 1, after its first
                    # part) is in the round: a newcomer reaches us by its part, few are dialled
                    assert len(in_group) == MAX_UNPROVEN_WITH_COMPANY, (round_index, i, len(in_group))
                else:  # member 0 alone in its view: it may try member 1 in place of a fake
                    assert MAX_UNPROVEN_MEMBERS - 1 <= len(in_group) <= MAX_UNPROVEN_MEMBERS
                # a claimant that a round failed to reach is not dialled again within the window
                assert not in_group & tried[i], (round_index, i, in_group & tried[i])
                tried[i] |= in_group
            assert ids[0] in groups[1]  # standing: always a member
            for m in members:  # as the peer's schedule does before each round of the fragment
                m.service.inbox.set_current(MODULE, 0, round_index)
            started = time.monotonic()
            deltas = [torch.full((NUMEL,), float(i + 1)) for i in range(2)]
            futures = [
                m.runner.start((MODULE, 0, round_index), d, 1.0, g, "0" * 64)
                for m, d, g in zip(members, deltas, groups, strict=True)
            ]
            results = [f.result(timeout=60) for f in futures]
            if ids[1] not in groups[0]:
                # member 0 left member 1 out of this round (neither heard from nor in its sample): a
                # newcomer's first round under a flood may be its own, and its part makes it heard
                continue
            together += 1
            # the fakes fail at once (nobody answers for them): the round does not wait them out
            took = time.monotonic() - started
            assert took < 8.0, (took, [(r.outcome, r.members, r.dropped) for r in results])
            for r in results:
                assert r.outcome == "averaged" and sorted(r.members) == sorted(ids), (
                    r.outcome,
                    r.members,
                    r.dropped,
                )
                assert set(r.dropped) <= set(fakes) and len(r.dropped) <= MAX_UNPROVEN_MEMBERS
            assert torch.equal(results[0].delta, results[1].delta)
        # once member 1's part reached member 0 it is always a member there: its rounds are shared
        assert together >= 3
        # a new sample each round, never one that failed within the window: every claimant gets its
        # turn, so a real newcomer is reached
        assert len(tried[1]) == 4 * MAX_UNPROVEN_WITH_COMPANY


@pytest.mark.timeout(30)
def test_only_holders_with_standing_or_a_part_lately_count_as_heard_from():
    """Whom a leaver's BYE and a mover's HELLO go to (`Inbox.heard`): admitted holders, and holders whose
    part of any module came within the window; never a claimant that only published a claim."""
    admitted, newcomer, claimant = (peer_id_of_key(RSAPrivateKey()) for _ in range(3))
    tokens = {admitted: sign_admission(CREATOR, RUN_ID, admitted, "invite")}
    standing = Standing(
        AdmissionCheck(RUN_ID, CREATOR.get_public_key().to_bytes()), "open", lambda p: tokens.get(p, "")
    )
    inbox = Inbox(
        {MODULE: [16], "trunk": [16]}, make_codec("fp32"), lambda peer, module: True, 8, 0.0, standing
    )
    inbox.check_key(newcomer, "trunk", 0, 0)  # its part of another module came: it runs a peer
    assert inbox.heard([admitted, newcomer, claimant], within_seconds=60) == sorted([admitted, newcomer])
    assert inbox.unproven([admitted, newcomer, claimant], 60, MODULE) == sorted([newcomer, claimant])
    time.sleep(0.05)
    assert inbox.heard([newcomer, claimant], within_seconds=0.01) == []  # a part long ago is not lately


def test_rounds_many_times_a_second_dial_no_more_unproven_holders_than_the_budget_in_time(dht_factory):
    """Under a flood of claims, rounds that come many times a second (small modules, short H) dial
    at most one round's sample at once and then `rate` unproven holders per second, whatever the
    number of rounds: each dial of a key with no peer behind it is a wait and a failed dial."""
    with _flooded_pair(dht_factory) as (manifest, members, ids, holders, fakes):
        clock = [0.0]
        newcomer = _outer(manifest, members[1], DialBudget(rate=2.0, clock=lambda: clock[0]))
        dialled = []
        for _ in range(40):  # 40 rounds in 2 seconds
            group = newcomer.members_of(MODULE, holders)
            assert ids[0] in group  # the member with standing: the round itself goes on
            dialled.append(len(set(group) & set(fakes)))
            clock[0] += 0.05
        # one round's sample at first, then 2 a second: 2 + 2 × 2 s (one fewer at the window's edge)
        assert dialled[0] == MAX_UNPROVEN_WITH_COMPANY
        assert MAX_UNPROVEN_WITH_COMPANY + 3 <= sum(dialled) <= MAX_UNPROVEN_WITH_COMPANY + 4, dialled
        clock[0] += 60.0  # a minute without rounds: one whole sample again, never more
        group = newcomer.members_of(MODULE, holders)
        assert len(set(group) & set(fakes)) == MAX_UNPROVEN_WITH_COMPANY
