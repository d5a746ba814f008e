"""A round still running at its due step (its other members are slower) is trained through, not
waited for, when the run overlaps (τ > 0, α > 0), for at most H/P steps; the schedule holds until it
ends. τ a peer raised carries over a rotation, and comes down again once its rounds fit in a step less."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from monitoring.metrics import PeerMetrics
from peer.config import OuterOptimizerConfig, RunManifest, SyncConfig
from peer.model.grid import ModelConfig
from peer.model.transformer import PathModel
from peer.sync.module_sync import ModuleSync
from peer.sync.outer import StreamingOuter
from peer.sync.path_sync import PathSync
from peer.sync.sent_rounds import SentRounds
from tests.sync_members import MODULE, RUN_ID, advance, sync_group

pytestmark = pytest.mark.swarm

CFG = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=33, blocks_per_module=4)
H, TAU = 8, 2
TOKENS_PER_STEP = 100


def _loops(members, tau: int, alpha: float, h: int = H) -> tuple[list[StreamingOuter], list[ModuleSync]]:
    sync = SyncConfig(
        inner_steps=h, overlap_steps=tau, mixing_alpha=alpha, codec="fp32", aggregator="mean",
        averaging_timeout_seconds=10.0,
    )  # fmt: skip
    manifest = RunManifest(name="t", model=CFG, seq_len=32, sync=sync, outer=OuterOptimizerConfig(lr=0.7))
    base = PathModel(CFG, (0, 0), seed=5)
    syncs = [ModuleSync(CFG, MODULE, copy.deepcopy(base).parts[MODULE], manifest.outer, 1) for _ in members]
    loops = [
        StreamingOuter({MODULE: ms}, manifest, m.peer_id, PeerMetrics("t", m.peer_id, "0", "test"), m.runner)
        for m, ms in zip(members, syncs, strict=True)
    ]
    return loops, syncs


class Holder:
    """One member's training loop: its `StreamingOuter`, its module, and the tokens it trained."""

    def __init__(self, loop: StreamingOuter, ms: ModuleSync, gen: torch.Generator, holders: dict):
        self.loop, self.ms, self.gen, self.holders = loop, ms, gen, holders
        self.tokens = 0

    def step(self) -> float:
        """One inner step (a small random change of the local model) and the loop's part of it, as
        `PathSync.after_step` drives it; the seconds it took."""
        with torch.no_grad():
            for p in self.ms.local_params:
                p.add_(torch.randn(p.shape, generator=self.gen) * 1e-3)
        began = time.monotonic()
        self.tokens += TOKENS_PER_STEP
        advance(self.loop, self.tokens, self.holders)
        return time.monotonic() - began


@contextmanager
def _pair(
    dht_factory,
    tau: int,
    alpha: float,
    seed: int,
    sent: dict | None = None,
    averaging_timeout: float = 10.0,
    h: int = H,
) -> Iterator[list[Holder]]:
    """Two holders of one module, each with a real DHT node, sync service and round runner (`sent`:
    a member's record of rounds sent, as a restarted peer reads it)."""
    module = PathModel(CFG, (0, 0), seed=5).parts[MODULE]
    numel = ModuleSync(CFG, MODULE, module, OuterOptimizerConfig(), 1).fragment_size(0)
    with sync_group(dht_factory, 2, numel, sent=sent, averaging_timeout=averaging_timeout) as members:
        holders = {MODULE: [m.peer_id for m in members]}
        loops, syncs = _loops(members, tau, alpha, h)
        gen = torch.Generator().manual_seed(seed)
        yield [Holder(loop, ms, gen, holders) for loop, ms in zip(loops, syncs, strict=True)]


@pytest.mark.timeout(120)
def test_a_late_round_is_trained_through_for_up_to_h_over_p_steps_while_the_schedule_holds(dht_factory):
    with _pair(dht_factory, TAU, 0.5, seed=3) as (fast, slow):
        # the round starts at step H and is due at H + τ; the slow member is not there yet
        for _ in range(H + TAU):
            fast.step()
        assert fast.loop.clock == H + TAU and len(fast.loop.pending) == 1
        assert fast.loop.pending[0].held_since is not None
        # H/P − 1 more steps, none of them waiting for the round; the schedule stays where it was
        took = [fast.step() for _ in range(H - 1)]
        assert max(took) < 1.0, took
        assert fast.loop.clock == H + TAU and len(fast.loop.pending) == 1 and fast.ms.fragment_rounds == [0]
        # the H/P-th held step (by hand, so that nothing collects yet): the hold is over, the round due
        fast.tokens += TOKENS_PER_STEP
        fast.loop.tick(fast.tokens, fast.holders)
        due = fast.loop.due()
        assert len(due) == 1 and not due[0].finished() and due[0].held_steps == H + 1
        for _ in range(H + TAU):  # the slow member reaches the round, and its due step
            slow.step()
        for mid, result in fast.loop.collect(due[0]).items():  # waits for the round's end
            fast.loop.apply(due[0], mid, result)
        deadline = time.monotonic() + 30
        while slow.ms.fragment_rounds == [0] and time.monotonic() < deadline:
            slow.step()  # trained on until the round's result is in, then applied
        assert fast.ms.fragment_rounds == slow.ms.fragment_rounds == [1] and not fast.loop.pending
        assert torch.equal(fast.ms.global_flats[0], slow.ms.global_flats[0])
        assert fast.ms.digest(0) == slow.ms.digest(0)
        clock = fast.loop.clock
        fast.step()
        assert fast.loop.clock == clock + 1  # the schedule moves again
        while not fast.loop.pending:  # the next round: its weight counts the steps made while held
            fast.step()
        assert fast.loop.pending[0].weight == 2 * H * TOKENS_PER_STEP  # a round's H steps and H/P held
        advance(fast.loop, 0, {MODULE: [fast.loop.peer_id]}, drain=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("tau", "alpha"), [(0, 0.0), (TAU, 0.0)])
def test_blocking_or_alpha_zero_runs_wait_for_a_late_round_at_its_due_step(dht_factory, tau, alpha):
    """τ = 0 is DiLoCo by choice, and with α = 0 the merge would drop steps made while held: the due
    round is handed to `collect`, which waits for it."""
    with _pair(dht_factory, tau, alpha, seed=4) as (fast, slow):
        for _ in range(H + tau - 1):
            fast.step()
        fast.loop.tick(fast.tokens + TOKENS_PER_STEP, fast.holders)  # the due step, by hand: no collect yet
        due = fast.loop.due()
        assert len(due) == 1 and due[0].held_since is None and not due[0].finished()
        for _ in range(H + tau):
            slow.step()
        for mid, result in fast.loop.collect(due[0]).items():
            fast.loop.apply(due[0], mid, result)
        assert fast.ms.fragment_rounds == slow.ms.fragment_rounds == [1]
        assert torch.equal(fast.ms.global_flats[0], slow.ms.global_flats[0])


@pytest.mark.timeout(120)
def test_a_peer_that_moves_to_another_path_keeps_the_overlap_its_syncs_raised(dht_factory):
    """τ is measured on this machine and link, which a rotation does not change: the new path's
    outer loop starts from the τ the old one raised, not from the manifest's (which then had to be
    raised again over two late syncs after every move)."""
    sync = SyncConfig(inner_steps=H, overlap_steps=1, codec="fp32")
    manifest = RunManifest(name="t", model=CFG, seq_len=32, sync=sync, outer=OuterOptimizerConfig())
    dht, key = dht_factory()
    peer_id = str(dht.peer_id)
    metrics = PeerMetrics("t", peer_id, "0", "test")
    old = PathSync(manifest, PathModel(CFG, (0, 0), seed=1), peer_id, metrics)
    old.start(dht, lambda peer, module: True, key=key)
    try:
        old.outer.overlap.tau = 5  # raised by late syncs on the old path
        new = PathSync(manifest, PathModel(CFG, (0, 1), seed=1), peer_id, metrics, kept=old)
        new.start(dht, lambda peer, module: True, service=old.service, key=key)
        assert new.outer.overlap.tau == 5 and new.outer.overlap is old.outer.overlap
        fresh = PathSync(manifest, PathModel(CFG, (1, 1), seed=1), peer_id, metrics)
        fresh.start(dht, lambda peer, module: True, service=old.service, key=key)
        assert fresh.outer.overlap.tau == 1  # a peer's first path: the manifest's τ
    finally:
        old.shutdown()


@pytest.mark.timeout(120)
def test_a_tau_raised_earlier_comes_down_to_the_manifests_once_real_rounds_fit_in_a_step_less(dht_factory):
    """Each holder times its own rounds from their start to their end, and the loop hands that to its
    `OverlapTuner`: rounds between two holders on loopback, with steps of ~0.4 s, fit in one step, so
    a τ of 2 (raised by late syncs before) comes down to the manifest's 1 after two syncs that fit,
    and no lower."""
    with _pair(dht_factory, 1, 0.5, seed=7, h=4) as (a, b):  # P = 1: lowered after 2 syncs that fit
        for holder in (a, b):
            holder.loop.overlap.tau = 2
        taus = {id(a): [], id(b): []}
        for _ in range(4 * 4 + 2):  # four syncs of each holder, each due τ steps after its start
            for holder in (a, b):
                time.sleep(0.2)  # the step's compute: each holder's step time is both sleeps
                holder.step()
                taus[id(holder)].append(holder.loop.overlap.tau)
        assert a.ms.fragment_rounds == b.ms.fragment_rounds and a.ms.fragment_rounds[0] >= 3
        assert torch.equal(a.ms.global_flats[0], b.ms.global_flats[0])
        for holder in (a, b):
            assert min(taus[id(holder)]) == 1 and taus[id(holder)][0] == 2, taus[id(holder)]
        advance(a.loop, 0, {MODULE: [a.loop.peer_id]}, drain=True)
        advance(b.loop, 0, {MODULE: [b.loop.peer_id]}, drain=True)


@pytest.mark.timeout(120)
def test_a_round_sat_out_past_the_hold_is_split_off_and_the_schedule_goes_on_without_it(
    dht_factory, tmp_path
):
    """A restarted member sits out a round its earlier life sent (peer/sync/sitting_out.py) until its
    partner is past it: seconds, while the partner restarts too. Held with the rest of the fragment,
    it kept the member's other modules from sending their next parts, their members waited the
    straggler bound for it, and a partner waiting on those could not get past the round (the goodput
    churn arm's double kills: every peer 5–6 s, and a split trunk round). Past the hold the sit-out
    goes on by itself: the schedule moves, no round of that module starts until it ended, and it is
    applied as a late sync of the fragment, not a round of the peer's."""
    SentRounds(tmp_path, RUN_ID).record(MODULE, 0, 0)
    # the sit-out waits at most the averaging and report timeouts: longer than all the steps below
    # take on a loaded machine (at the default 12 s it once ended first in a full suite run)
    sent = {0: SentRounds(tmp_path, RUN_ID)}
    with _pair(dht_factory, TAU, 0.5, seed=6, sent=sent, averaging_timeout=60.0) as (restarted, partner):
        # the partner never trains: it answers it is starting, so the sit-out waits for it
        for _ in range(H + TAU + H):  # the round, its τ, and H/P held steps: the hold is over
            restarted.step()
        [sitting] = restarted.loop.pending
        assert sitting.detached and not sitting.finished() and list(sitting.futures) == [MODULE]
        assert restarted.loop.runner.sitting_out.after_restart((MODULE, 0, 0))
        clock = restarted.loop.clock
        for _ in range(H):  # the schedule goes on, and starts no round of the module sat out
            restarted.step()
        assert restarted.loop.clock == clock + H
        assert restarted.loop.pending == [sitting] and restarted.ms.fragment_rounds == [0]


@pytest.mark.timeout(60)
def test_only_rounds_an_earlier_life_sent_count_as_sat_out_after_a_restart(tmp_path):
    """Within one life a mover's download can set a module back to a round it sent: its partner trains
    on and waits for its next parts, which a split-off module would skip (the goodput rotation arm,
    session 51: its partner waited the straggler bound three rounds). Only rounds an earlier life
    sent go on by themselves."""
    SentRounds(tmp_path, RUN_ID).record(MODULE, 0, 3)  # an earlier life
    sent = SentRounds(tmp_path, RUN_ID)
    sent.record(MODULE, 0, 5)  # this one
    assert sent.sent_already(MODULE, 0, 5) and sent.sent_already(MODULE, 0, 3)
    assert sent.by_earlier_life(MODULE, 0, 3) and not sent.by_earlier_life(MODULE, 0, 4)
    assert not SentRounds(tmp_path, "another run").by_earlier_life(MODULE, 0, 0)
