"""The peer's log stays free of Python 3.11's false ERROR for a stream handler cancelled at shutdown,
and keeps every other asyncio error: real asyncio servers and tasks, the filter `setup_logging` installs."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from peer.cli.common import _cancelled_stream_handler


class Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.addFilter(_cancelled_stream_handler)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def _cancel_a_stream_handler(fail: bool) -> None:
    """A unix-socket-like server (TCP on loopback here) whose handler is cancelled mid-stream, as
    hivemind's daemon control server's are when a node shuts down; `fail`: the handler raises instead."""
    started = asyncio.Event()

    async def handler(reader, writer):
        started.set()
        if fail:
            raise RuntimeError("a real handler failure")
        await asyncio.sleep(60)

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    await asyncio.wait_for(started.wait(), 5)
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task() and "handler" in repr(task.get_coro()):
            task.cancel()
    await asyncio.sleep(0.2)  # the done callback runs
    writer.close()
    server.close()
    await server.wait_closed()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fail", [False, True])
def test_a_cancelled_stream_handler_logs_no_error_while_a_failing_one_still_does(fail):
    kept = Kept()
    log = logging.getLogger("asyncio")
    log.addHandler(kept)
    try:
        asyncio.run(_cancel_a_stream_handler(fail))
    finally:
        log.removeHandler(kept)
        gc.collect()  # the loop's transports go now, not inside a later test
    errors = [r.getMessage() for r in kept.records if r.levelno >= logging.ERROR]
    if fail:
        assert any("a real handler failure" in m or "Unhandled exception in client_connected_cb" in m
                   for m in errors), errors  # fmt: skip
    else:
        assert errors == []
