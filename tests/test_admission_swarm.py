"""Admission between real processes: the creator's bootstrap node admits volunteers by invite code
(and nobody else, in an invite run) or after their probation (in an open run), and a peer keeps its
token across restarts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dht.identity import load_identity
from peer.cli.local_swarm import LocalSwarm
from peer.config import AdmissionConfig
from peer.run.admission import read_admission
from peer.run.record import load_record
from peer.swarm.admission import TOKEN_FILE
from tests.swarm_harness import final_state, peer_args, wait_for, write_manifest

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


def _creator(tmp_path):
    identity = tmp_path / "creator.id"
    key, _ = load_identity(identity)
    return key, identity


def _invites(manifest_path, count: int) -> list[str]:
    command = ["run", "invite", "--manifest_path", str(manifest_path), "--count", str(count)]
    out = subprocess.run(
        [sys.executable, "-m", "peer", *command], check=True, capture_output=True, text=True, timeout=120
    )
    return out.stdout.split()[:count]


def test_an_invite_run_admits_the_holders_of_codes_and_no_one_else(tmp_path):
    key, identity = _creator(tmp_path)
    manifest_path, run_id = write_manifest(
        tmp_path, inner_steps=5, grid=(1, 1), creator=key, admission=AdmissionConfig(mode="invite")
    )
    codes = _invites(manifest_path, 2)
    record = load_record(manifest_path)
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(manifest_path), "--identity_path", str(identity)])
        # no code: it stops at once and says how to get in
        swarm.start_peer("stranger", peer_args(run_id, tmp_path / "stranger", "--max_rounds", "1"))
        assert swarm.wait("stranger", timeout=120) == 2
        assert "admits invited keys only" in swarm.log_path("stranger").read_text()
        for name, code in zip(("a", "b"), codes, strict=True):
            extra = ["--invite", code, "--max_rounds", "3", "--wait_for_peers", "2"]
            extra += ["--identity_path", str(tmp_path / f"{name}.id")]
            swarm.start_peer(name, peer_args(run_id, tmp_path / name, *extra))
        # a code someone already redeemed is refused to another key
        wait_for(lambda: (tmp_path / "a" / TOKEN_FILE).is_file(), 120, "a's admission", swarm)
        swarm.start_peer("thief", peer_args(run_id, tmp_path / "thief", "--invite", codes[0]))
        assert swarm.wait("thief", timeout=120) == 2
        assert "redeemed by another key" in swarm.log_path("thief").read_text()
        assert swarm.wait("a", timeout=200) == 0 and swarm.wait("b", timeout=60) == 0
        # a restart needs no code: the token kept beside the checkpoints admits it again
        again = ["--resume", "--max_steps", "1", "--identity_path", str(tmp_path / "a.id")]
        swarm.start_peer("a2", peer_args(run_id, tmp_path / "a", *again))
        assert swarm.wait("a2", timeout=120) == 0, swarm.log_path("a2").read_text()[-2000:]
    for name in ("a", "b"):
        token = (tmp_path / name / TOKEN_FILE).read_text()
        _, meta = final_state(tmp_path / name)
        assert read_admission(token, run_id, record.creator_public_key).peer_id == meta["peer_id"]
        outcomes = [o for entry in meta["history"] for o in entry["outcomes"].values()]
        assert "averaged/2" in outcomes  # the two admitted volunteers averaged together


def test_an_open_runs_authority_admits_peers_after_their_probation(tmp_path):
    key, identity = _creator(tmp_path)
    manifest_path, run_id = write_manifest(
        tmp_path, inner_steps=5, grid=(1, 1), creator=key, admission=AdmissionConfig(probation_rounds=2)
    )
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(manifest_path), "--identity_path", str(identity)])
        for name in ("a", "b", "c"):
            swarm.start_peer(
                # long enough to be admitted whatever the machine's speed: the swarm stops them after
                name,
                peer_args(run_id, tmp_path / name, "--max_rounds", "400", "--wait_for_peers", "3"),
            )
        admitted = lambda: all((tmp_path / n / TOKEN_FILE).is_file() for n in ("a", "b", "c"))  # noqa: E731
        wait_for(admitted, 240, "every peer admitted after its probation", swarm)
        for name in ("a", "b", "c"):
            assert "admitted to the run after probation" in swarm.log_path(name).read_text()
    log = swarm.log_path("bootstrap").read_text()
    assert log.count("(probation)") >= 3
