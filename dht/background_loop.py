"""An asyncio event loop in a daemon thread, for the peer's P2P services, with an orderly stop.

The peer's training runs in the main thread; its P2P handlers (sync protocol, probes) run on loops
of their own. Stopping such a loop by just halting it leaves tasks of hivemind's daemon client
pending, which Python reports at exit as "Task was destroyed" and "Event loop is closed" errors
with tracebacks: `stop()` runs the service's own cleanup, cancels every remaining task, waits for
them, and closes the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)


class BackgroundLoop:
    """`call` and `submit` coroutines from any thread; `stop` once, from any thread but its own."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, cleanup: Callable[[], Coroutine] | None = None, timeout: float = 5.0) -> None:
        async def wind_down() -> None:
            if cleanup is not None:
                try:
                    await asyncio.wait_for(cleanup(), timeout)
                except Exception as e:
                    logger.debug(f"cleanup: {type(e).__name__}: {e}")
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if not self.loop.is_closed() and self._thread.is_alive():
            try:
                self.call(wind_down(), timeout * 2)
            except Exception as e:
                logger.debug(f"stopping the {self._thread.name} loop: {type(e).__name__}: {e}")
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive() and not self.loop.is_closed():
            self.loop.close()


def wait_until(future: concurrent.futures.Future, until: float, stop: threading.Event) -> bool:
    """Waits for `future` (of `submit`) until `until` (monotonic) or until `stop` is set, looking
    every quarter second: a signal handler of the waiting thread sets `stop`, and a plain
    `result(timeout)` would sleep through it. Returns whether the future is done."""
    while not future.done() and not stop.is_set() and (left := until - time.monotonic()) > 0:
        concurrent.futures.wait([future], timeout=min(0.25, left))
    return future.done()
