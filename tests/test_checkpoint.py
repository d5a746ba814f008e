"""Atomic checkpoints: round trip, crash mid-write, corruption, pruning and a full disk."""

import contextlib
import ctypes
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from peer import faults
from peer.checkpoint import CheckpointError, list_checkpoints, load_latest_checkpoint, save_checkpoint
from peer.checkpoint import store as checkpoint
from peer.checkpoint.lock import CheckpointDirLock
from peer.errors import ConfigError
from peer.faults import ENV_VAR, InjectedFault

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_faults(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    faults.reset_faults()
    yield
    faults.reset_faults()


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


def test_round_trip(tmp_path):
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(10, 4, generator=g)
    base = torch.arange(24, dtype=torch.float32)
    tensors = {
        "emb.weight": emb,
        "head.weight": emb,  # tied: the same tensor under two names
        "half": base[:12],  # views sharing one storage
        "other_half": base[12:].view(3, 4),
        "transposed": torch.randn(3, 5, generator=g).t(),  # non-contiguous
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(2, 2, generator=g).half(),
        "steps": torch.tensor(12345678901, dtype=torch.int64),  # 0-dim
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "empty": torch.zeros(0, 3),
    }
    meta = {"step": 42, "run_id": "run-a", "path": [0, 1], "progress": {"tokens": 10**9, "loss": 2.5}}
    folder = save_checkpoint(tmp_path, tensors, meta)
    assert folder == tmp_path / "ckpt-000000042"
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "tensors.safetensors"]

    loaded, loaded_meta = load_latest_checkpoint(tmp_path)
    assert loaded_meta == meta
    assert_same(loaded, {k: v.contiguous() for k, v in tensors.items()})
    # Tied weights come back as independent copies; the caller re-ties them.
    assert loaded["emb.weight"].data_ptr() != loaded["head.weight"].data_ptr()

    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["step"] == 42
    assert manifest["tensors"]["bf16"] == {"shape": [7], "dtype": "bfloat16"}
    assert manifest["tensors_file"]["size"] == (folder / "tensors.safetensors").stat().st_size
    # Plain safetensors: any reader opens the file.
    from safetensors.torch import load_file

    assert torch.equal(load_file(folder / "tensors.safetensors")["bf16"], tensors["bf16"])


def test_save_copies_tensors(tmp_path):
    t = {"w": torch.zeros(3)}
    save_checkpoint(tmp_path, t, {"step": 1})
    t["w"].add_(1)  # training goes on; the checkpoint must not change
    loaded, _ = load_latest_checkpoint(tmp_path)
    assert torch.equal(loaded["w"], torch.zeros(3))


def test_empty_directory(tmp_path):
    assert load_latest_checkpoint(tmp_path) is None
    assert load_latest_checkpoint(tmp_path / "missing") is None
    assert list_checkpoints(tmp_path / "missing") == []


def test_bad_input(tmp_path):
    with pytest.raises(CheckpointError):
        save_checkpoint(tmp_path, weights(0), {"no_step": 1})
    with pytest.raises(CheckpointError):
        save_checkpoint(tmp_path, weights(0), {"step": 1, "x": object()})
    with pytest.raises(CheckpointError):
        save_checkpoint(tmp_path, weights(0), {"step": 1}, keep=0)
    assert list(tmp_path.iterdir()) == []


SAVE_TWO = """
import sys, torch
from pathlib import Path
from peer.checkpoint import save_checkpoint
d = Path(sys.argv[1])
save_checkpoint(d, {"w": torch.full((4, 3), 1.0), "b": torch.ones(3)}, {"step": 1})
print("saved 1", flush=True)
save_checkpoint(d, {"w": torch.full((4, 3), 2.0), "b": torch.ones(3)}, {"step": 2})
print("saved 2", flush=True)
"""


@pytest.mark.parametrize("point", ["checkpoint.after_tensors", "checkpoint.before_manifest"])
@pytest.mark.swarm
def test_killed_during_write(tmp_path, point):
    # @2: the first save completes, the second is killed at the point.
    env = {**os.environ, ENV_VAR: f"{point}@2=kill", "PYTHONPATH": str(REPO)}
    with subprocess.Popen(
        [sys.executable, "-c", SAVE_TWO, str(tmp_path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, stderr
    assert stdout == "saved 1\n"
    # The dead writer left its temp folder, durable tensors and no manifest inside; no ckpt-2 was published.
    temp = tmp_path / f"ckpt-000000002.tmp-{proc.pid}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000001", temp.name]
    leftovers = sorted(p.name for p in temp.iterdir())
    if point == "checkpoint.after_tensors":
        assert leftovers == ["tensors.safetensors"]
    else:
        assert leftovers == ["manifest.json.partial", "tensors.safetensors"]
    assert [info.step for info in list_checkpoints(tmp_path)] == [1]

    loaded, meta = load_latest_checkpoint(tmp_path)
    assert meta == {"step": 1}
    assert torch.equal(loaded["w"], torch.full((4, 3), 1.0))

    # The next save clears the dead writer's temp folder.
    save_checkpoint(tmp_path, weights(3), {"step": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000001", "ckpt-000000003"]


def test_injected_raise_cleans_up(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, weights(1), {"step": 1})
    monkeypatch.setenv(ENV_VAR, "checkpoint.before_manifest=raise")
    with pytest.raises(InjectedFault):
        save_checkpoint(tmp_path, weights(2), {"step": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000001"]


def test_corrupt_checkpoint_skipped(tmp_path, caplog):
    save_checkpoint(tmp_path, weights(1), {"step": 1})
    newest = save_checkpoint(tmp_path, weights(2), {"step": 2})
    path = newest / "tensors.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # flip bits in the last tensor's data
    path.write_bytes(bytes(data))

    loaded, meta = load_latest_checkpoint(tmp_path)
    assert meta == {"step": 1}
    assert_same(loaded, weights(1))
    assert "sha256 mismatch" in caplog.text


def test_incomplete_checkpoint_skipped(tmp_path, caplog):
    save_checkpoint(tmp_path, weights(1), {"step": 1})
    newest = save_checkpoint(tmp_path, weights(2), {"step": 2})
    (newest / "manifest.json").write_text('{"format": "pathswarm-checkpoint", "vers')  # torn manifest
    assert [info.complete for info in list_checkpoints(tmp_path)] == [True, False]
    _, meta = load_latest_checkpoint(tmp_path)
    assert meta == {"step": 1}
    assert "incomplete" in caplog.text

    (tmp_path / "ckpt-000000001" / "tensors.safetensors").unlink()
    assert load_latest_checkpoint(tmp_path) is None


def test_prune_keeps_newest(tmp_path):
    for step in (5, 10, 15, 20):
        save_checkpoint(tmp_path, weights(step), {"step": step}, keep=3)
    assert [info.step for info in list_checkpoints(tmp_path)] == [10, 15, 20]
    save_checkpoint(tmp_path, weights(25), {"step": 25}, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000025"]


def test_pruning_sees_a_manifest_torn_after_it_was_read_complete(tmp_path):
    """Pruning remembers which manifests were complete; one changed on disk since is read again."""
    for step in (1, 2):
        save_checkpoint(tmp_path, weights(step), {"step": step}, keep=2)
    (tmp_path / "ckpt-000000002" / "manifest.json").write_text('{"format": "pathswarm-checkpoint"')
    save_checkpoint(tmp_path, weights(3), {"step": 3}, keep=2)
    # the two newest complete ones are 1 and 3: step 1 stays (step 2 is no checkpoint any more)
    assert [(info.step, info.complete) for info in list_checkpoints(tmp_path)] == [
        (1, True),
        (2, False),
        (3, True),
    ]
    _, meta = load_latest_checkpoint(tmp_path)
    assert meta == {"step": 3}


def test_same_step_replaced(tmp_path):
    save_checkpoint(tmp_path, weights(1), {"step": 7, "v": 1})
    save_checkpoint(tmp_path, weights(2), {"step": 7, "v": 2})
    loaded, meta = load_latest_checkpoint(tmp_path)
    assert meta == {"step": 7, "v": 2}
    assert_same(loaded, weights(2))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000007"]


def test_low_disk_space_precheck(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, weights(1), {"step": 1})
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(10 * 2**20, 10 * 2**20 - 1000, 1000))
    with pytest.raises(CheckpointError, match=r"not enough disk space in .*: need [\d.]+ MB, have 0\.0 MB"):
        save_checkpoint(tmp_path, weights(2), {"step": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000001"]


def test_enospc_during_write(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, weights(1), {"step": 1})
    real_write = checkpoint._write_safetensors

    def write_then_fill_disk(f, tensors):
        real_write(f, tensors)  # a partial file really is on disk when the error hits
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint, "_write_safetensors", write_then_fill_disk)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, weights(2), {"step": 2})
    message = str(info.value)
    assert "\n" not in message and "disk full" in message and "step 2" in message
    assert isinstance(info.value.__cause__, OSError)
    # Nothing of the failed write is left behind; the previous checkpoint loads.
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-000000001"]
    loaded, meta = load_latest_checkpoint(tmp_path)
    assert meta == {"step": 1}
    assert_same(loaded, weights(1))


def test_rounds_sent_are_on_disk_for_the_next_life_and_another_runs_or_a_broken_record_is_not_taken(tmp_path):
    from peer.errors import ConfigError
    from peer.sync.sent_rounds import FILE_NAME, SentRounds

    life = SentRounds(tmp_path, "run-a")
    life.record("l0m0", 1, 7)
    life.record("l0m0", 1, 5)  # an older round never lowers the record
    assert life.sent_already("l0m0", 1, 7) and not life.sent_already("l0m0", 1, 8)  # this life's count too
    nxt = SentRounds(tmp_path, "run-a")
    assert nxt.sent_already("l0m0", 1, 7) and nxt.sent_already("l0m0", 1, 3)
    assert not nxt.sent_already("l0m0", 1, 8) and not nxt.sent_already("l0m0", 0, 0)
    assert not SentRounds(tmp_path, "run-b").sent_already("l0m0", 1, 7)
    (tmp_path / FILE_NAME).write_text('{"run": "run-a", "sent": {"l0m0/1": "seven"}}')
    with pytest.raises(ConfigError, match=FILE_NAME):
        SentRounds(tmp_path, "run-a")


def test_a_sparse_peers_unsent_error_feedback_is_in_its_checkpoint_and_back_after_a_resume(tmp_path):
    """What the sparse codec has not sent yet is the sender's own rest of earlier outer gradients: a
    restart that dropped it would lose that part of the peer's training for good (issue 32)."""
    from peer.config import OuterOptimizerConfig
    from peer.model.grid import ModelConfig
    from peer.model.transformer import PathModel
    from peer.sync.module_sync import ModuleSync, StateRejected

    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=33, blocks_per_module=2)
    outer = OuterOptimizerConfig(lr=0.7, momentum=0.0, nesterov=False)

    def module_sync(seed: int) -> ModuleSync:
        return ModuleSync(cfg, "l0m0", PathModel(cfg, (0, 0), seed=seed).parts["l0m0"], outer, 2)

    before = module_sync(1)
    corrected = torch.randn(before.fragment_size(1), generator=torch.Generator().manual_seed(3))
    before.settle_feedback(1, corrected, torch.where(corrected.abs() > 1.5, corrected, 0.0))
    assert before.errors[0] is None and before.errors[1] is not None
    save_checkpoint(tmp_path, before.named_state(), {"step": 1})
    tensors, _ = load_latest_checkpoint(tmp_path)
    after = module_sync(2)
    after.load_named_state(tensors, [4, 3])
    assert after.errors[0] is None and torch.equal(after.errors[1], before.errors[1])
    tensors["l0m0/error/f1"] = tensors["l0m0/error/f1"][:5]
    with pytest.raises(StateRejected, match="error feedback"):
        module_sync(2).load_named_state(tensors, [4, 3])


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


#: root writes anywhere through these two capabilities (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH)
_DAC_CAPS = (1 << 1) | (1 << 2)


@contextlib.contextmanager
def _as_a_user_the_folder_is_not_for():
    """This thread without root's bypass of file permissions (capabilities are per thread on Linux):
    a folder of another uid with mode 0755 is then unwritable to it, as to any other user."""
    if os.geteuid() != 0:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        pytest.skip(f"capget failed (errno {ctypes.get_errno()}): cannot drop root's file permissions")
    saved = data[0].effective
    data[0].effective &= ~_DAC_CAPS
    if libc.capset(ctypes.byref(header), data) != 0:
        pytest.skip(f"capset failed (errno {ctypes.get_errno()}): cannot drop root's file permissions")
    try:
        yield
    finally:
        data[0].effective = saved
        assert libc.capset(ctypes.byref(header), data) == 0, "could not restore this thread's capabilities"


def test_an_unwritable_checkpoint_dir_is_refused_with_the_fix(tmp_path):
    """A bind-mounted folder of another user (Docker makes a missing one as root): one line that says
    whose it is, who the peer runs as, and the fixes: chown, --user $(id -u), or a named volume."""
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    if os.geteuid() == 0:
        os.chown(data, 4321, 4321)  # another user's folder
    else:
        data.chmod(0o555)
    try:
        with _as_a_user_the_folder_is_not_for(), pytest.raises(ConfigError) as refused:
            CheckpointDirLock(data / "ckpt").acquire()
    finally:
        data.chmod(0o755)
    said = str(refused.value)
    assert "\n" not in said and f"cannot use --checkpoint_dir {data / 'ckpt'}: Permission denied" in said
    assert f"runs as uid {os.geteuid()}" in said and f"{data} belongs to uid" in said, said
    assert "chown" in said and "--user $(id -u)" in said and "named volume" in said, said
    assert not (data / "ckpt").exists()


@pytest.mark.swarm  # starts a process
@pytest.mark.timeout(60)
def test_a_killed_peers_forked_child_that_lives_on_does_not_hold_its_checkpoint_dir(tmp_path):
    """hivemind's DHT process is forked from the peer after the lock: killed with the peer, it can
    outlive it by seconds, and a restart in that window must not be refused."""
    script = (
        "import os, signal, sys, time\n"
        "from peer.checkpoint.lock import CheckpointDirLock\n"
        f"CheckpointDirLock({str(tmp_path / 'ckpt')!r}).acquire()\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    null = os.open(os.devnull, os.O_WRONLY)\n"
        "    os.dup2(null, 1), os.dup2(null, 2)\n"  # the parent's caller reads its output to EOF
        "    time.sleep(30)\n"
        "    os._exit(0)\n"
        "print(child, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=9)
    child = int(proc.stdout.split()[0])
    try:
        os.kill(child, 0)  # the forked child is still alive
        CheckpointDirLock(tmp_path / "ckpt").acquire().release()
    finally:
        os.kill(child, signal.SIGKILL)
