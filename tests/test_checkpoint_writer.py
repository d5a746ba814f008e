"""Checkpoints written on the writer thread: the caller never waits for the disk, what is written is
what was there when the caller asked, memory stays bounded, failures reach the caller, and leaving
writes everything queued."""

import threading

import pytest
import torch

from peer.checkpoint import (
    CheckpointWriter,
    list_checkpoints,
    load_latest_checkpoint,
    snapshot_tensors,
)
from peer.checkpoint import store as checkpoint_store
from peer.config import PeerConfig
from peer.training.checkpoints import PeerCheckpoints

pytestmark = pytest.mark.timeout(60)


class HeldDisk:
    """Every safetensors write waits until the test lets it through: a disk as slow as the test wants."""

    def __init__(self, monkeypatch):
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        real = checkpoint_store._write_safetensors

        def held(f, tensors):
            self.started.release()
            assert self.release.wait(30), "the test never let the write through"
            real(f, tensors)

        monkeypatch.setattr(checkpoint_store, "_write_safetensors", held)

    def wait_started(self) -> None:
        assert self.started.acquire(timeout=10), "no write started"


def tensors(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), value)}


def steps_on_disk(folder) -> list[int]:
    return [info.step for info in list_checkpoints(folder) if info.complete]


def test_the_caller_goes_on_while_its_checkpoint_is_written_and_the_copy_is_taken_when_it_asked(
    tmp_path, monkeypatch
):
    disk = HeldDisk(monkeypatch)
    writer = CheckpointWriter(tmp_path, keep=2)
    live = tensors(1.0)
    writer.submit(snapshot_tensors(live), {"step": 1})  # returns although the disk holds the write
    disk.wait_started()
    live["w"].add_(100.0)  # training changes the weights while the write is in flight
    assert steps_on_disk(tmp_path) == [] and not writer.flush(timeout_seconds=0.05)
    disk.release.set()
    assert writer.flush(timeout_seconds=10)
    loaded, meta = load_latest_checkpoint(tmp_path)
    assert meta == {"step": 1} and torch.equal(loaded["w"], torch.full((4, 3), 1.0))
    assert writer.written_step == 1 and writer.errors() == []


def test_a_newer_checkpoint_replaces_one_still_waiting_never_the_one_being_written(tmp_path, monkeypatch):
    disk = HeldDisk(monkeypatch)
    writer = CheckpointWriter(tmp_path, keep=3)
    writer.submit(snapshot_tensors(tensors(1.0)), {"step": 1})
    disk.wait_started()
    for step in (2, 3, 4):  # the disk is slower than the rounds: only the latest waits
        writer.submit(snapshot_tensors(tensors(float(step))), {"step": step})
    disk.release.set()
    assert writer.flush(timeout_seconds=10)
    assert steps_on_disk(tmp_path) == [1, 4]
    loaded, _ = load_latest_checkpoint(tmp_path)
    assert torch.equal(loaded["w"], torch.full((4, 3), 4.0))


def test_a_failed_background_write_reaches_the_caller_and_the_last_good_one_stays(tmp_path, monkeypatch):
    writer = CheckpointWriter(tmp_path, keep=2)
    writer.submit(snapshot_tensors(tensors(1.0)), {"step": 1})
    assert writer.flush(timeout_seconds=10)

    def full(f, _tensors):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_store, "_write_safetensors", full)
    writer.submit(snapshot_tensors(tensors(2.0)), {"step": 2})
    assert writer.flush(timeout_seconds=10)
    errors = writer.errors()
    assert len(errors) == 1 and "step 2" in errors[0] and "disk full" in errors[0]
    assert writer.errors() == []  # each failure is handed over once
    assert steps_on_disk(tmp_path) == [1] and writer.written_step == 1
    monkeypatch.undo()
    writer.submit(snapshot_tensors(tensors(3.0)), {"step": 3})  # the thread outlived the failure
    assert writer.close(timeout_seconds=10) and steps_on_disk(tmp_path) == [1, 3]


def test_a_peer_that_leaves_writes_the_checkpoint_still_queued_before_it_gives_the_directory_back(
    tmp_path, monkeypatch
):
    disk = HeldDisk(monkeypatch)
    ckpts = PeerCheckpoints(
        PeerConfig.model_construct(
            run="r", checkpoint_dir=tmp_path / "ckpt", keep_checkpoints=2, resume=False
        )
    )
    ckpts.lock()
    ckpts._writer.submit(snapshot_tensors(tensors(1.0)), {"step": 1})
    disk.wait_started()
    ckpts._writer.submit(snapshot_tensors(tensors(2.0)), {"step": 2})
    leaving = threading.Thread(target=ckpts.release)
    leaving.start()
    leaving.join(0.2)
    assert leaving.is_alive(), "the directory was given back before the queued checkpoints were written"
    disk.release.set()
    leaving.join(10)
    assert not leaving.is_alive() and steps_on_disk(tmp_path / "ckpt") == [1, 2]
