"""Joins that explain themselves: every start-up failure a volunteer can hit is one line that says what
to do, exit status 2, no traceback. Real processes, a real DHT, real sockets."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from peer.cli.local_swarm import LocalSwarm
from peer.config import RunManifest
from peer.errors import ConfigError
from peer.run.memory import check_path_fits, estimate_path_memory
from peer.run.record import load_verified_manifest
from tests.swarm_harness import RUN, write_manifest

pytestmark = pytest.mark.swarm

# A well-formed peer id nobody uses.
NOBODY = "12D3KooWHfCtvv1gqbmabwi5t3oxoBJbyV2qjrUqV8SjegRnavq2"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


@pytest.fixture(scope="module")
def manifest_file(tmp_path_factory) -> tuple[Path, str]:
    return write_manifest(tmp_path_factory.mktemp("run"))


def run_peer(*args: str, timeout: float = 90) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "peer", *args], capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stderr, time.monotonic() - started


def the_error(code: int, stderr: str) -> str:
    """The one error line of a failed start, after checking the form every such failure must have."""
    assert code == 2, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("pathswarm ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(60)
def test_no_initial_peer_answered_lists_addresses_and_closed_port():
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{NOBODY}"
    line = the_error(*run_peer("peer", "--run", RUN, "--initial_peers", dead, "--host_maddrs", LOOPBACK)[:2])
    assert "no initial peer answered" in line and dead in line, line
    assert "refused" in line and "port is open" in line, line


@pytest.mark.timeout(60)
def test_no_initial_peer_answered_says_when_port_is_open_but_peer_id_is_wrong():
    with socket.socket() as listener:  # something listens, but it is no libp2p peer with that id
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        addr = f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}/p2p/{NOBODY}"
        code, stderr, _ = run_peer("peer", "--run", RUN, "--initial_peers", addr, "--host_maddrs", LOOPBACK)
    line = the_error(code, stderr)
    assert "no initial peer answered" in line and addr in line and "is open" in line, line


@pytest.mark.timeout(60)
def test_daemon_that_cannot_listen_says_which_port_and_why():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, stderr, _ = run_peer("bootstrap", "--host_maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    line = the_error(code, stderr)
    assert "p2p daemon did not start" in line and f"127.0.0.1:{port}" in line, line
    assert "address already in use" in line and "--host_maddrs" in line, line


@pytest.mark.timeout(120)
def test_identity_in_use_by_a_running_peer(tmp_path):
    identity = tmp_path / "shared.id"
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--identity_path", str(identity)])
        code, stderr, _ = run_peer(
            "peer", "--run", RUN, "--initial_peers", *swarm.initial_peers,
            "--host_maddrs", LOOPBACK, "--identity_path", str(identity),
        )  # fmt: skip
    line = the_error(code, stderr)
    assert "already in use by a running peer" in line and str(identity) in line, line
    assert "--identity_path" in line, line


@pytest.mark.timeout(120)
def test_run_name_not_found_and_pin_mismatch(tmp_path, manifest_file):
    path, run_id = manifest_file
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(path)])
        base = ["peer", "--initial_peers", *swarm.initial_peers, "--host_maddrs", LOOPBACK]
        wrong_pin = "0" * 16 if not run_id.startswith("0" * 16) else "1" * 16
        # both wait out the manifest lookup's timeout: side by side, not one after the other
        with ThreadPoolExecutor(2) as pool:
            results = pool.map(lambda run: run_peer(*base, "--run", run), ["nosuchrun", f"{RUN}@{wrong_pin}"])
            missing, mismatch = (the_error(*r[:2]) for r in list(results))
    assert "no verified manifest for run 'nosuchrun'" in missing and "--run name" in missing, missing
    assert wrong_pin in mismatch and run_id[:16] in mismatch, mismatch
    assert "different hash is a different run" in mismatch, mismatch


@pytest.mark.timeout(90)
def test_path_that_does_not_fit_in_memory_names_a_batch_size_that_does(tmp_path, manifest_file):
    path, _ = manifest_file
    manifest, _ = load_verified_manifest(path)
    estimate = estimate_path_memory(manifest)
    # room for batch 3 but not for the asked 16
    budget = estimate.total_bytes(3) + 1
    common = ["peer", "--run", RUN, "--new_swarm", "--manifest_path", str(path), "--host_maddrs", LOOPBACK,
              "--batch_size", "16", "--device", "cpu"]  # fmt: skip
    line = the_error(*run_peer(*common, "--max_memory_bytes", str(budget))[:2])
    assert "not enough memory" in line and "--batch_size 3 would fit" in line, line
    tiny = the_error(*run_peer(*common, "--max_memory_bytes", "1000")[:2])
    assert "even --batch_size 1 needs" in tiny, tiny


@pytest.mark.timeout(60)
def test_memory_check_suggests_cpu_when_only_the_gpu_is_too_small(manifest_file):
    manifest: RunManifest = load_verified_manifest(manifest_file[0])[0]
    need = estimate_path_memory(manifest).total_bytes(8)
    with pytest.raises(ConfigError, match="--device cpu would fit"):
        check_path_fits(manifest, 8, "cuda", available=1000, cpu_available=need * 10)
    assert check_path_fits(manifest, 8, "cpu", available=need).parameters > 0


@pytest.mark.timeout(60)
def test_memory_estimate_bounds_what_a_training_step_really_allocates(manifest_file):
    """The estimate is an upper bound on the measured peak of the tensors one step creates."""
    import torch

    from peer.model.grid import all_paths
    from peer.model.transformer import PathModel
    from peer.training.inner import make_inner_optimizer

    manifest: RunManifest = load_verified_manifest(manifest_file[0])[0]
    batch = 8
    estimate = estimate_path_memory(manifest)
    model = PathModel(manifest.model, all_paths(manifest.model)[0], seed=0)
    params = sum(p.numel() for p in model.parameters())
    assert params == estimate.parameters
    optimizer = make_inner_optimizer(model, manifest.inner, "adamw")
    tokens = torch.randint(0, manifest.model.vocab_size, (batch, manifest.seq_len + 1))
    with torch.autograd.graph.saved_tensors_hooks(_count_saved, lambda t: t):
        _SAVED.clear()
        loss = model.loss(tokens)
    activations = sum(_SAVED)
    loss.backward()
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if torch.is_tensor(t))  # fmt: skip
    measured = activations + state + 3 * 4 * params  # + weights, grads, global copy
    assert measured <= estimate.total_bytes(batch), (measured, estimate)
    assert estimate.total_bytes(batch) < 6 * measured, "the estimate should not be wildly pessimistic"


_SAVED: list[int] = []


def _count_saved(t):
    _SAVED.append(t.numel() * t.element_size())
    return t


@pytest.mark.timeout(60)
def test_health_reports_a_live_peer_and_fails_without_one():
    from monitoring.metrics import PeerMetrics

    port = free_port()
    code, out = _health(port)
    assert code == 1 and "unhealthy: no peer answers" in out, out
    metrics = PeerMetrics(RUN, NOBODY, "0", "test")
    served = metrics.serve(0, "127.0.0.1")
    try:
        metrics.observe_step(128, 2.5, 100.0)
        code, alone = _health(served)
        # three module syncs: two averaged with others, one alone; three own rounds done
        for outcome in ("averaged", "averaged", "alone"):
            metrics.observe_round(outcome, 0.5, 2, 10, 10)
        metrics.set_rounds(7, 3)
        code_averaged, averaged = _health(served)
    finally:
        metrics.shutdown()
    assert code == 0 and alone.startswith("healthy, NOT contributing"), alone
    assert "never averaged with others yet" in alone
    assert code_averaged == 0 and averaged.startswith("healthy, contributing: 1 steps, 3 own rounds"), (
        averaged
    )
    assert "2 module syncs averaged with others, 128 tokens trained, last averaged with others" in averaged


def _health(port: int) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "health", "--metrics_port", str(port), "--timeout_seconds", "2"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return proc.returncode, proc.stdout.strip()
