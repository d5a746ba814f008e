"""One peer per checkpoint directory: an exclusive lock held for the peer's lifetime.

Two peers writing into one `--checkpoint_dir` would overwrite and prune each other's checkpoints
silently. The lock is an advisory `flock` on a file in the directory, so the kernel releases it when
its process dies, however it dies (no stale lock to clean up after a crash); the file records the
holder's pid for the error message.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from peer.errors import ConfigError, permission_fix

LOCK_NAME = ".pathswarm.lock"


class CheckpointDirLock:
    """Holds the lock of `directory` from `acquire()` until `release()` or the process's end."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._fd: int | None = None

    def acquire(self) -> CheckpointDirLock:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError as e:
            raise ConfigError(
                f"cannot use --checkpoint_dir {self.directory}: {e.strerror or e}; "
                + permission_fix(self.directory)
            ) from None
        except OSError as e:
            raise ConfigError(f"cannot use --checkpoint_dir {self.directory}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"--checkpoint_dir {self.directory} is in use by another peer (pid {holder}); "
                "give every peer a directory of its own"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        # A forked child (hivemind's DHT process) shares the lock; killed with us, it may outlive us by
        # seconds and refuse a restart meanwhile. It drops its copy, so only this process holds it.
        os.register_at_fork(after_in_child=self._drop_in_child)
        return self

    def _drop_in_child(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
