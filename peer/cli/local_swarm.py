"""A swarm of real pathswarm processes on this machine: a bootstrap node and peers on loopback.

Used by `pathswarm demo`, the benchmarks and the tests. Every process runs in its own process group
so that `stop()` also reaps its DHT child and p2p daemon; `stop()` runs on exit from the context
manager whatever happened. pathswarm processes are forked from a template that imported the peer
once (peer/cli/prefork.py: a peer's start is mostly imports), except those whose environment only an
exec applies (LD_PRELOAD, for libfaketime's clocks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from peer.cli.prefork import ForkedProcess

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _needs_exec(env: dict[str, str]) -> bool:
    """Settings a fork cannot take: the dynamic loader's (LD_PRELOAD: libfaketime's skewed clocks,
    for one) and the interpreter's own, which act only when a program starts."""
    return any(name.startswith(("LD_", "FAKETIME", "PYTHON")) for name in env)


class LocalSwarm:
    """Bootstrap and peer processes under one work folder, each with its log; stopped together."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None, prefork: bool = True):
        """`prefork`: fork pathswarm processes from a template that imported the peer once
        (peer/cli/prefork.py) instead of starting an interpreter for each."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.prefork = prefork and not _needs_exec(env or {})
        self.procs: dict[str, subprocess.Popen | ForkedProcess] = {}
        self.initial_peers: list[str] = []

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def spawn(
        self, name: str, args: list[str], env: dict[str, str] | None = None, module: str = "peer"
    ) -> subprocess.Popen | ForkedProcess:
        """Starts `python -m module args` (`module`: pathswarm's CLI, or a benchmark's wrapper of it)."""
        if self.prefork and module == "peer" and not _needs_exec(env or {}):
            proc = ForkedProcess(args, {**self.env, **(env or {})}, Path.cwd(), self.log_path(name))
            self.procs[name] = proc
            return proc
        log = open(self.log_path(name), "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**self.env, **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def start_bootstrap(self, timeout: float = 60.0, extra: list[str] | None = None) -> list[str]:
        proc = self.spawn("bootstrap", ["bootstrap", "--host_maddrs", LOOPBACK, *(extra or [])])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path("bootstrap").read_text().splitlines():
                if line.startswith("--initial_peers "):
                    self.initial_peers = line.split()[1:]
                    return self.initial_peers
            if proc.poll() is not None:
                raise RuntimeError(
                    f"bootstrap exited early: {self.log_path('bootstrap').read_text()[-2000:]}"
                )
            time.sleep(0.2)
        raise TimeoutError("bootstrap did not print its address in time")

    def start_peer(
        self, name: str, args: list[str], env: dict[str, str] | None = None, module: str = "peer"
    ) -> subprocess.Popen | ForkedProcess:
        base = ["peer", "--initial_peers", *self.initial_peers, "--host_maddrs", LOOPBACK]
        return self.spawn(name, base + args, env, module)

    def wait(self, name: str, timeout: float) -> int:
        return self.procs[name].wait(timeout=timeout)

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """SIGKILL goes to the whole process group (children too); any other signal goes to the main
        process only, as `docker stop` does, so the peer can shut its children down itself."""
        proc = self.procs[name]
        try:
            if sig == signal.SIGKILL:
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_seconds: float = 20.0) -> None:
        """SIGTERM every process (peers checkpoint and leave), then SIGKILL what is left."""
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name, signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for name in self.procs:
            self.kill(name, signal.SIGKILL)  # also reaps children left in the group
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
