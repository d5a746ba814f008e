"""The dial-back check between real peers: a helper dials the asker back only on the host the asker's
own connection comes from, so it cannot be made to probe the ports of another host."""

from __future__ import annotations

import socket
import threading

import pytest
from hivemind.p2p import PeerID

from peer.swarm.reachability import DialBackService

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(90)]


def _listener(host: str) -> tuple[socket.socket, list[str], threading.Event]:
    """A TCP listener on `host` that records every connection it gets (the event is set at each)."""
    server = socket.socket()
    server.bind((host, 0))
    server.listen(8)
    seen: list[str] = []
    accepted = threading.Event()

    def accept() -> None:
        while True:
            try:
                conn, addr = server.accept()
            except OSError:
                return
            seen.append(addr[0])
            accepted.set()
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    return server, seen, accepted


def test_the_dial_back_helper_dials_only_the_host_the_asker_connects_from(dht_factory):
    helper_dht, _ = dht_factory()
    asker_dht, _ = dht_factory()
    helper, asker = DialBackService(helper_dht), DialBackService(asker_dht)
    own, own_seen, own_accepted = _listener("127.0.0.1")  # the asker's host: it connects from 127.0.0.1
    other, other_seen, _ = _listener("127.0.0.2")  # another host (another loopback address)
    try:
        asked = [
            f"/ip4/127.0.0.2/tcp/{other.getsockname()[1]}",
            f"/ip4/127.0.0.1/tcp/{own.getsockname()[1]}",
        ]
        answered = asker._handler.call(asker._ask(PeerID.from_base58(str(helper_dht.peer_id)), asked), 30)
        # the helper's connect returns once the kernel queued it: our accept thread may not have run yet
        # (CI, loaded, closed the listener first and saw nothing), so wait for it before closing
        own_accepted.wait(10)
    finally:
        helper.shutdown()
        asker.shutdown()
        own.close()
        other.close()
    assert answered == [asked[1]], answered
    assert other_seen == [] and own_seen, (other_seen, own_seen)
