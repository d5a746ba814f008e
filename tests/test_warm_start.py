"""A run that starts from a base model: created with a warm start, served by hash, fetched by a
joiner from a peer that is not its creator, trained from, evaluated with; a tampered copy refused."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peer.artifacts.store import ArtifactError
from peer.cli.local_swarm import LocalSwarm
from peer.config import RunManifest
from peer.errors import ConfigError
from peer.model.base import load_base, save_base
from peer.run.rebuild import router_of
from peer.run.record import load_verified_manifest
from tests.swarm_harness import downloaded_state, wait_for

pytestmark = pytest.mark.swarm

REPO = Path(__file__).resolve().parent.parent


def _create(folder: Path, *extra: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "manifest.json"
    args = ["run", "create", "--name", "warm", "--out", str(out), "--grid", "1x2", "--inner_steps", "10",
            "--seq_len", "32", "--no_publish", *extra]  # fmt: skip
    command = [sys.executable, "-m", "peer", *args]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _rounds(log: str) -> list[float]:
    return [float(x) for x in re.findall(r"round \d+ step \d+ loss ([\d.]+)", log)]


@pytest.mark.timeout(300)
def test_a_joiner_fetches_the_base_from_a_peer_that_is_not_its_creator_and_trains_from_it(tmp_path):
    manifest_path = _create(tmp_path / "run", "--warm_start_steps", "150")
    manifest, record = load_verified_manifest(manifest_path)
    ref = manifest.base_checkpoint
    assert ref is not None and (tmp_path / "run" / "artifacts" / ref.sha256).is_file()
    common = ["--torch_threads", "1", "--batch_size", "4", "--heartbeat_seconds", "1"]
    with LocalSwarm(tmp_path / "logs") as swarm:
        # the bootstrap knows the run but not the base (another folder): only peer a can serve it
        swarm.start_bootstrap(
            extra=["--manifest_path", str(manifest_path), "--artifacts_dir", str(tmp_path / "nothing")]
        )
        a_args = [
            "--run",
            "warm",
            "--manifest_path",
            str(manifest_path),
            "--path",
            "0",
            "--checkpoint_dir",
            str(tmp_path / "a"),
        ]
        swarm.start_peer("a", [*a_args, "--max_rounds", "1000", *common])
        a_log = lambda: swarm.log_path("a").read_text()  # noqa: E731
        wait_for(lambda: "round 2 step" in a_log() or not swarm.alive("a"), 120, "a's rounds", swarm)
        assert swarm.alive("a"), a_log()[-3000:]
        b_args = [
            "--run",
            f"warm@{record.run_id[:16]}",
            "--path",
            "1",
            "--checkpoint_dir",
            str(tmp_path / "b"),
        ]
        swarm.start_peer("b", [*b_args, "--max_rounds", "2", "--keep_checkpoints", "100", *common])
        assert swarm.wait("b", timeout=120) == 0, swarm.log_path("b").read_text()[-3000:]
        swarm.kill("a", signal.SIGTERM)
        assert swarm.wait("a", timeout=60) == 0
        boot_log, a_log, b_log = (swarm.log_path(n).read_text() for n in ("bootstrap", "a", "b"))
    assert "is not in" in boot_log and "serving the run's base model" not in boot_log
    assert "fetching the run's base model" not in a_log  # a had it beside the manifest
    assert "fetching the run's base model" in b_log and f"sha256 {ref.sha256[:12]}… verified" in b_log
    # the router too: a run with artifacts to serve carries its router by hash, not inline
    assert manifest.router == {} and manifest.router_file is not None
    assert (
        "fetching the run's router" in b_log
        and (tmp_path / "b" / "artifacts" / manifest.router_file.sha256).is_file()
    )
    fetched = tmp_path / "b" / "artifacts" / ref.sha256
    assert fetched.read_bytes() == (tmp_path / "run" / "artifacts" / ref.sha256).read_bytes()
    # a's path 0 is the base's own path: its first round's loss is the base's, far below a cold
    # start's (ln 256 = 5.55 for byte tokens, about 5.3 after a cold start's first 10 steps)
    assert _rounds(a_log)[0] < 4.6, a_log[-2000:]
    # b's l0m1, which nobody had trained, starts from the base's l0m0, bit for bit (b's checkpoint
    # of what it had before its first step)
    base = load_base(fetched, manifest.model)
    joined, _ = downloaded_state(tmp_path / "b")
    for name, value in base["l0m0"].items():
        assert torch.equal(joined[f"l0m1/global/{name}"], value), name

    # evaluation routes with the base's features: it finds the base beside the manifest
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "eval", "--manifest_path", str(manifest_path), "--checkpoints",
         str(tmp_path / "a"), str(tmp_path / "b"), "--max_docs", "40", "--json", str(tmp_path / "eval.json")],
        capture_output=True, text=True, cwd=REPO, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def _refused_start(manifest_path: Path, checkpoint_dir: Path) -> str:
    """Starts a peer on the run and returns the one line it refused with (exit 2, no traceback)."""
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "peer", "--new_swarm", "--manifest_path", str(manifest_path),
         "--run", "warm", "--checkpoint_dir", str(checkpoint_dir), "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
         "--max_steps", "1"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr.strip().splitlines()[-1]


def test_a_tampered_base_beside_the_manifest_is_refused_in_one_line(tmp_path):
    manifest_path = _create(tmp_path / "run", "--warm_start_steps", "5")
    manifest, _ = load_verified_manifest(manifest_path)
    stored = tmp_path / "run" / "artifacts" / manifest.base_checkpoint.sha256
    data = bytearray(stored.read_bytes())
    data[-5] ^= 0xFF
    stored.write_bytes(bytes(data))
    last = _refused_start(manifest_path, tmp_path / "c")
    assert "is not the run's base" in last, last


def test_a_tampered_router_beside_the_manifest_is_refused_in_one_line(tmp_path):
    manifest_path = _create(tmp_path / "run", "--warm_start_steps", "5")
    manifest, _ = load_verified_manifest(manifest_path)
    stored = tmp_path / "run" / "artifacts" / manifest.router_file.sha256
    # a byte added and one dropped, the size kept: what a size check alone would let through
    stored.write_text(stored.read_text().replace('"bias":[', '"bias":[9', 1)[:-1])
    last = _refused_start(manifest_path, tmp_path / "c")
    assert "is not the run's router.json" in last, last
    # offline commands read it from the run folder: refused there too, not used
    with pytest.raises(ArtifactError, match="is not the run's router.json"):
        router_of(manifest, [tmp_path / "run" / "artifacts"])
    with pytest.raises(ValueError, match="inline or as router_file"):
        RunManifest.model_validate({**manifest.model_dump(), "router": {"kind": "kmeans"}})


def test_a_base_file_that_does_not_fit_the_run_is_refused_in_one_line(tmp_path):
    manifest_path = _create(tmp_path / "run", "--warm_start_steps", "5")
    manifest, _ = load_verified_manifest(manifest_path)
    good = tmp_path / "run" / "artifacts" / manifest.base_checkpoint.sha256
    base = load_base(good, manifest.model)
    cases = {
        "NaN": {
            **base,
            "trunk": {
                **base["trunk"],
                "tok_emb.weight": torch.full_like(base["trunk"]["tok_emb.weight"], float("nan")),
            },
        },
        "shape": {**base, "l0m0": {k: v[..., :1] for k, v in base["l0m0"].items()}},
        "missing": {k: v for k, v in base.items() if k != "l0m0"},
    }
    for what, states in cases.items():
        bad = tmp_path / f"{what}.safetensors"
        save_base(states, bad)
        with pytest.raises(ConfigError) as refused:
            load_base(bad, manifest.model)
        assert "\n" not in str(refused.value), what
    not_a_base = tmp_path / "other.safetensors"
    not_a_base.write_bytes(json.dumps({"x": 1}).encode())
    with pytest.raises(ConfigError, match="cannot read the base model|not a pathswarm base"):
        load_base(not_a_base, manifest.model)
