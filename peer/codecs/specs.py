"""The one table of codecs: name, bits per number, block size, scale bytes, error bound.

The CLI's choices, the config validator, the sync layer (the exact size of a payload, checked before
it is read), planning (bytes of a fragment sync) and the benchmarks all read this table;
`peer.codecs.formats` implements each entry. Pure data: reading it loads neither torch nor
bitsandbytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from peer.errors import ConfigError


@dataclass(frozen=True)
class CodecSpec:
    """One codec as every peer of a run must agree on it."""

    name: str
    bits: int
    #: numbers per block that share one scale (0: no blocks)
    block: int
    #: bytes of each block's scale (bf16 scales: 2)
    scale_bytes: int
    #: relative L2 error of one round trip on N(0, 0.01²) data, at most: tests/test_streaming.py
    #: checks it; see CODEC_SPECS for where the numbers come from
    error_bound: float
    #: sparse codecs: values kept per block (the largest by magnitude), each with a 1-byte index in
    #: its block; 0 for dense codecs
    topk: int = 0
    #: the sender keeps what its payload left out (a sparse codec's dropped values, a coarse code's
    #: rounding) and adds it to its next Δ of that fragment: SparseLoCo's error feedback
    error_feedback: bool = False

    def __post_init__(self) -> None:
        if self.topk and not self.error_feedback:
            raise ValueError(f"codec {self.name}: a sparse codec drops values and needs error feedback")

    def wire_bytes(self, numel: int) -> int:
        """Exact bytes of `numel` encoded numbers, block scales (and sparse indices) included."""
        blocks = math.ceil(numel / self.block) if self.block else 0
        if self.topk:
            return blocks * (self.scale_bytes + self.topk) + math.ceil(blocks * self.topk * self.bits / 8)
        return math.ceil(numel * self.bits / 8) + blocks * self.scale_bytes

    @property
    def wire_bytes_per_value(self) -> float:
        """Bytes one number takes on the wire, block scales included."""
        if self.topk:
            return (self.scale_bytes + self.topk * (1 + self.bits / 8)) / self.block
        return self.bits / 8 + (self.scale_bytes / self.block if self.block else 0.0)


def elias_fano_low_bits(size: int, kept: int) -> int:
    """Low bits per index when `kept` distinct indices below `size` are Elias-Fano coded."""
    return max(0, (size // kept).bit_length() - 1) if kept else 0


def elias_fano_bits(size: int, kept: int) -> int:
    """Exact bits of `kept` strictly increasing indices below `size`, Elias-Fano coded: each index's
    low bits as they are, its high part (index >> low bits) in unary in one shared bit vector, a one
    per index at high + its rank (kept ones, (size - 1) >> low zeros). 64 of 4096: 6 + 1.98 bits per
    index, where plain indices take 12; the count is fixed by (size, kept), so payloads keep an
    exact size."""
    if kept == 0:
        return 0
    low = elias_fano_low_bits(size, kept)
    return kept * (low + 1) + ((size - 1) >> low)


@dataclass(frozen=True)
class ChunkSparseSpec(CodecSpec):
    """A sparse codec over chunks of `block` values, which keep `topk` each (a partial last chunk of
    m values keeps ceil(m·topk/block), the same density), their indices Elias-Fano coded per chunk
    (`elias_fano_bits`). Its scales cost `chunk_code_bits` per chunk (a power-of-two step below one
    bf16 reference per payload, `header_bytes`), so they stay a small share of the bits."""

    chunk_code_bits: int = 4
    header_bytes: int = 2

    def chunk_kept(self, numel: int) -> list[tuple[int, int]]:
        """(size, kept) of each chunk of a payload of `numel` numbers."""
        full, rest = divmod(numel, self.block)
        return [(self.block, self.topk)] * full + (
            [(rest, math.ceil(rest * self.topk / self.block))] if rest else []
        )

    def kept(self, numel: int) -> int:
        """Values a payload of `numel` numbers carries."""
        return sum(k for _, k in self.chunk_kept(numel))

    def index_bits(self, numel: int) -> int:
        """Bits of a payload's index section, every chunk's Elias-Fano code in a row."""
        return sum(elias_fano_bits(m, k) for m, k in self.chunk_kept(numel))

    def wire_bytes(self, numel: int) -> int:
        """Exact bytes: the reference, the chunk codes, the indices, the values (each packed whole)."""
        if numel == 0:
            return 0
        chunks, kept = math.ceil(numel / self.block), self.kept(numel)
        return (
            self.header_bytes
            + math.ceil(chunks * self.chunk_code_bits / 8)
            + math.ceil(self.index_bits(numel) / 8)
            + math.ceil(kept * self.bits / 8)
        )

    @property
    def wire_bytes_per_value(self) -> float:
        bits = self.chunk_code_bits + elias_fano_bits(self.block, self.topk) + self.topk * self.bits
        return bits / 8 / self.block


# error_bound: the largest error `python -m benchmarks.codec_error` measured on Gaussian data (sizes
# 1,000 to 1,000,000, seeds 0-4) x 1.05, rounded up to three digits; fp32 is exact. The margin is
# small because the error barely varies between samples (nf4: 0.0882-0.0944 at 1,000 numbers).
CODEC_SPECS: dict[str, CodecSpec] = {
    spec.name: spec
    for spec in (
        CodecSpec("fp32", 32, 0, 0, 0.0),
        CodecSpec("fp16", 16, 0, 0, 2.23e-4),  # measured max 2.12e-4
        CodecSpec("int8", 8, 256, 4, 1.26e-2),  # 1.20e-2
        CodecSpec("nf4", 4, 64, 2, 9.92e-2),  # 9.44e-2
        CodecSpec("e3m0", 4, 64, 2, 0.199),  # 0.189
        # the 5 largest of every 256 values (2%), 4 bits each: 9.5 bytes per 256 values, 1/108 of
        # fp32; on Gaussian data one sync drops 86% of the energy (error 0.93, measured max 0.929),
        # which error feedback sends later
        CodecSpec("sparse", 4, 256, 2, 0.976, topk=5, error_feedback=True),
        # SparseLoCo's recipe (2-bit values, top-k per chunk of 4096) with Elias-Fano coded indices
        # (6.9 bits each where Covenant-72B's take 12), which leave room within Covenant's byte budget
        # (0.219 bits per number, 1/146 of fp32) for 92 values per chunk where it sent 64: with the
        # 4-bit chunk codes 0.2117 bits per number, 1/151.2 of fp32. benchmarks.sparse_outer picked
        # 92 over 64 on its validation split (docs/benchmarks/sparse_outer.md).
        # One sync drops 84% of a Gaussian's energy (error 0.92, measured max 0.928)
        ChunkSparseSpec("sparse2bit", 2, 4096, 0, 0.975, topk=92, error_feedback=True),
        # MuLoCo's 2-bit dense outer gradients: 4 levels per block of 128 with a bf16 scale (2.125
        # bits, 1/15 of fp32); what rounding leaves out is error feedback (measured max 0.356)
        CodecSpec("dense2bit", 2, 128, 2, 0.374, error_feedback=True),
    )
}
CODEC_NAMES: tuple[str, ...] = tuple(CODEC_SPECS)


def codec_spec(name: str) -> CodecSpec:
    try:
        return CODEC_SPECS[name]
    except KeyError:
        raise ConfigError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}") from None
