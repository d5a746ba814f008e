"""Shared fixtures: real hivemind DHT nodes on loopback, always shut down; and the test tiers.

A test that starts a process (a DHT node, a `pathswarm` command, p2pd, Prometheus, a container) is
marked `swarm`, so that `pytest -m "not swarm"` is the quick loop of a developer (minutes). The mark
is enforced: a test that starts a process without it fails, naming the mark to add.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator

import pytest

# Tests are bounded and run on 2 cores: keep torch to one thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from dht.node import start_dht  # noqa: E402

try:  # on a fresh machine matplotlib builds its font cache by running fc-list: once, here, not in a test
    import matplotlib.font_manager  # noqa: E402, F401
except ImportError:  # the dev extra brings it; without it the plotting tests fail on their own
    pass

#: processes started since the current test began (subprocesses and multiprocessing children)
_started: list[str] = []


def _counting(start, what: str):
    def wrapper(self, *args, **kwargs):
        _started.append(what)
        return start(self, *args, **kwargs)

    return wrapper


subprocess.Popen.__init__ = _counting(subprocess.Popen.__init__, "a subprocess")
multiprocessing.process.BaseProcess.start = _counting(
    multiprocessing.process.BaseProcess.start, "a child process"
)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "swarm: starts processes or swarms (the slow tier: -m 'not swarm' skips it)"
    )


def pytest_collection_modifyitems(items) -> None:
    """The slow tier first, the quick tests last (a stable sort: each file's order stays): on `-n 2` the
    quick ones fill whichever worker ends its long tests first, rather than one worker starting a
    minute-long swarm test while the other has nothing left."""
    items.sort(key=lambda item: item.get_closest_marker("swarm") is None)


@pytest.fixture(autouse=True)
def _processes_need_the_swarm_mark(request) -> Iterator[None]:
    """Fails a test that started a process without being marked `swarm` (after it ran)."""
    _started.clear()
    yield
    if _started and request.node.get_closest_marker("swarm") is None:
        pytest.fail(
            f"{request.node.nodeid} started {_started[0]} but is not marked swarm: add "
            "@pytest.mark.swarm (or pytestmark = pytest.mark.swarm in its file)",
            pytrace=False,
        )


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
