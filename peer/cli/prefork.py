"""Starting many pathswarm processes on one machine fast: fork each from a template process that has
imported the peer already.

Most of a peer's start is imports: torch, hivemind (which imports torch and scipy) and torch's
dynamo, which the first optimizer pulls in — about 6 of the 9 CPU-seconds a fresh
`python -m peer peer` spends before its first step on this project's 2-core machine. `LocalSwarm`
(the demo, the tests) starts many peers, so it can fork each one from a template that did those
imports once (`python -m peer.cli.prefork_template`, one per parent process, started on first use).

The template is single-threaded and runs no torch operation, so forking it is safe, but for the
cross-process locks hivemind makes at import: each fork makes its own (`forget_inherited_locks`), or
one peer killed while holding one would freeze all the others. The template reads one
JSON request per line on stdin (argv, environment, working folder, log file), forks, answers the
child's pid, and reports each child's exit status when it reaps it. The child is an ordinary
process: its own session (its process group holds its p2p daemon), the log as stdout and stderr,
the given environment and folder, default signal handlers, atexit handlers run on the way out; it
runs the same `main` as the `pathswarm` command. What the preloaded modules read from the
environment at import (OMP_NUM_THREADS, for one) is the template's: the parent's at first use.
Unlike multiprocessing's forkserver, nothing re-imports the parent's main script.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path


class _Template:
    """The parent's handle on its template process: requests go in, pids and exit codes come out."""

    def __init__(self):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "peer.cli.prefork_template"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._lock = threading.Lock()  # one request at a time: answers come back in order
        self._changed = threading.Condition()
        self._started: list[int] = []
        self.exit_codes: dict[int, int] = {}
        threading.Thread(target=self._read, name="prefork-template", daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._changed:
                if "started" in message:
                    self._started.append(message["started"])
                else:
                    self.exit_codes[message["exited"]] = message["code"]
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def fork(self, request: dict) -> int:
        with self._lock:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            with self._changed:
                if not self._changed.wait_for(lambda: self._started or self._proc.poll() is not None, 120):
                    raise RuntimeError("the prefork template did not answer in 120 s")
                if not self._started:
                    raise RuntimeError(f"the prefork template exited with {self._proc.returncode}")
                return self._started.pop(0)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self.exit_codes, timeout)
            return self.exit_codes.get(pid)


_template: _Template | None = None
_template_lock = threading.Lock()


def _shared_template() -> _Template:
    global _template
    with _template_lock:
        if _template is None:
            _template = _Template()
        return _template


class ForkedProcess:
    """A pathswarm process forked from the template, with the part of `subprocess.Popen`'s interface a
    swarm uses (pid, poll, wait, returncode, signals)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path):
        self.args = ["pathswarm", *argv]
        log_path.write_text("")  # there at once, as a fresh process's redirected output would be
        self._template = _shared_template()
        request = {"argv": argv, "env": env, "cwd": str(cwd), "log": str(log_path)}
        self.pid = self._template.fork(request)

    @property
    def returncode(self) -> int | None:
        return self._template.exit_codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._template.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
