"""The one table of codecs: name, hivemind slot, bytes per number on the wire, expected error.

The CLI's choices, the config validator, planning (bytes of a fragment sync) and the benchmarks all
read this table; `peer.codecs.formats` implements each entry. Pure data, so reading it loads neither
hivemind nor bitsandbytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from peer.errors import ConfigError


@dataclass(frozen=True)
class CodecSpec:
    """One codec as every peer of a run must agree on it."""

    name: str
    bits: int
    #: the `runtime_pb2.CompressionType` slot the codec occupies in every peer's hivemind registry
    hivemind_slot: str
    #: numbers per block that share one fp32 scale (0: no blocks)
    block: int
    #: relative L2 error bound on Gaussian data; the end-to-end checksum's tolerance is built on it
    error_bound: float

    @property
    def wire_bytes_per_value(self) -> float:
        """Bytes one number takes on the wire, block scales included."""
        return self.bits / 8 + (4 / self.block if self.block else 0.0)


CODEC_SPECS: dict[str, CodecSpec] = {
    spec.name: spec
    for spec in (
        CodecSpec("fp32", 32, "NONE", 0, 1e-6),
        CodecSpec("fp16", 16, "FLOAT16", 0, 1e-3),
        CodecSpec("int8", 8, "BLOCKWISE_8BIT", 256, 2e-2),
        CodecSpec("nf4", 4, "QUANTILE_8BIT", 64, 0.1),
        CodecSpec("e3m0", 4, "UNIFORM_8BIT", 64, 0.2),
    )
}
CODEC_NAMES: tuple[str, ...] = tuple(CODEC_SPECS)


def codec_spec(name: str) -> CodecSpec:
    try:
        return CODEC_SPECS[name]
    except KeyError:
        raise ConfigError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}") from None
