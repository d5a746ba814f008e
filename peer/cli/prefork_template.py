"""The prefork template (`python -m peer.cli.prefork_template`): imports the peer once, then forks a
pathswarm process per request. The protocol and why: peer/cli/prefork.py.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import sys
import threading

#: what the template imports once: the CLI, the peer and its sync layer, and what a peer's first
#: optimizer would import (torch._dynamo)
PRELOAD = ["peer.cli.main", "peer.cli.swarm_commands", "peer.training.peer", "torch._dynamo"]


def forget_inherited_locks() -> None:
    """Gives this fork its own copies of the cross-process locks hivemind makes at import. The
    template imported hivemind, so without this every peer of a local swarm would share them; a peer
    SIGKILLed while its DHT process held one (MPFuture's update lock, taken for every DHT call's
    result) froze every other peer and the bootstrap node at their next DHT call, for good: the goodput
    churn runs that did not finish in 600 s stood there. No MPFuture exists yet in a fresh fork."""
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()


def _child(request: dict) -> None:
    """In the fork: becomes the requested pathswarm process; never returns."""
    code = 1
    try:
        forget_inherited_locks()
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)  # made empty by the parent
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["pathswarm", *request["argv"]]
        # line-buffered like a fresh interpreter with PYTHONUNBUFFERED: a killed peer's log is whole
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stdout
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        from peer.cli.main import main

        code = main(request["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        # what an interpreter does on its way out: threading's exit hooks (thread pools end their
        # workers), then wait for non-daemon threads, then atexit handlers
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The template's loop: fork on each request, report exits, end when stdin closes."""
    for name in PRELOAD:
        __import__(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the parent; children reset it
    out = os.fdopen(1, "w", buffering=1)
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.2)
        while True:  # reap whatever exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            out.write(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
        if not ready:
            continue
        chunk = os.read(0, 1 << 20)
        if not chunk:
            return  # the parent is gone; the children live on in their own sessions
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                _child(json.loads(line))
            out.write(json.dumps({"started": pid}) + "\n")


if __name__ == "__main__":
    serve()
