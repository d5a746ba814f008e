"""A peer that moved onto a module and loaded its state from a holder averages its next round of it
with that holder, also in an open run where neither has standing (`Inbox.served_state`): before,
the holder fell under the unproven holders' budget and both applied their own Δ (a split copy).
And the holders a mover leaves do not wait for it, whichever of its BYE and its refusals comes first."""

from __future__ import annotations

import time

import pytest
import torch

from monitoring.metrics import PeerMetrics
from peer.config import OuterOptimizerConfig, RunManifest, SyncConfig
from peer.model.grid import TRUNK, ModelConfig
from peer.model.transformer import PathModel
from peer.sync.outer import heard_within
from peer.sync.path_sync import PathSync
from tests.sync_members import MODULE, sync_group

pytestmark = pytest.mark.swarm

CFG = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=33, blocks_per_module=4)
SYNC = SyncConfig(inner_steps=8, codec="fp32")
NUMEL = 6077


def start_syncs(dht_factory, seeds: tuple[int, ...], syncs: list[PathSync]) -> list[PathSync]:
    """One started PathSync per seed on its own DHT, each added to `syncs` as it starts (the caller
    shuts down whatever started, also if a later one fails)."""
    manifest = RunManifest(name="t", model=CFG, seq_len=32, sync=SYNC, outer=OuterOptimizerConfig())
    for seed in seeds:
        dht, key = dht_factory()
        peer_id = str(dht.peer_id)
        metrics = PeerMetrics("t", peer_id, "0", "t")
        ps = PathSync(manifest, PathModel(CFG, (0, 0), seed=seed), peer_id, metrics)
        ps.start(dht, lambda peer, module: True, key=key)
        syncs.append(ps)
    return syncs


@pytest.mark.timeout(120)
def test_the_holder_a_mover_loaded_a_module_from_is_a_member_of_its_next_round_of_it(dht_factory):
    syncs: list[PathSync] = []
    try:
        mover, holder = start_syncs(dht_factory, (1, 2), syncs)
        holders = {TRUNK: [holder.peer_id]}
        # on probation and never heard from for this module, and one of our rounds failed to reach it
        # lately (a round while it was moving, say): our rounds leave it out for now
        mover.service.inbox.unreachable(holder.peer_id)
        assert mover.outer.members_of(TRUNK, holders) == [mover.peer_id]
        assert mover.fetch_state(mover.syncs[TRUNK], [holder.peer_id])
        assert mover.syncs[TRUNK].module_digest() == holder.syncs[TRUNK].module_digest()
        deadline = time.monotonic() + 10  # noted on the sync service's event loop
        while holder.peer_id not in mover.outer.members_of(TRUNK, holders) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mover.outer.members_of(TRUNK, holders) == sorted([mover.peer_id, holder.peer_id])
        # only for the module it served: another module's rounds still leave it to the budget
        assert mover.service.inbox.unproven([holder.peer_id], 60, "l0m0") == [holder.peer_id]
    finally:
        for ps in syncs:
            ps.shutdown()


@pytest.mark.timeout(120)
def test_a_mover_says_bye_to_the_holders_it_leaves_without_waiting_for_their_answers(
    dht_factory, monkeypatch
):
    # a holder's answer waits behind its own round work: a rotation that waited on each answer paused
    # training for most of its length (the goodput benchmark's rotation laps); a leaving peer still waits
    syncs: list[PathSync] = []
    try:
        mover, holder = start_syncs(dht_factory, (1, 2), syncs)
        assert mover.fetch_state(mover.syncs[TRUNK], [holder.peer_id])  # heard from: a bye goes to it
        deadline = time.monotonic() + 10  # noted on the sync service's event loop
        while (
            not mover.service.inbox.heard([holder.peer_id], heard_within(SYNC))
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert mover.service.inbox.heard([holder.peer_id], heard_within(SYNC)) == [holder.peer_id]
        monkeypatch.setenv("PATHSWARM_FAULTS", "sync.on_bye=stall:3")
        started = time.monotonic()
        mover.say_bye([TRUNK], {TRUNK: [holder.peer_id]}, wait=False)
        assert time.monotonic() - started < 1.0
        deadline = time.monotonic() + 15
        while not holder.service.inbox.gone(mover.peer_id, TRUNK) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert holder.service.inbox.gone(mover.peer_id, TRUNK)  # it was sent all the same
        assert time.monotonic() - started >= 3.0  # and only once the stalled holder took it
        started = time.monotonic()
        mover.say_bye(["l0m0"], {"l0m0": [holder.peer_id]})  # leaving: waits for the answer
        assert time.monotonic() - started >= 3.0
    finally:
        for ps in syncs:
            ps.shutdown()


@pytest.mark.timeout(120)
def test_two_peers_moving_onto_a_module_at_once_both_load_its_holders_state_instead_of_resetting_it(
    dht_factory,
):
    # the other mover's claim lists the module at round 0: asked to confirm the holder's state it could
    # only say "unknown", so every download was refused and both movers reset the module (goodput
    # rotation arm, 96 rounds: a 45 s stall)
    syncs: list[PathSync] = []
    try:
        holder, mover, other_mover = start_syncs(dht_factory, (1, 2, 3), syncs)
        trunk = holder.syncs[TRUNK]
        trunk.load_state(dict(module=TRUNK, fragment_rounds=[5] * trunk.n_fragments), trunk.state_tensors())
        assert sum(mover.syncs[TRUNK].fragment_rounds) == 0
        started = time.monotonic()
        donors = {TRUNK: [(holder.peer_id, 5 * trunk.n_fragments), (other_mover.peer_id, 0)]}
        assert mover.catch_up(donors) == 1
        assert mover.syncs[TRUNK].module_digest() == trunk.module_digest()
        assert mover.syncs[TRUNK].fragment_rounds == trunk.fragment_rounds
        assert time.monotonic() - started < 5.0  # no confirmations waited for from the other mover
    finally:
        for ps in syncs:
            ps.shutdown()


@pytest.mark.timeout(120)
def test_a_member_that_refuses_our_part_because_it_no_longer_holds_the_module_is_not_waited_for(dht_factory):
    # a mover drops the module as our round starts and its BYE comes later (or never): its refusal
    # ("not_held") says the same about itself; waiting for its part held its partner's round 5 s at a move
    deltas = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) * 0.01 for i in range(3)]
    with sync_group(dht_factory, 3, NUMEL, averaging_timeout=30.0) as members:
        ids = [m.peer_id for m in members]

        async def move_off() -> None:
            members[2].service.inbox.hold({})

        members[2].service.call(move_off(), 10)
        started = time.monotonic()
        futures = [
            m.runner.start((MODULE, 0, 0), d, 1.0, ids, "0" * 64)
            for m, d in zip(members[:2], deltas, strict=False)
        ]
        results = [f.result(timeout=40) for f in futures]
        seconds = time.monotonic() - started
    assert [r.outcome for r in results] == ["averaged", "averaged"]
    assert all(r.dropped == {ids[2]: "left (its claim is gone)"} for r in results), results[0].dropped
    assert torch.equal(results[0].delta, results[1].delta)
    assert seconds < 5.0, seconds
