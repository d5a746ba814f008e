"""The project's exceptions: what a person running pathswarm can fix, as one line.

`PathswarmError` is the base the command line turns into `pathswarm CMD: error: ...` and exit
status 2. `ConfigError` is a mistake in flags, config files, manifests or data settings, found while
validating them; `SwarmError` is a problem joining or talking to the swarm (defined in `dht.errors`,
since the DHT layer raises it too). Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

from dht.errors import PathswarmError, SwarmError

__all__ = ["ConfigError", "PathswarmError", "SwarmError", "permission_fix"]

#: the user the image (docker/Dockerfile) runs as
IMAGE_UID = 1000


class ConfigError(PathswarmError, ValueError):
    """A configuration mistake: a flag, config file, manifest or data setting that cannot work."""


def permission_fix(path: Path) -> str:
    """What to do about a folder this process may not write (Permission denied), in words: whose it
    is, who we are, and the three fixes. A bind-mounted host folder is the usual case: the image runs
    as uid 1000, and a folder made by another user (or by Docker, as root) is not its to write."""
    owner = None
    for folder in (Path(path), *Path(path).parents):
        try:
            owner = folder.stat().st_uid
            break
        except OSError:
            continue  # missing, or not ours to look into: its parent says who owns the way there
    uid = os.geteuid()
    whose = f"{folder} belongs to uid {owner}, " if owner is not None else ""
    return (
        f"{whose}this process runs as uid {uid}: make it writable for uid {uid} (on the host: sudo "
        f"chown -R {uid} {folder}), run the container as the folder's owner (docker run --user "
        "$(id -u) …), or keep the data in a named volume (-v pathswarm-data:/data) "
        f"(the image runs as uid {IMAGE_UID})"
    )
