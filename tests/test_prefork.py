"""Processes forked from the prefork template behave like started ones: their own exit status, log,
folder and environment; they leave when done (thread pools and all) and signals reach them; and a
setting only an exec can apply (LD_PRELOAD) gets a fresh process; and a fork killed while it holds
one of hivemind's cross-process locks does not freeze the other forks."""

from __future__ import annotations

import os
import signal
import time

import pytest

from peer.cli.local_swarm import LocalSwarm
from peer.cli.prefork import ForkedProcess
from tests.swarm_harness import peer_args, wait_for, write_manifest

pytestmark = pytest.mark.swarm


@pytest.mark.timeout(120)
def test_a_forked_command_has_its_own_exit_status_log_folder_and_environment(tmp_path, monkeypatch):
    folder = tmp_path / "here"
    folder.mkdir()
    with LocalSwarm(tmp_path / "logs") as swarm:
        bad = swarm.spawn("bad", ["peer", "--run", "r"], env={"PATHSWARM_BATCH_SIZE": "0"})
        monkeypatch.chdir(folder)  # after the template started: the fork must not run where it is
        made = swarm.spawn("made", ["run", "create", "--name", "r", "--out", "m.json", "--no_publish"])
        assert isinstance(bad, ForkedProcess) and isinstance(made, ForkedProcess)
        assert swarm.wait("bad", 60) == 2
        assert swarm.wait("made", 60) == 0, swarm.log_path("made").read_text()[-2000:]
    bad_log = swarm.log_path("bad").read_text()
    assert "pathswarm peer: error: invalid peer configuration: batch_size" in bad_log, bad_log
    assert (folder / "m.json").exists()  # written where the parent was, as a started process would
    assert "manifest written to m.json" in swarm.log_path("made").read_text()


@pytest.mark.timeout(150)
def test_a_forked_peer_leaves_when_done_and_on_sigterm_and_dies_on_sigkill(tmp_path):
    path, run_id = write_manifest(tmp_path)
    alone = ["peer", "--new_swarm", "--manifest_path", str(path), "--host_maddrs", "/ip4/127.0.0.1/tcp/0"]
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.spawn("done", [*alone, *peer_args(run_id, tmp_path / "done", "--max_rounds", "1")])
        swarm.spawn("term", [*alone, *peer_args(run_id, tmp_path / "term")])
        swarm.spawn("kill", [*alone, *peer_args(run_id, tmp_path / "kill")])
        # its sync thread pool ends on the way out, as in an interpreter that exits: no hang
        assert swarm.wait("done", 90) == 0, swarm.log_path("done").read_text()[-2000:]
        for name in ("term", "kill"):
            log = swarm.log_path(name)
            wait_for(lambda log=log: "round 1 step" in log.read_text(), 60, f"{name}'s round", swarm)
        swarm.kill("term", signal.SIGTERM)
        swarm.kill("kill", signal.SIGKILL)
        assert swarm.wait("term", 60) == 0
        assert swarm.wait("kill", 30) == -signal.SIGKILL
    assert "received signal 15" in swarm.log_path("term").read_text()


@pytest.mark.timeout(60)
def test_a_process_that_needs_ld_preload_is_started_not_forked(tmp_path):
    with LocalSwarm(tmp_path / "logs") as swarm:
        proc = swarm.spawn("p", ["--help"], env={"LD_PRELOAD": ""})
        assert not isinstance(proc, ForkedProcess)
        swarm.wait("p", 50)


@pytest.mark.timeout(60)
def test_a_fork_killed_while_holding_hiveminds_lock_does_not_block_the_other_forks():
    """hivemind makes its cross-process locks at import, so forks of a process that imported it (the
    template) would share them: a peer SIGKILLed while its DHT process held MPFuture's update lock
    froze every other peer of a churn run at its next DHT call. Each fork takes its own, as
    `_child` does first thing; here two forks of this process (which imported hivemind too)."""
    from hivemind.utils.mpfuture import MPFuture

    from peer.cli.prefork_template import forget_inherited_locks

    ready_r, ready_w = os.pipe()
    holder = os.fork()
    if holder == 0:
        forget_inherited_locks()
        MPFuture._update_lock.acquire()
        os.write(ready_w, b"x")
        time.sleep(60)
        os._exit(0)
    assert os.read(ready_r, 1) == b"x"
    os.kill(holder, signal.SIGKILL)  # dies holding the lock
    os.waitpid(holder, 0)
    other = os.fork()
    if other == 0:
        forget_inherited_locks()
        os._exit(0 if MPFuture._update_lock.acquire(timeout=5) else 1)
    _, status = os.waitpid(other, 0)
    os.close(ready_r)
    os.close(ready_w)
    assert os.waitstatus_to_exitcode(status) == 0, "the other fork waited on a lock a dead fork held"
