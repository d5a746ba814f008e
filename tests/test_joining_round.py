"""A holder that joins a run in progress syncs with the holders that are ahead of it in time.

A restarted (or newly downloaded, or moved) peer takes its module's round from the holders, but its
schedule starts at that round's first step while they are most of the way through it: before, each
round of theirs waited for its part until the straggler bound ran out (seconds, at every restart of a
churning swarm; `benchmarks.goodput`'s kill arm). Real members on real DHT nodes here.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from monitoring.metrics import PeerMetrics
from peer.config import OuterOptimizerConfig, RunManifest, SyncConfig
from peer.model.grid import ModelConfig
from peer.model.transformer import PathModel
from peer.sync.module_sync import ModuleSync
from peer.sync.outer import StreamingOuter
from peer.sync.sent_rounds import SentRounds
from tests.sync_members import MODULE, RUN_ID, fp32_bytes, send_delta, sync_group

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

CFG = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=33, blocks_per_module=4)
H = 10
#: the module's round when the joiner took its state
ROUND = 3
#: long enough that a round waiting for the joiner's full window could not end within the test's bound
TIMEOUT_SECONDS = 30.0


OUTER = OuterOptimizerConfig(lr=0.7, momentum=0.0, nesterov=False)
MANIFEST = RunManifest(
    name="t",
    model=CFG,
    seq_len=32,
    sync=SyncConfig(inner_steps=H, averaging_timeout_seconds=TIMEOUT_SECONDS, aggregator="mean"),
    outer=OUTER,
)


def _base() -> tuple[PathModel, int]:
    """The module's weights every member's copy starts from, and the size of its one fragment."""
    base = PathModel(CFG, (0, 0), seed=3)
    return base, ModuleSync(CFG, MODULE, base.parts[MODULE], OUTER, 1).fragment_size(0)


def _loop_at_round(member, base: PathModel) -> StreamingOuter:
    """`member`'s outer loop as a peer's that just took the module at round ROUND (a restart, a
    download): its schedule at that round's first step, its inbox's window at that round."""
    ms = ModuleSync(CFG, MODULE, copy.deepcopy(base).parts[MODULE], OUTER, 1)
    metrics = PeerMetrics("t", member.peer_id, "0", "t")
    loop = StreamingOuter({MODULE: ms}, MANIFEST, member.peer_id, metrics, member.runner)
    ms.fragment_rounds = [ROUND]
    loop.align(ms.fragment_rounds)
    member.service.call(_set_current(member, ROUND))  # as `PathSync._track` does
    return loop


def _wait_for_parts(loop: StreamingOuter, senders: set[str], seconds: float = 15.0) -> None:
    key = (MODULE, 0, ROUND)
    deadline = time.monotonic() + seconds
    while not senders <= loop.runner.service.inbox.senders(key):
        assert time.monotonic() < deadline, f"parts of {senders} never reached the joiner"
        time.sleep(0.05)


def test_a_joiner_starts_its_first_round_when_most_holders_sent_theirs_so_nobody_waits_for_it(dht_factory):
    base, numel = _base()
    with sync_group(dht_factory, 3, numel, averaging_timeout=TIMEOUT_SECONDS) as members:
        holders = {MODULE: [m.peer_id for m in members]}
        models = [copy.deepcopy(base) for _ in members]
        syncs = [ModuleSync(CFG, MODULE, m.parts[MODULE], OUTER, 1) for m in models]
        loops = [
            StreamingOuter({MODULE: ms}, MANIFEST, m.peer_id, PeerMetrics("t", m.peer_id, "0", "t"), m.runner)
            for m, ms in zip(members, syncs, strict=True)
        ]
        for m, ms, loop in zip(members, syncs, loops, strict=True):  # at round 3: the joiner took it
            ms.fragment_rounds = [ROUND]
            loop.align(ms.fragment_rounds)
            m.service.call(_set_current(m, ROUND))  # as `PathSync._track` does
        first, second, joiner = loops
        first.joining = second.joining = False  # in step: their first round after a join is long past
        with torch.no_grad():  # what training did to each local copy since the round began
            for i, model in enumerate(models):
                for p in model.parts[MODULE].parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 1e-3)
        began = time.monotonic()
        # each loop is ticked as `PathSync.after_step` does; rounds are collected at the end (drain)
        for step in range(1, H + 1):  # the first holder made its H steps: its round starts
            first.tick(100 * step, holders)
        _wait_for_parts(joiner, {members[0].peer_id})
        joiner.tick(100, holders)
        # one of the two others is no majority: the joiner keeps training
        assert joiner.clock == ROUND * H + 1 and not joiner.pending
        for step in range(1, H + 1):
            second.tick(100 * step, holders)
        _wait_for_parts(joiner, {members[0].peer_id, members[1].peer_id})
        joiner.tick(200, holders)
        started = joiner.clock == (ROUND + 1) * H and len(joiner.pending) == 1
        assert started, "the joiner's round did not start with theirs"
        results = []
        for loop in loops:
            (pending,) = loop.drain()
            results.append(loop.collect(pending)[MODULE])
            loop.apply(pending, MODULE, results[-1])
        took = time.monotonic() - began
    assert [r.outcome for r in results] == ["averaged"] * 3, [(r.outcome, r.detail) for r in results]
    assert all(sorted(r.members) == sorted(holders[MODULE]) for r in results)
    assert took < TIMEOUT_SECONDS / 2, f"the holders waited for the joiner: {took:.1f} s"
    assert torch.equal(syncs[0].global_flats[0], syncs[2].global_flats[0])
    assert torch.equal(syncs[1].global_flats[0], syncs[2].global_flats[0])
    assert not joiner.joining  # only the first round after a join is cut short


def test_a_restarted_holder_sits_out_the_round_its_previous_life_sent_at_its_first_step(
    dht_factory, tmp_path
):
    """Its previous life sent round 3 and was killed before applying it. Restarted at that round's
    first step, it sat the round out only once its schedule reached the due step, H steps later,
    while the holders, rounds past it, waited for its next part (a churn run's survivors left
    restarted peers out as late after 5 s, twice after one kill). The round needs none of its steps:
    it is sat out at the first step, and the holder past it is whose state it takes."""
    base, numel = _base()
    SentRounds(tmp_path, RUN_ID).record(MODULE, 0, ROUND)
    sent = {0: SentRounds(tmp_path, RUN_ID)}
    with sync_group(dht_factory, 2, numel, averaging_timeout=TIMEOUT_SECONDS, sent=sent) as members:
        restarted, holder = members
        holders = {MODULE: [m.peer_id for m in members]}
        loop = _loop_at_round(restarted, base)
        loop.tick(100, holders)
        started = loop.clock == (ROUND + 1) * H and len(loop.pending) == 1
        assert started, (
            f"the sent round waited for its due step (clock {loop.clock}, {len(loop.pending)} started)"
        )
        # the holder is past the round: its part of the next one comes
        assert send_delta(holder, restarted, fp32_bytes(torch.zeros(numel)), numel, round_index=ROUND + 1).ok
        (pending,) = loop.drain()
        result = loop.collect(pending)[MODULE]
    assert result.outcome == "behind" and result.ahead == [holder.peer_id], (result.outcome, result.detail)


def test_a_joiner_whose_state_is_a_round_old_starts_that_round_at_once_and_finds_itself_behind(dht_factory):
    """The joiner took the module's state from a donor a moment before the holders applied the next
    round: it is at round 3 while they send their parts of round 4. Trained on to round 3's due step
    (H steps, 6 s with restarts sharing the CPU), it held up the holders, which waited for its part of
    round 4 as a straggler each time (a churn run's survivors left restarted peers out as late after
    5 s). It starts round 3 at its first step instead: the holders refuse it as over, and it is told
    it is behind, whose state to take."""
    base, numel = _base()
    with sync_group(dht_factory, 3, numel, averaging_timeout=TIMEOUT_SECONDS) as members:
        joiner, *ahead = members
        holders = {MODULE: [m.peer_id for m in members]}
        loop = _loop_at_round(joiner, base)
        for holder in ahead:  # past round 3: their parts of round 4 come
            holder.service.call(_set_current(holder, ROUND + 1))
            assert send_delta(holder, joiner, fp32_bytes(torch.zeros(numel)), numel, round_index=ROUND + 1).ok
        loop.tick(100, holders)
        started = loop.clock == (ROUND + 1) * H and len(loop.pending) == 1
        assert started, f"round 3 waited for its due step (clock {loop.clock}, {len(loop.pending)} started)"
        (pending,) = loop.drain()
        result = loop.collect(pending)[MODULE]
    assert result.outcome == "behind", (result.outcome, result.detail)
    assert sorted(result.ahead) == sorted(h.peer_id for h in ahead), result.ahead


def test_a_joiner_left_out_of_a_round_while_it_started_sits_it_out_instead_of_sending_a_part(
    dht_factory, tmp_path
):
    """The holders' round reached the joiner while it started: it answered their probe that it was
    starting, and they left it out and decided without it. Joining that round at its first step, as
    their parts invited, it counted its own report and part where theirs did not: the two sides
    applied different sets (a churn run's trunk split so, and was merged the next round). It sits
    the round out instead, sending nothing, and takes their state once they are past it."""
    from peer.sync.probe import STARTING_WHY

    base, numel = _base()
    sent = {2: SentRounds(tmp_path, RUN_ID)}
    with sync_group(dht_factory, 3, numel, averaging_timeout=TIMEOUT_SECONDS, sent=sent) as members:
        *holding, joiner = members
        ids = [m.peer_id for m in members]
        holders = {MODULE: ids}
        loop = _loop_at_round(joiner, base)
        for m in holding:
            m.service.call(_set_current(m, ROUND))
        joiner.service.training.clear()  # starting: its state, its data
        deltas = [torch.full((numel,), 0.01 * (i + 1)) for i in range(2)]
        rounds = [
            m.runner.start((MODULE, 0, ROUND), d, 1.0, ids, "0" * 64)
            for m, d in zip(holding, deltas, strict=True)
        ]
        results = [r.result(timeout=60) for r in rounds]
        for m in holding:  # they applied it
            m.service.call(_set_current(m, ROUND + 1))
        joiner.service.training.set()
        loop.tick(100, holders)
        started = loop.clock == (ROUND + 1) * H and len(loop.pending) == 1
        (pending,) = loop.drain()
        result = loop.collect(pending)[MODULE]
        sent_a_part = joiner.runner.sent.sent_already(MODULE, 0, ROUND)
    assert all(r.dropped.get(joiner.peer_id) == STARTING_WHY for r in results), [r.dropped for r in results]
    assert started, "the round it was left out of was not sat out at its first step"
    assert not sent_a_part, "it sent a part of a round its members had decided without it"
    assert result.outcome == "behind", (result.outcome, result.detail)
    assert result.ahead and set(result.ahead) <= {m.peer_id for m in holding}, result.ahead


async def _set_current(member, round_index: int) -> None:
    member.service.inbox.set_current(MODULE, 0, round_index)
