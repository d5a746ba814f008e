"""A peer's checkpoints: crash-safe folders of safetensors weights and a JSON manifest (`store`), the
thread that writes them while training goes on (`writer`), and the lock that keeps a second peer out
of a checkpoint directory in use (`lock`).

Leaf layer: imports only `peer.errors` and `peer.faults`.
"""

from peer.checkpoint.lock import CheckpointDirLock
from peer.checkpoint.store import (
    SPACE_MARGIN_BYTES,
    CheckpointError,
    CheckpointInfo,
    TensorSnapshot,
    list_checkpoints,
    load_latest_checkpoint,
    save_checkpoint,
    snapshot_tensors,
)
from peer.checkpoint.writer import CheckpointWriter

__all__ = [
    "SPACE_MARGIN_BYTES",
    "CheckpointDirLock",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointWriter",
    "TensorSnapshot",
    "list_checkpoints",
    "load_latest_checkpoint",
    "save_checkpoint",
    "snapshot_tensors",
]
