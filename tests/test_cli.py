"""The command line fails fast, with one line, on input a user can fix."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from peer.config import load_peer_config
from peer.errors import ConfigError

# A syntactically valid peer id nobody listens for; port 9 (discard) on loopback refuses connections.
DEAD_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWHfCtvv1gqbmabwi5t3oxoBJbyV2qjrUqV8SjegRnavq2"


def run_cli(*args: str, timeout: float = 60, env: dict | None = None) -> tuple[int, str, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "peer", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    return proc.returncode, proc.stderr, time.monotonic() - started


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line.lower()]


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["peer", "--run", "demo", "--new_swarm", "--batch_size", "-3"], "batch_size"),
        (["peer", "--run", "bad name!", "--new_swarm"], "run name"),
        (["peer", "--run", "demo@xyz", "--new_swarm"], "hex"),
        (["peer", "--run", "demo", "--device", "tpu", "--new_swarm"], "device"),
        (["peer", "--run", "demo"], "--initial_peers"),
        (["peer", "--run", "demo", "--new_swarm"], "--manifest_path"),
        (["peer", "--run", "demo", "--initial_peers", "not-a-multiaddr"], "multiaddress"),
        (["run", "create", "--name", "r", "--out", "unused", "--outer_momentum", "1"], "outer_momentum"),
        (
            ["peer", "--run", "demo", "--new_swarm", "--manifest_path", "m.json", "--resume"],
            "--checkpoint_dir",
        ),
    ],
)
@pytest.mark.swarm
def test_bad_flags_fail_with_one_line(args, fragment):
    code, stderr, _ = run_cli(*args)
    assert code == 2
    lines = error_lines(stderr)
    assert len(lines) == 1 and fragment in lines[0], stderr


@pytest.mark.swarm
def test_unreachable_bootstrap_fails_within_seconds():
    code, stderr, seconds = run_cli(
        "peer", "--run", "demo", "--initial_peers", DEAD_PEER, "--host_maddrs", "/ip4/127.0.0.1/tcp/0"
    )
    assert code == 2
    lines = error_lines(stderr)
    assert len(lines) == 1 and "bootstrap" in lines[0], stderr
    assert seconds < 30


def test_config_layers_file_env_cli(tmp_path, monkeypatch):
    cfg = tmp_path / "peer.toml"
    cfg.write_text('run = "fromfile"\nbatch_size = 3\ninitial_peers = ["/ip4/1.2.3.4/tcp/1"]\n')
    monkeypatch.setenv("PATHSWARM_BATCH_SIZE", "5")
    monkeypatch.setenv("PATHSWARM_HOST_MADDRS", "/ip4/127.0.0.1/tcp/0 /ip6/::1/tcp/0")
    config = load_peer_config({"run": "fromcli"}, cfg)
    assert config.run == "fromcli" and config.batch_size == 5
    assert config.host_maddrs == ["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0"]
    assert config.initial_peers == ["/ip4/1.2.3.4/tcp/1"]


@pytest.mark.swarm
def test_malformed_config_file_is_one_line(tmp_path):
    bad = tmp_path / "peer.toml"
    bad.write_text("run = [unterminated\n")
    with pytest.raises(ConfigError) as err:
        load_peer_config({}, bad)
    assert "malformed" in str(err.value) and "\n" not in str(err.value)
    code, stderr, _ = run_cli("peer", "--config", str(bad))
    assert code == 2 and len(error_lines(stderr)) == 1
    with pytest.raises(ConfigError, match="batch_size"):
        load_peer_config({"run": "x", "batch_size": "many"})


NO_CUDA = pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks what a machine without CUDA refuses"
)


@pytest.mark.parametrize(
    "values,fragment",
    [
        ({"resume": True}, "--resume needs --checkpoint_dir"),
        ({"new_swarm": True, "initial_peers": []}, "--new_swarm needs --manifest_path"),
        ({"initial_peers": []}, "give --initial_peers"),
        ({"inner_optimizer": "adamw8bit", "device": "cpu"}, "adamw8bit needs a CUDA device"),
        ({"heartbeat_seconds": 15.0}, "half the claim TTL"),
        ({"run": "demo@0123abcd"}, "at least 16 lowercase hex digits"),
        pytest.param({"inner_optimizer": "adamw8bit"}, "adamw8bit needs a CUDA device", marks=NO_CUDA),
        pytest.param({"device": "cuda:0"}, "CUDA is not available", marks=NO_CUDA),
    ],
)
def test_config_mistakes_are_refused_by_the_config_tree(values, fragment):
    base = {"run": "demo", "initial_peers": ["/ip4/1.2.3.4/tcp/1/p2p/" + DEAD_PEER.rsplit("/", 1)[1]]}
    with pytest.raises(ConfigError, match=fragment) as err:
        load_peer_config({**base, **values})
    assert "\n" not in str(err.value)


def test_run_create_sets_the_outer_step_and_warns_of_a_sparse_codec_under_dilocos(caplog):
    from peer.run.create import RunOptions, manifest_from_options

    def manifest(**options):
        caplog.clear()
        with caplog.at_level("WARNING", logger="peer.run.create"):
            m = manifest_from_options(RunOptions(name="r", grid="1x1", **options))
        return m, [r.getMessage() for r in caplog.records if "learns slowly" in r.getMessage()]

    m, warned = manifest(codec="sparse", outer_lr=8.0, outer_momentum=0.0, mixing_alpha=0.0)
    assert (m.outer.lr, m.outer.momentum, m.outer.nesterov) == (8.0, 0.0, False) and not warned
    m, warned = manifest(codec="sparse")
    assert (m.outer.lr, m.outer.momentum, m.outer.nesterov) == (0.7, 0.9, True)
    assert len(warned) == 1 and "--outer_momentum 0 --mixing_alpha 0" in warned[0]
    m, warned = manifest(codec="sparse2bit")
    assert m.sync.codec == "sparse2bit" and len(warned) == 1
    assert not manifest(codec="nf4")[1]
    assert not manifest(codec="dense2bit")[1]  # dense: every coordinate moves, DiLoCo's step suits it


def test_a_manifest_with_overlap_not_below_h_over_p_is_refused():
    from pydantic import ValidationError

    from peer.config import RunManifest, SyncConfig

    RunManifest(name="r", sync=SyncConfig(inner_steps=12, fragments=4, overlap_steps=2))
    with pytest.raises(ValidationError, match="must be below H/P"):
        RunManifest(name="r", sync=SyncConfig(inner_steps=12, fragments=4, overlap_steps=3))
    with pytest.raises(ValidationError, match="exceeds inner_steps"):
        RunManifest(name="r", sync={"inner_steps": 2, "fragments": 4})


def test_a_runs_data_files_cannot_leave_data_root(tmp_path):
    from peer.data.sources import DatasetSpec, local_files

    root = tmp_path / "data"
    root.mkdir()
    (root / "a.txt").write_text("inside\n")
    (tmp_path / "secret.txt").write_text("outside\n")
    (root / "link.txt").symlink_to(tmp_path / "secret.txt")
    assert local_files(DatasetSpec(kind="text", data_files=["a.txt"]), root) == [str(root / "a.txt")]
    for pattern, fragment in [
        (str(tmp_path / "secret.txt"), "leaves --data_root"),
        ("../secret.txt", "leaves --data_root"),
        ("~/secret.txt", "leaves --data_root"),
        ("link.txt", "resolves outside --data_root"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            local_files(DatasetSpec(kind="text", data_files=[pattern]), root)


@pytest.mark.swarm
def test_a_second_peer_on_a_checkpoint_dir_in_use_refuses_with_one_line(tmp_path):
    from peer.checkpoint import CheckpointDirLock

    held = CheckpointDirLock(tmp_path / "ckpt").acquire()  # the first peer's lock (this process)
    try:
        code, stderr, _ = run_cli(
            "peer", "--run", "demo", "--new_swarm", "--manifest_path", str(tmp_path / "m.json"),
            "--checkpoint_dir", str(tmp_path / "ckpt"),
        )  # fmt: skip
    finally:
        held.release()
    assert code == 2
    lines = error_lines(stderr)
    assert len(lines) == 1 and "in use by another peer" in lines[0], stderr
    # released with its holder: the directory is free again
    CheckpointDirLock(tmp_path / "ckpt").acquire().release()


def test_every_invite_code_passes_as_the_value_of_invite_on_a_command_line():
    """A code that started with "-" (one in 64 of base64url's) read as a flag after --invite: its
    volunteer's peer stopped with a usage error (it broke the invite test in CI)."""
    from peer.cli.main import build_parser
    from peer.swarm.authority import new_invite_code

    parser, _ = build_parser()
    codes = [new_invite_code() for _ in range(5000)]
    assert len(set(codes)) == 5000 and all(len(c) >= 22 for c in codes)
    for code in codes:
        assert parser.parse_args(["peer", "--run", "r", "--invite", code]).invite == code
