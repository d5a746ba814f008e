"""Keepers and last holders under standing: a keeper takes a leaving holder's state only from a holder
of that module with standing, and a claim of a key without standing does not spare a module's last
admitted holder its hand-over."""

from __future__ import annotations

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from dht.identity import peer_id_of_key
from peer.codecs.formats import make_codec
from peer.config import InnerOptimizerConfig, RunManifest, SyncConfig
from peer.model.grid import ModelConfig
from peer.run.admission import AdmissionCheck, sign_admission
from peer.run.record import sign_manifest
from peer.swarm.claims import last_held, publish_claim
from peer.swarm.keeper import Keeper, state_numels
from peer.sync import wire
from peer.sync.inbox import Inbox
from peer.sync.service import SyncService
from peer.sync.standing import Standing
from peer.sync.state_transfer import StateHistory, digests_of, install_state_handlers
from peer.sync.wire import Kind

CFG = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64, n_levels=1, modules_per_level=1)
CREATOR = RSAPrivateKey()


def _standing(tokens: dict[str, str], run_id: str) -> Standing:
    return Standing(
        AdmissionCheck(run_id, CREATOR.get_public_key().to_bytes()), "open", lambda p: tokens.get(p, "")
    )


def test_a_sybils_claim_on_a_module_does_not_spare_its_last_admitted_holder_the_hand_over():
    run_id = "cd" * 32
    me, sybil, other = (peer_id_of_key(RSAPrivateKey()) for _ in range(3))
    tokens = {me: sign_admission(CREATOR, run_id, me, "invite")}
    holders = {"trunk": [me, sybil], "l0m0": [me, sybil]}
    assert last_held(["trunk", "l0m0"], holders, me, _standing(tokens, run_id)) == ["trunk", "l0m0"]
    # an admitted other holder does spare it
    tokens[other] = sign_admission(CREATOR, run_id, other, "invite")
    holders["trunk"].append(other)
    assert last_held(["trunk", "l0m0"], holders, me, _standing(tokens, run_id)) == ["l0m0"]


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_a_keeper_keeps_a_leaving_holders_state_only_from_a_holder_with_standing(dht_factory, tmp_path):
    manifest = RunManifest(
        name="keeps", model=CFG, seq_len=32, sync=SyncConfig(inner_steps=4), inner=InnerOptimizerConfig()
    )
    record = sign_manifest(manifest, CREATOR)
    dht, _ = dht_factory()
    keeper = Keeper(dht, CREATOR, manifest, record, tmp_path / "keep", interval_seconds=3600)
    services = []
    try:
        numels = state_numels(manifest, "trunk")
        gen = torch.Generator().manual_seed(0)
        honest = [torch.randn(n, generator=gen) for n in numels]
        poison = [torch.full((n,), 12345.0) for n in numels]

        nodes = {}

        def holder(tensors, admitted: bool, rounds: list[int]):
            node, key = dht_factory()
            peer = str(node.peer_id)
            token = sign_admission(CREATOR, record.run_id, peer, "invite") if admitted else ""
            claim_modules = ["trunk", "l0m0"]
            from dht.schema import ClaimRecord

            claim = ClaimRecord(
                peer_id=peer, path=0, modules=claim_modules, admission=token,
                module_rounds={"trunk": rounds, "l0m0": rounds},
            )  # fmt: skip
            assert publish_claim(node, key, manifest.name, record.run_id, claim)
            nodes[peer] = (node, key, claim)
            inbox = Inbox({}, make_codec("fp32"), lambda p, m: False, 1, 0.0)
            service = SyncService(node, record.run_id, inbox, 30, key=key)
            history = StateHistory()
            history.record("trunk", rounds, digests_of(tensors))
            install_state_handlers(service, lambda m: (rounds, tensors) if m == "trunk" else None, history)
            services.append(service)
            return service

        admitted = holder(honest, True, [5])
        poisoner = holder(poison, False, [10**6])
        # even a stranger serving the very state the admitted holder has: not its to hand over
        copycat = holder(honest, False, [5])

        def keep(service) -> bool:
            request = wire.Keep(run=service.run, module="trunk")
            return service.call(
                service.request(str(dht.peer_id), [wire.pack_header(Kind.KEEP, request)], 60), 70
            ).ok

        for stranger in (poisoner, copycat):  # keys without standing where the module has an admitted holder
            assert not keep(stranger)
        assert "trunk" not in keeper.states
        # the module's only holder with standing: kept unconfirmed (asked twice: a transfer can fail on a
        # loaded machine, and the keeper then says "not kept"; a refusal would repeat)
        assert keep(admitted) or keep(admitted)
        rounds, kept = keeper.states["trunk"]
        assert rounds == [5] and all(torch.equal(a, b) for a, b in zip(kept, honest, strict=True))
        # the admitted holder leaves: the strangers outlasting it gain nothing by it
        node, key, claim = nodes[admitted.peer_id]
        assert publish_claim(
            node, key, manifest.name, record.run_id, claim.model_copy(update={"leaving": True})
        )
        keeper._read_claims()
        assert admitted.peer_id not in keeper.claims
        assert not keep(poisoner)
        keeper.refresh()  # the poisoner claims rounds a million ahead of what is kept
        assert keeper.states["trunk"][0] == [5]
    finally:
        for s in services:
            s.shutdown()
        keeper.shutdown()
