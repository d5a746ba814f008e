"""A live swarm re-plans online: real peers, a probe file changed while they train."""

from __future__ import annotations

import json
import re
import subprocess
import time
from datetime import datetime

import pytest
from hivemind.p2p import P2P, PeerID

from peer.cli.local_swarm import LocalSwarm
from peer.config.manifest import SchedulerConfig
from tests.swarm_harness import RUN, wait_for, write_manifest

pytestmark = pytest.mark.swarm

TRAINING = re.compile(r"training path (\d+) ")
ROUND = re.compile(r"round (\d+) step")
#: a mover's decision, whatever change it was the first look at: the new measurement, a claim that
#: changed after it, or (on a loaded machine, a peer's first views came late) the start
DECISION = re.compile(r"^(\S+ \S+) INFO .*online re-plan \(\w+, round \d+\): move", re.M)
FAST, SLOW = [0.001, 1e9], [0.2, 2e5]
#: from the probe file's change to a mover's decision, on a loaded 2-core machine
REACTION_SECONDS = 10.0


@pytest.mark.timeout(150)
def test_peers_whose_group_link_slows_down_mid_run_are_moved_by_the_online_planner(tmp_path):
    manifest_file, run_id = write_manifest(
        tmp_path, inner_steps=4, grid=(1, 2), averaging_timeout_seconds=15.0,
        scheduler=SchedulerConfig(replan_online=True, probe_every_seconds=1.0),
    )  # fmt: skip
    ids = []
    for i in range(4):
        P2P.generate_identity(str(tmp_path / f"id{i}"))
        ids.append(PeerID.from_identity((tmp_path / f"id{i}").read_bytes()).to_base58())
    probe_file = tmp_path / "probes.json"

    def write_probes(region: dict[str, int]) -> None:
        links = {a: {b: FAST if region[a] == region[b] else SLOW for b in ids if b != a} for a in ids}
        tmp = tmp_path / "probes.tmp"  # replaced at once: a peer never reads half a file
        tmp.write_text(json.dumps({"tokens_per_second": dict.fromkeys(ids, 1e5), "links": links}))
        tmp.replace(probe_file)

    write_probes(dict.fromkeys(ids, 0))  # one region: every placement is as good as another
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(manifest_file)])
        # rounds of 4 tiny steps take ~0.25 s: 60 of them outlast the slowest peer's reaction (a probe
        # cycle, a heartbeat, a settled view) on a loaded machine; 14 did not, once a peer settled
        for i in range(4):
            swarm.start_peer(
                f"p{i}",
                ["--run", f"{RUN}@{run_id[:16]}", "--identity_path", str(tmp_path / f"id{i}"),
                 "--probe_file", str(probe_file), "--max_rounds", "60", "--batch_size", "2",
                 "--torch_threads", "1", "--heartbeat_seconds", "1", "--wait_for_peers", "4",
                 "--checkpoint_every_rounds", "1000"],
            )  # fmt: skip

        def log(i: int) -> str:
            return swarm.log_path(f"p{i}").read_text()

        def rounds(i: int) -> list[int]:
            return [int(r) for r in ROUND.findall(log(i))]

        wait_for(lambda: all(len(rounds(i)) >= 2 for i in range(4)), 90, "two rounds on every peer", swarm)
        start = {ids[i]: int(TRAINING.findall(log(i))[-1]) for i in range(4)}
        # each path's group now spans both regions: the region boundary slows every group down
        by_path: dict[int, list[str]] = {}
        for pid, k in sorted(start.items(), key=lambda kv: ids.index(kv[0])):
            by_path.setdefault(k, []).append(pid)
        assert sorted(len(g) for g in by_path.values()) == [2, 2], start
        region = {g[j]: j for g in by_path.values() for j in range(2)}
        write_probes(region)
        changed_at = time.time()
        for i in range(4):
            try:
                code = swarm.wait(f"p{i}", timeout=120)
            except subprocess.TimeoutExpired:
                code = None  # a stall: every peer's log tail says where
            assert code == 0, f"p{i} exited {code}\n" + "\n".join(
                f"--- p{j}\n{log(j)[-2500:]}" for j in range(4)
            )
        logs = [log(i) for i in range(4)]

    final = {ids[i]: int(TRAINING.findall(logs[i])[-1]) for i in range(4)}
    movers = [i for i in range(4) if "rotating from path" in logs[i]]
    assert len(movers) == 2, (start, final, [re.findall(r"online re-plan.*", lg) for lg in logs])
    # one region per path now: the averaging groups no longer cross the slow link
    assert len({final[p] for p in ids if region[p] == 0}) == 1
    assert len({final[p] for p in ids if region[p] == 1}) == 1
    for i in movers:
        decision = DECISION.search(logs[i])
        assert decision, logs[i][-3000:]
        # soon after the slow-down: a probe cycle (1 s) and a heartbeat (1 s) carry it to the planner,
        # which looks at the next round's end. Counted in seconds, not rounds: these rounds of 4 tiny
        # steps are shorter than a probe cycle, and more of them pass on a faster machine.
        decided_at = datetime.strptime(decision.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        assert decided_at - changed_at <= REACTION_SECONDS, (decided_at - changed_at, logs[i][-3000:])
