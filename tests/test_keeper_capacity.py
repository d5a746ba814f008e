"""A keeper keeps no more module states than its one stash record can announce: a state kept but not
announced is served to nobody, and a record past the schema's or the nodes' caps is stored nowhere,
which would hide every module the keeper keeps."""

from __future__ import annotations

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from dht.keys import RECORD_LIMITS
from dht.schema import MAX_STASH_MODULES
from peer.checkpoint import save_checkpoint
from peer.config import InnerOptimizerConfig, RunManifest, SyncConfig
from peer.model.grid import ModelConfig, all_module_ids
from peer.run.record import sign_manifest
from peer.swarm.keeper import Keeper, kept_modules, state_numels

#: 32**2 paths, each with a private module: 1,089 modules, more than one stash record names
CFG = ModelConfig(
    d_model=8, n_heads=1, d_ff=8, max_seq_len=16, n_levels=2, modules_per_level=32, private_blocks_per_path=1
)
CREATOR = RSAPrivateKey()


@pytest.mark.swarm
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "fragments, rounds, saved",
    [(1, 7, 600), (64, 10**10, 500)],  # past the record's module count; past its bytes first
    ids=["modules", "bytes"],
)
def test_a_resumed_keeper_keeps_what_its_stash_record_can_announce_and_announces_all_of_it(
    dht_factory, tmp_path, caplog, fragments, rounds, saved
):
    manifest = RunManifest(
        name="full", model=CFG, seq_len=8, sync=SyncConfig(inner_steps=64, fragments=fragments),
        inner=InnerOptimizerConfig(),
    )  # fmt: skip
    record = sign_manifest(manifest, CREATOR)
    directory = tmp_path / "keep"
    for mid in all_module_ids(CFG)[:saved]:  # what a keeper of an earlier start saved
        tensors = {f"t{i}": torch.zeros(n) for i, n in enumerate(state_numels(manifest, mid))}
        meta = dict(
            step=rounds * fragments, run_id=record.run_id, module=mid, fragment_rounds=[rounds] * fragments
        )
        save_checkpoint(directory / mid, tensors, meta, keep=1)
    dht, key = dht_factory()
    dht_factory()  # a second node: a record is stored on the nodes nearest its key, never ours alone
    with caplog.at_level("WARNING", logger="peer.swarm.keeper"):
        keeper = Keeper(dht, key, manifest, record, directory, interval_seconds=3600)
    try:
        kept = set(keeper.states)
        assert 0 < len(kept) <= MAX_STASH_MODULES and len(kept) < saved
        stash = keeper.stash_record()  # what a node of the run stores: within its bytes for a stash
        assert len(MSGPackSerializer.dumps(stash.model_dump())) < RECORD_LIMITS["stash"][1]
        assert keeper.publish()
        assert set(kept_modules(dht, manifest.name, record.run_id)) - {""} == kept  # every kept state found
        assert "keeper: full at" in caplog.text and "run another keeper" in caplog.text  # and it says so
    finally:
        keeper.shutdown()
