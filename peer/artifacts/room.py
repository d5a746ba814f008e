"""Whether a run's artifacts fit on the disk that would hold them, asked before any of them is fetched.

The sizes are the signed manifest's: the creator's claim of what the run needs, which can be far more
than a volunteer has (4096 data shards of up to 64 GiB each, besides a base model). A peer that lacks
the room refuses the run in one line at join, naming the manifest fields, instead of filling its disk
chunk by chunk and failing hours later, or filling the disk its checkpoints need.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from peer.artifacts.ref import ArtifactRef
from peer.artifacts.store import ArtifactError, ArtifactStore

#: kept free beyond the artifacts: the peer's checkpoints, logs and the datasets cache share the disk
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 512 << 20


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk `folder` is (or would be created) on."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:  # not made yet: its nearest existing parent's disk
        path = path.parent
    return shutil.disk_usage(path).free


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def check_room(store: ArtifactStore, named: list[tuple[str, ArtifactRef]]) -> int:
    """Refuses (ArtifactError, one line naming the manifest fields) artifacts that `store` lacks and
    whose declared sizes, with a margin, exceed its disk's free space; returns the bytes still to get.
    `named`: (manifest field, reference) pairs. A partial download is counted whole (it is sparse, so
    a resumed one already holds some of that room: the check errs on the side of refusing)."""
    lacking: dict[str, tuple[str, ArtifactRef]] = {}
    for field, ref in named:
        if not store.has(ref):
            lacking.setdefault(ref.sha256, (field, ref))  # one file, however many fields name it
    need = sum(ref.size_bytes for _, ref in lacking.values())
    if need == 0:
        return 0
    margin = int(need * MARGIN_FRACTION) + MARGIN_BYTES
    free = free_bytes(store.root)
    if need + margin > free:
        fields = ", ".join(dict.fromkeys(field for field, _ in lacking.values()))
        raise ArtifactError(
            f"the run's artifacts ({fields}) need {_size(need)} more in {store.root}, but its disk has "
            f"{_size(free)} free, less than that plus a margin of {_size(margin)}: free some room, or "
            "pass --artifacts_dir on a larger disk"
        )
    return need
