"""A peer told to leave (SIGTERM) while one of its rounds waits for a member that is gone leaves
within a few seconds: the round is given up, not applied, and the peer keeps the state it had before
it (its sent-rounds record takes the holders' state when it comes back). Before, the wait ran for the
whole averaging timeout (`tests/test_readme.py`'s swarm: a SIGTERM held 64 s). Real members on real
DHT nodes here."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from monitoring.metrics import PeerMetrics
from peer.config import OuterOptimizerConfig, RunManifest, SyncConfig
from peer.model.grid import ModelConfig
from peer.model.transformer import PathModel
from peer.sync.module_sync import ModuleSync
from peer.sync.outer import LEAVING_WAIT_SECONDS, STOPPED, StreamingOuter
from tests.sync_members import MODULE, sync_group

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

CFG = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=33, blocks_per_module=4)
H = 4
#: far longer than the test may take: only leaving can end the wait
TIMEOUT_SECONDS = 60.0


def test_a_peer_told_to_leave_gives_up_a_round_waiting_for_a_gone_member_and_keeps_its_state(dht_factory):
    outer = OuterOptimizerConfig(lr=0.7, momentum=0.0, nesterov=False)
    sync = SyncConfig(inner_steps=H, averaging_timeout_seconds=TIMEOUT_SECONDS, aggregator="mean")
    manifest = RunManifest(name="t", model=CFG, seq_len=32, sync=sync, outer=outer)
    model = PathModel(CFG, (0, 0), seed=3)
    ms = ModuleSync(CFG, MODULE, model.parts[MODULE], outer, 1)
    with sync_group(dht_factory, 2, ms.fragment_size(0), averaging_timeout=TIMEOUT_SECONDS) as members:
        me, gone = members  # `gone` holds the module in every view and never sends its part
        holders = {MODULE: [m.peer_id for m in members]}
        metrics = PeerMetrics("t", me.peer_id, "0", "t")
        loop = StreamingOuter({MODULE: ms}, manifest, me.peer_id, metrics, me.runner)
        loop.joining = False
        with torch.no_grad():  # what training did to the local copy since the round began
            for p in model.parts[MODULE].parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 1e-3)
        before = ms.global_flats[0].clone()
        for _ in range(H):
            loop.tick(0, holders)
        (pending,) = loop.due()  # τ = 0: the round is collected at its due step
        timer = threading.Timer(1.0, me.service.leaving.set)  # SIGTERM, as `Peer.request_stop` passes it on
        timer.start()
        started = time.monotonic()
        result = loop.collect(pending)[MODULE]
        took = time.monotonic() - started
        timer.join()
        loop.apply(pending, MODULE, result)
    assert result.outcome == STOPPED, (result.outcome, result.detail)
    assert took < 1.0 + LEAVING_WAIT_SECONDS + 2.0, f"the round held a leaving peer {took:.1f} s"
    assert torch.equal(ms.global_flats[0], before) and ms.fragment_rounds == [0]  # not applied alone
