"""Shared fixtures: real hivemind DHT nodes on loopback, always shut down."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Tests are bounded and run on 2 cores: keep torch to one thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from dht.node import start_dht  # noqa: E402


@pytest.fixture
def dht_factory() -> Iterator:
    """Starts DHT nodes (the first one bootstraps the rest) and shuts all of them down afterwards."""
    nodes = []

    def make(**kwargs):
        if nodes and "initial_peers" not in kwargs:
            kwargs["initial_peers"] = [str(m) for m in nodes[0][0].get_visible_maddrs()]
        node = start_dht(**kwargs)
        nodes.append(node)
        return node

    try:
        yield make
    finally:
        for dht, _ in nodes:
            dht.shutdown()
