"""A folder of verified artifacts, named by sha256, and the partial downloads on their way into it.

`<root>/<sha256>` is a complete file whose whole-file sha256 was checked when it arrived, with
`<sha256>.json` (its `ArtifactRef`) and `<sha256>.chunks` (its chunk digests) beside it, so it can be
served without hashing it again. `<sha256>.part` is a download in progress, written chunk by chunk at
each chunk's offset; what a crash leaves of it is re-verified chunk by chunk when the download
starts again, and only the chunks that fail are fetched.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from peer.artifacts.ref import DEFAULT_CHUNK_BYTES, ArtifactRef, describe_file
from peer.errors import ConfigError, SwarmError

logger = logging.getLogger(__name__)


class ArtifactError(SwarmError):
    """An artifact that cannot be had: no source, every source wrong, or no room on disk."""


#: local files up to this size are hashed again before use; larger ones (data shards) are matched by
#: size: they were checked chunk by chunk when they arrived
REHASH_LOCAL_BYTES = 64 << 20


def find_artifact(ref: ArtifactRef, folders, rehash_up_to_bytes: int = REHASH_LOCAL_BYTES) -> Path | None:
    """The first of `folders` (artifact folders: a peer's own, the run folder) holding `ref`'s file;
    a file of the right name but other contents (size, or the sha256 of a file up to
    `rehash_up_to_bytes`) is refused with an ArtifactError."""
    for folder in folders:
        path = Path(folder) / ref.sha256
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if size != ref.size_bytes:
            raise ArtifactError(f"{path} is not the run's {ref.name} ({size} bytes, not {ref.size_bytes})")
        if ref.size_bytes <= rehash_up_to_bytes:
            try:
                got, _ = describe_file(path, ref.name, ref.chunk_bytes)
            except OSError:
                continue
            if got.sha256 != ref.sha256:
                raise ArtifactError(f"{path} is not the run's {ref.name} (its sha256 differs)")
        return path
    return None


def require_artifact(
    ref: ArtifactRef, folders, what: str, rehash_up_to_bytes: int = REHASH_LOCAL_BYTES
) -> Path:
    """`find_artifact`, for offline readers that cannot fetch: a missing artifact is one line
    naming `what`, where it was looked for and how to point at it."""
    path = find_artifact(ref, folders, rehash_up_to_bytes)
    if path is None:
        raise ConfigError(
            f"{what} ({ref.sha256[:12]}…) is in none of {[str(f) for f in folders]}: pass "
            "--artifacts_dir with the folder that holds it (run create writes it beside the manifest; "
            "every peer keeps a copy in CHECKPOINT_DIR/artifacts)"
        )
    return path


class ArtifactStore:
    """One folder of complete artifacts and partial downloads (the module docstring has the layout)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _ensure_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArtifactError(f"cannot create the artifact folder {self.root}: {e.strerror}") from None

    def path(self, sha256: str) -> Path:
        return self.root / sha256

    def has(self, ref: ArtifactRef) -> bool:
        meta = self.root / f"{ref.sha256}.json"
        try:
            return self.path(ref.sha256).stat().st_size == ref.size_bytes and meta.exists()
        except OSError:
            return False

    def ref_of(self, sha256: str) -> ArtifactRef | None:
        try:
            return ArtifactRef.model_validate_json((self.root / f"{sha256}.json").read_text())
        except (OSError, ValueError):
            return None

    def digests(self, sha256: str) -> bytes | None:
        try:
            return (self.root / f"{sha256}.chunks").read_bytes()
        except OSError:
            return None

    def read_chunk(self, ref: ArtifactRef, index: int) -> bytes:
        with open(self.path(ref.sha256), "rb") as f:
            f.seek(index * ref.chunk_bytes)
            return f.read(ref.chunk_length(index))

    def add_file(self, source: Path, name: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ArtifactRef:
        """Copies a local file in (once) and returns its reference."""
        self._ensure_root()
        try:
            ref, digests = describe_file(source, name, chunk_bytes)
        except OSError as e:
            raise ArtifactError(f"cannot read {source}: {e.strerror}") from None
        if not self.has(ref):
            tmp = self.root / f"{ref.sha256}.adding"
            try:
                shutil.copyfile(source, tmp)
                os.replace(tmp, self.path(ref.sha256))
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise ArtifactError(f"cannot store {source} in {self.root}: {e.strerror}") from None
            self._finish(ref, digests)
        return ref

    def _finish(self, ref: ArtifactRef, digests: bytes) -> None:
        for suffix, data in ((".chunks", digests), (".json", ref.model_dump_json().encode())):
            tmp = self.root / f"{ref.sha256}{suffix}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self.root / f"{ref.sha256}{suffix}")

    # --- partial downloads ---------------------------------------------------------------------

    def open_partial(self, ref: ArtifactRef, digests: list[bytes]) -> tuple[Path, list[int]]:
        """The partial file (created at full size if new) and the chunks it still lacks."""
        self._ensure_root()
        part = self.root / f"{ref.sha256}.part"
        missing = []
        try:
            with open(part, "a+b") as f:
                if f.seek(0, os.SEEK_END) != ref.size_bytes:
                    f.truncate(ref.size_bytes)  # sparse: room is taken as chunks arrive
                f.seek(0)
                for i in range(ref.n_chunks):
                    if hashlib.sha256(f.read(ref.chunk_length(i))).digest() != digests[i]:
                        missing.append(i)
        except OSError as e:
            raise ArtifactError(f"cannot write {part}: {e.strerror}") from None
        return part, missing

    def write_chunk(self, part: Path, ref: ArtifactRef, index: int, data: bytes) -> None:
        try:
            with open(part, "r+b") as f:
                f.seek(index * ref.chunk_bytes)
                f.write(data)
                f.flush()
        except OSError as e:
            raise ArtifactError(f"cannot write {ref.name} to {part}: {e.strerror}") from None

    def complete(self, part: Path, ref: ArtifactRef, digests: bytes) -> Path:
        """Checks the whole file's sha256 and moves it in; a mismatch deletes it (should not happen:
        every chunk was checked, but the whole-file hash is what the manifest signs)."""
        whole = hashlib.sha256()
        with open(part, "rb") as f:
            while block := f.read(1 << 22):
                whole.update(block)
        if whole.hexdigest() != ref.sha256:
            part.unlink(missing_ok=True)
            raise ArtifactError(f"{ref.name}: the assembled file's sha256 is not the manifest's")
        os.replace(part, self.path(ref.sha256))
        self._finish(ref, digests)
        return self.path(ref.sha256)
