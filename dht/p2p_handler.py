"""One protobuf handler of ours on a P2P replica of its own, served on a background loop of its own.

Services that answer one kind of request over hivemind's P2P (the dial-back check, artifacts) each
take a replica of the DHT's daemon connection: `dht.replicate_p2p()` hands every caller in a process
one cached replica, whose handler listener then lives on the first caller's event loop, and a second
loop adding handlers to it hangs.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import hivemind
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from dht.background_loop import BackgroundLoop


class P2PHandler:
    """`serve` answers `name` requests (runtime_pb2.Tensor both ways) until `shutdown`."""

    def __init__(self, dht: hivemind.DHT, name: str, serve: Callable[..., Coroutine], loop_name: str):
        self.name = name
        self.background = BackgroundLoop(loop_name)
        self.p2p: P2P = self.background.call(self._start(dht, serve), timeout=30)

    async def _start(self, dht: hivemind.DHT, serve: Callable[..., Coroutine]) -> P2P:
        daemon = dht.run_coroutine(hivemind.DHT._get_p2p_daemon_listen_maddr)
        p2p = await P2P.replicate(daemon)
        await p2p.add_protobuf_handler(self.name, serve, runtime_pb2.Tensor)
        return p2p

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Runs `coro` on this service's loop (where `self.p2p` may be used) and waits for it."""
        return self.background.call(coro, timeout)

    def shutdown(self) -> None:
        async def cleanup():
            await self.p2p.remove_protobuf_handler(self.name)
            await self.p2p.shutdown()

        self.background.stop(cleanup)
