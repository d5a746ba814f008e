"""The project's exceptions: what a person running pathswarm can fix, as one line.

`PathswarmError` is the base the command line turns into `pathswarm CMD: error: ...` and exit
status 2. `ConfigError` is a mistake in flags, config files, manifests or data settings, found while
validating them; `SwarmError` is a problem joining or talking to the swarm. Anything else that
escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class PathswarmError(Exception):
    """An error worded for the person running pathswarm."""


class ConfigError(PathswarmError, ValueError):
    """A configuration mistake: a flag, config file, manifest or data setting that cannot work."""


class SwarmError(PathswarmError, RuntimeError):
    """A problem joining or talking to the swarm (unreachable peers, no manifest, refused records)."""
