"""The project's exceptions: what a person running pathswarm can fix, as one line.

`PathswarmError` is the base the command line turns into `pathswarm CMD: error: ...` and exit
status 2. `ConfigError` is a mistake in flags, config files, manifests or data settings, found while
validating them; `SwarmError` is a problem joining or talking to the swarm (defined in `dht.errors`,
since the DHT layer raises it too). Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

from dht.errors import PathswarmError, SwarmError

__all__ = ["ConfigError", "PathswarmError", "SwarmError"]


class ConfigError(PathswarmError, ValueError):
    """A configuration mistake: a flag, config file, manifest or data setting that cannot work."""
