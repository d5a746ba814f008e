"""The project's base exceptions, worded for the person running pathswarm.

`PathswarmError` is the base the command line turns into `pathswarm CMD: error: ...` and exit status
2; `SwarmError` is a problem joining or talking to the swarm. They live here, in the lowest package,
because the DHT layer raises them and imports nothing from `peer`; `peer.errors` adds `ConfigError`
and is where the rest of the project takes all three from.
"""

from __future__ import annotations


class PathswarmError(Exception):
    """An error worded for the person running pathswarm."""


class SwarmError(PathswarmError, RuntimeError):
    """A problem joining or talking to the swarm (unreachable peers, no manifest, refused records)."""
