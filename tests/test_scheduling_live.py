"""A live swarm follows the plan: injected link profiles put two "regions" on loopback; peers must
claim the planned paths and average the shared trunk in the planned rotating subgroups."""

from __future__ import annotations

import json

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPrivateKey

from dht.schema import ClaimRecord, ProbeRecord
from peer.checkpoint import load_latest_checkpoint
from peer.cli.local_swarm import LocalSwarm
from peer.config import InnerOptimizerConfig, SyncConfig
from peer.data.sources import DatasetSpec
from peer.model.grid import TRUNK, ModelConfig
from peer.run.create import build_manifest
from peer.run.record import save_record, sign_manifest
from peer.swarm.planning import build_snapshot, my_averaging_group, path_parameters, planned_path

pytestmark = pytest.mark.swarm

RUN = "plantest"


@pytest.mark.timeout(420)
def test_peers_claim_planned_paths_and_form_planned_groups(tmp_path):
    manifest = build_manifest(
        RUN,
        ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64, n_levels=1, modules_per_level=2),
        DatasetSpec(kind="builtin", builtin_docs=300),
        seq_len=32,
        inner=InnerOptimizerConfig(lr=2e-3, warmup_steps=2, total_steps=100),
        # H = 24, not 8: a peer whose first step comes late under load (a full suite's) still makes round 1,
        # which a partner otherwise runs without it ("starting: not training yet") and the check below fails
        sync=SyncConfig(inner_steps=24, averaging_timeout_seconds=20.0, max_group_size=2),
        router_docs=150,
    )
    record = sign_manifest(manifest, RSAPrivateKey())
    manifest_file = tmp_path / "manifest.json"
    save_record(record, manifest_file)

    ids = []
    for i in range(4):
        P2P.generate_identity(str(tmp_path / f"id{i}"))
        ids.append(PeerID.from_identity((tmp_path / f"id{i}").read_bytes()).to_base58())
    region = {ids[0]: 0, ids[1]: 1, ids[2]: 0, ids[3]: 1}  # interleaved, so id order does not help
    links = {
        a: {b: ([0.001, 1e9] if region[a] == region[b] else [0.1, 1e6]) for b in ids if b != a} for a in ids
    }
    probe_file = tmp_path / "probes.json"
    probe_file.write_text(json.dumps({"tokens_per_second": {p: 1000.0 for p in ids}, "links": links}))

    rounds = 3
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(manifest_file)])
        for i in range(4):
            swarm.start_peer(
                f"p{i}",
                ["--run", f"{RUN}@{record.run_id[:16]}", "--identity_path", str(tmp_path / f"id{i}"),
                 "--probe_file", str(probe_file), "--max_rounds", str(rounds), "--batch_size", "4",
                 "--torch_threads", "1", "--heartbeat_seconds", "1", "--wait_for_peers", "4",
                 # round 1 lasts 1.6 s, not 0.6: a peer whose first step came 0.7 s after its
                 # partner's (a full suite's load, once) still makes it; H = 24 alone did not hold
                 "--max_inner_steps_per_second", "15",
                 "--checkpoint_dir", str(tmp_path / f"c{i}"), "--keep_checkpoints", "10"],
            )  # fmt: skip
        for i in range(4):
            assert swarm.wait(f"p{i}", timeout=240) == 0, swarm.log_path(f"p{i}").read_text()[-3000:]

    metas = {ids[i]: load_latest_checkpoint(tmp_path / f"c{i}")[1] for i in range(4)}
    paths = {pid: meta["path"][0] for pid, meta in metas.items()}
    # the plan: one region per path (fast links inside each averaging group)
    assert (
        paths[ids[0]] == paths[ids[2]] and paths[ids[1]] == paths[ids[3]] and paths[ids[0]] != paths[ids[1]]
    )

    # recompute the plan and the groups from the same records the peers saw
    claims = {pid: ClaimRecord(peer_id=pid, path=k, modules=[TRUNK]) for pid, k in paths.items()}
    data = json.loads(probe_file.read_text())
    probes = {
        pid: ProbeRecord(
            peer_id=pid, tokens_per_second=1000.0, memory_bytes=1 << 34, links=data["links"][pid]
        )
        for pid in ids
    }
    snapshot = build_snapshot(manifest, probes, claims, path_parameters(manifest), batch_size=4)
    assert planned_path(manifest, snapshot, claims, ids[0], 0, joining=False) == paths[ids[0]]
    for pid, meta in metas.items():
        first, second = meta["history"][0], meta["history"][1]
        # Round 1: the planned subgroup exactly (inside the region, the fast links).
        expected = my_averaging_group(manifest, snapshot, claims, pid, TRUNK, first["round"] - 1)
        assert expected is not None
        assert first["groups"][TRUNK] == expected[1], (pid, first["round"], first["groups"])
        assert {region[p] for p in first["groups"][TRUNK]} == {region[pid]}
        # Round 2: the rotation bridges the regions. Which cross pairing the planner picks depends on
        # every peer's view of the records at that moment; views that lag a heartbeat can pair
        # differently (noted on issue 5), so only the bridging itself is asserted here.
        partners = set(second["groups"][TRUNK]) - {pid}
        assert len(partners) == 1 and region[partners.pop()] != region[pid], (pid, second["groups"])


@pytest.mark.timeout(60)
def test_link_probes_between_real_peers_measure_latency_and_bandwidth_and_stop_at_once(dht_factory):
    import asyncio
    import time

    from peer.swarm.probes import ProbeService

    (a, _), (b, _) = dht_factory(), dht_factory()
    probes = [ProbeService(a), ProbeService(b)]
    try:
        links = probes[0].measure_links(
            [str(b.peer_id), "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"], timeout=5
        )
        assert list(links) == [str(b.peer_id)]  # the unknown peer is skipped, not raised
        latency, bandwidth = links[str(b.peer_id)]
        assert 0 < latency < 1 and bandwidth > 1e6  # loopback: well under a second, over 1 MB/s
    finally:
        # a peer's sync service shuts the DHT's cached P2P replica down before the probes stop
        async def close_cached(dht):
            await (await dht.replicate_p2p()).shutdown()

        for dht in (a, b):
            asyncio.run(close_cached(dht))
        started = time.monotonic()
        for p in probes:
            p.shutdown()
        assert time.monotonic() - started < 2  # no cleanup waits out its timeout
