"""Rotation in a live swarm: three peers on a 2x2 grid rotate so that all four paths get trained."""

from __future__ import annotations

import json
import re

import pytest
import torch

from peer.cli.local_swarm import LocalSwarm
from peer.cli.main import main as pathswarm
from peer.model.grid import path_module_ids
from peer.run.record import load_verified_manifest
from tests.swarm_harness import (
    checkpoints_by_count,
    final_state,
    logs_of,
    module_state,
    outcomes,
    peer_args,
    write_manifest,
)

pytestmark = pytest.mark.swarm

ROUNDS = 9
ROTATE_EVERY = 3


@pytest.mark.timeout(150)
def test_three_peers_rotate_until_every_path_is_trained(tmp_path):
    path, run_id = write_manifest(tmp_path, inner_steps=10)
    names = ["a", "b", "c"]
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(path)])
        for name in names:
            # unpaced, as this test was written: paced at 20 steps/s (0.5 s a round, one heartbeat), the
            # composite came out 1.2-2.3x the dense perplexity in 3 of 5 runs (movers' modules "behind",
            # holders "alone" for rounds after a move): a goodput lead for rotation (issue 29), not
            # hidden here — this test checks that rotation covers every path and keeps holders in step
            args = peer_args(run_id, tmp_path / name, "--max_rounds", str(ROUNDS), "--wait_for_peers", "3",
                             "--rotate_every_rounds", str(ROTATE_EVERY), "--heartbeat_seconds", "0.5",
                             "--keep_checkpoints", "100", "--max_inner_steps_per_second", "1e9")  # fmt: skip
            swarm.start_peer(name, args)
        for name in names:
            assert swarm.wait(name, timeout=120) == 0, logs_of(swarm, name)
        logs = {name: swarm.log_path(name).read_text() for name in names}

    moves = re.compile(r"rotating from path (\d+) to path (\d+) \(path steps")
    rotations = {name: moves.findall(log) for name, log in logs.items()}
    manifest, _ = load_verified_manifest(path)
    cfg = manifest.model
    finals = {name: final_state(tmp_path / name) for name in names}

    # every path was trained, by the peers' own count (checkpoint meta) and by `pathswarm eval`'s
    per_path: dict[int, int] = {}
    for name, (_, meta) in finals.items():
        assert sum(meta["path_steps"].values()) == meta["step"], (name, meta["path_steps"], meta["step"])
        for p, n in meta["path_steps"].items():
            per_path[int(p)] = per_path.get(int(p), 0) + n
    assert sorted(p for p, n in per_path.items() if n > 0) == list(range(cfg.n_paths)), (per_path, rotations)
    assert any(rotations.values()), logs_of_text(logs)
    out = tmp_path / "eval.json"
    argv = ["eval", "--manifest_path", str(path), "--checkpoints", *(str(tmp_path / n) for n in names)]
    # against a dense model of one path's size trained for as many steps as each peer took
    assert pathswarm([*argv, "--baseline_steps", str(ROUNDS * 10), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    evaluated = report["composite"]["per_path"]
    assert {int(p): e["steps"] for p, e in evaluated.items()} == per_path
    assert all(0 < e["share"] < 1 for e in evaluated.values()), evaluated
    # Eval assembled trained modules: the composite is far below an untrained byte model's perplexity
    # (about the vocabulary's size). Whether it also beats a dense model of one path's size at equal
    # steps depends on the order in which peers rotate, which load changes: in one CI run (session 18)
    # path (0, 0) scored 162 per byte while the other three scored 32-35, so the composite was 47
    # against the dense model's 38 — each of its two modules had trained beside its other partner
    # while no holder averaged it with this one (3 peers on 4 paths: one path is uncovered at any
    # time). That is a quality and goodput lead for issue 29, measured by benchmarks.swarm_quality;
    # this test holds what rotation itself promises: coverage, and holders in step (below).
    histories = {name: outcomes(meta)[-ROUNDS:] for name, (_, meta) in finals.items()}
    assert report["composite"]["ppl"] < cfg.vocab_size / 2, (report["composite"], report["dense"], histories)

    # holders stay in step after a move: the last round averaged the trunk with every peer, and
    # each module's holders hold the same bits at the last sync count they both reached
    holders: dict[str, list[str]] = {}
    for name, (_, meta) in finals.items():
        assert outcomes(meta)[-1]["trunk"] == "averaged/3", (name, outcomes(meta)[-3:])
        for mid in path_module_ids(cfg, tuple(meta["path"])):
            holders.setdefault(mid, []).append(name)
    for mid, names_holding in holders.items():
        first, *others = names_holding
        for other in others:
            mine = checkpoints_by_count(tmp_path / first, mid)
            theirs = checkpoints_by_count(tmp_path / other, mid)
            count = max(set(mine) & set(theirs))
            assert count >= ROUNDS - 1, (first, other, mid, sorted(mine), sorted(theirs))
            a, b = module_state(mine[count], mid), module_state(theirs[count], mid)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (first, other, mid)


def logs_of_text(logs: dict[str, str]) -> str:
    return "\n".join(f"--- {n}\n{log[-3000:]}" for n, log in logs.items())
