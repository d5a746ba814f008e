"""What names an artifact: its sha256, size and the digest of its chunk list, as the manifest carries it.

A fetcher trusts nothing but the `ArtifactRef` in the signed manifest. The chunk list (one sha256 per
`chunk_bytes` of the file) is fetched from any source and checked against `chunks_sha256`, and then
every chunk is checked as it arrives, so one bad source is caught at its first chunk, a partial
download resumes from the chunks already verified, and the whole file is checked once more at the end.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
DEFAULT_CHUNK_BYTES = 1 << 20
#: p2pd carries one message of at most 4 MiB; a chunk and its framing stay well below
MAX_CHUNK_BYTES = 2 << 20
MAX_ARTIFACT_BYTES = 64 << 30
#: the chunk list travels as one reply, which p2pd caps at 4 MiB a message
MAX_CHUNK_LIST_BYTES = 2 << 20


class ArtifactRef(BaseModel):
    """An artifact as a signed manifest names it; nothing else about it is trusted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128)
    sha256: str
    size_bytes: int = Field(ge=0, le=MAX_ARTIFACT_BYTES)
    chunk_bytes: int = Field(DEFAULT_CHUNK_BYTES, ge=4096, le=MAX_CHUNK_BYTES)
    #: sha256 of the concatenated 32-byte digests of the chunks, in order
    chunks_sha256: str

    @field_validator("sha256", "chunks_sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _HEX64.match(v):
            raise ValueError("a sha256 is 64 lowercase hex characters")
        return v

    @model_validator(mode="after")
    def _chunk_list_fits(self) -> ArtifactRef:
        if 32 * self.n_chunks > MAX_CHUNK_LIST_BYTES:
            raise ValueError(
                f"{self.n_chunks} chunks: the chunk list would not fit one message; use larger chunks"
            )
        return self

    @property
    def n_chunks(self) -> int:
        return max(1, -(-self.size_bytes // self.chunk_bytes))

    def chunk_length(self, index: int) -> int:
        return min(self.chunk_bytes, self.size_bytes - index * self.chunk_bytes)

    def check_digests(self, digests: bytes) -> list[bytes]:
        """The chunk digests, if `digests` is the list this artifact names; ValueError otherwise."""
        if len(digests) != 32 * self.n_chunks or hashlib.sha256(digests).hexdigest() != self.chunks_sha256:
            raise ValueError("chunk list does not match the artifact's chunks_sha256")
        return [digests[i : i + 32] for i in range(0, len(digests), 32)]


def describe_file(path: Path, name: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> tuple[ArtifactRef, bytes]:
    """The file's reference and its chunk digests (concatenated), in one read."""
    whole, digests, size = hashlib.sha256(), bytearray(), 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            whole.update(chunk)
            digests += hashlib.sha256(chunk).digest()
            size += len(chunk)
    if size == 0:
        digests += hashlib.sha256(b"").digest()
    ref = ArtifactRef(
        name=name,
        sha256=whole.hexdigest(),
        size_bytes=size,
        chunk_bytes=chunk_bytes,
        chunks_sha256=hashlib.sha256(bytes(digests)).hexdigest(),
    )
    return ref, bytes(digests)
