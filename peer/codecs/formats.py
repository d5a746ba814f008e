"""The codecs of `peer.codecs.specs`: outer gradients to bytes and back.

Every codec encodes a flat float32 vector and decodes to float32; the sync layer sums decoded values
in fp32/fp64. `decode` is given bytes from another peer: it checks their length against the exact
size the table gives for the expected number of values before reading them, and refuses anything
else.

| name | bits | how |
|---|---|---|
| fp32 | 32 | raw little-endian float32 |
| fp16 | 16 | IEEE half precision |
| int8 | 8 | bitsandbytes blockwise dynamic quantisation, block 256, fp32 absmax |
| nf4 | 4 | NormalFloat4 levels (bitsandbytes' table), block 64, bf16 absmax |
| e3m0 | 4 | sign + 3-bit exponent (Streaming DiLoCo's format), block 64, bf16 absmax |
| sparse | 4 | top 5 of every 256 values (2%), 1-byte indices, sign + 3-bit magnitude, bf16 scale |
| sparse2bit | 2 | top 92 of each 4096 (2.2%), Elias-Fano indices, sign + magnitude bit, 4-bit chunk scale |
| dense2bit | 2 | every value, 4 levels (Lloyd-Max for a Gaussian) times a bf16 RMS per block of 128 |
| rotated2bit | 2 | dense2bit's code of each block of 128 randomly rotated (Hadamard), a 4-byte seed |

4-bit blocks keep their absmax in bfloat16: fp32's range (outer gradients can be tiny) in 2 bytes,
so a number costs 0.53 bytes (7.5x smaller than fp32); its 0.4% rounding is far below the 4-bit
code's own error, and values are normalised by the rounded scale and clamped, so encoding and
decoding use the same scale.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from peer.codecs.base import (
    Codec,
    CodecError,
    _bf16_bytes,
    _bf16_from,
    _blocks,
    _flat,
    _pack_nibbles,
    _unpack_nibbles,
)
from peer.codecs.specs import CODEC_SPECS, codec_spec
from peer.codecs.two_bit import ChunkSparse2BitCodec, Dense2BitCodec, Rotated2BitCodec


class Float32Codec(Codec):
    """Raw little-endian float32: exact."""

    spec = CODEC_SPECS["fp32"]

    def encode(self, x: torch.Tensor) -> bytes:
        return _flat(x).numpy().astype("<f4", copy=False).tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check(data, numel)
        return torch.from_numpy(np.frombuffer(data, dtype="<f4").astype(np.float32))


class Float16Codec(Codec):
    """IEEE half precision."""

    spec = CODEC_SPECS["fp16"]

    def encode(self, x: torch.Tensor) -> bytes:
        return _flat(x).numpy().astype("<f2").tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check(data, numel)
        return torch.from_numpy(np.frombuffer(data, dtype="<f2").astype(np.float32))


class BlockCodec4(Codec):
    """A 4-bit codec: per block a bf16 absmax, then one nibble per value."""

    levels: torch.Tensor  # 16 ascending code values in [-1, 1], indexed by nibble

    def encode(self, x: torch.Tensor) -> bytes:
        block = self.spec.block
        blocks, n = _blocks(x, block)
        scales = _bf16_from(_bf16_bytes(blocks.abs().amax(1)))  # the scale the decoder will see
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        normalized = (blocks / safe[:, None]).clamp(-1, 1).reshape(-1)
        # levels ascend, so the nearest level is found by bucketing against the midpoints: O(n) memory
        codes = torch.bucketize(normalized, (self.levels[1:] + self.levels[:-1]) / 2)
        return _bf16_bytes(scales) + _pack_nibbles(codes[:n])

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check(data, numel)
        n_blocks = math.ceil(numel / self.spec.block)
        scales = _bf16_from(data[: 2 * n_blocks])
        if not torch.isfinite(scales).all():
            raise CodecError(f"{self.spec.name}: non-finite block scale")
        codes = _unpack_nibbles(data[2 * n_blocks :], numel)
        return self.levels[codes] * scales.repeat_interleave(self.spec.block)[:numel]


class NF4Codec(BlockCodec4):
    """NormalFloat4 (Dettmers et al. 2023): quantiles of a normal distribution, the code bitsandbytes
    uses; quantised here with the same table, on any device."""

    spec = CODEC_SPECS["nf4"]

    def __init__(self):
        # bitsandbytes' NF4 table (bitsandbytes.functional.get_4bit_type("nf4")), in nibble order.
        self.levels = torch.tensor(
            [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]
        )  # fmt: skip


class E3M0Codec(BlockCodec4):
    """Sign and a 3-bit exponent, no mantissa: |x|/absmax rounds to one of {0, 2^-6, ..., 2^0}
    (Streaming DiLoCo quantises outer gradients to E3M0)."""

    spec = CODEC_SPECS["e3m0"]

    def __init__(self):
        magnitudes = [0.0] + [2.0**-e for e in range(6, -1, -1)]  # 8 levels
        self.levels = torch.tensor(sorted([-m for m in magnitudes] + magnitudes))  # -0 and 0 both kept


class SparseTopKCodec(Codec):
    """Per block of 256 values, the `topk` largest by magnitude: a bf16 scale (their absmax), their
    1-byte indices in the block (strictly increasing, so every set has one encoding), then a nibble
    each, sign and a 3-bit magnitude (m + 1)/8 of the scale. Layout: all scales, all indices, all
    nibbles. Indices in a block cost 8 bits each; a bitmap would cost 256/topk = 51 bits per kept
    value and a delta code of the gaps a variable size, which could not be checked before reading.
    The dropped values are the sender's error feedback (peer/sync/outer.py)."""

    spec = CODEC_SPECS["sparse"]

    def encode(self, x: torch.Tensor) -> bytes:
        block, k = self.spec.block, self.spec.topk
        blocks, _ = _blocks(x, block)
        idx = blocks.abs().topk(k, dim=1).indices.sort(dim=1).values
        vals = blocks.gather(1, idx)
        scales = _bf16_from(_bf16_bytes(vals.abs().amax(1)))
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        magnitude = ((vals.abs() / safe[:, None]).clamp(0, 1) * 8).round().clamp(1, 8) - 1
        codes = (vals < 0).long() * 8 + magnitude.long()
        return _bf16_bytes(scales) + idx.to(torch.uint8).numpy().tobytes() + _pack_nibbles(codes)

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check(data, numel)
        block, k = self.spec.block, self.spec.topk
        n_blocks = math.ceil(numel / block)
        scales = _bf16_from(data[: 2 * n_blocks])
        if not torch.isfinite(scales).all() or bool((scales < 0).any()):
            raise CodecError("sparse: a block scale is negative or not finite")
        at = 2 * n_blocks
        idx = torch.from_numpy(np.frombuffer(data[at : at + n_blocks * k], dtype=np.uint8).copy()).long()
        idx = idx.view(n_blocks, k)
        if k > 1 and not bool((idx[:, 1:] > idx[:, :-1]).all()):
            raise CodecError("sparse: indices in a block must be strictly increasing")
        codes = _unpack_nibbles(data[at + n_blocks * k :], n_blocks * k).view(n_blocks, k)
        values = ((codes & 7) + 1).float() / 8 * torch.where(codes >= 8, -1.0, 1.0) * scales[:, None]
        out = torch.zeros(n_blocks, block)
        out.scatter_(1, idx, values)
        return out.reshape(-1)[:numel]


class Blockwise8BitCodec(Codec):
    """bitsandbytes' blockwise dynamic 8-bit quantisation (block 256), decoded to float32."""

    spec = CODEC_SPECS["int8"]

    def __init__(self):
        import bitsandbytes.functional as bnb_f

        self._f = bnb_f
        self._code = bnb_f.create_dynamic_map(signed=True)

    def encode(self, x: torch.Tensor) -> bytes:
        flat = _flat(x)
        if flat.numel() == 0:
            return b""
        q, state = self._f.quantize_blockwise(flat, code=self._code, blocksize=self.spec.block)
        return state.absmax.float().numpy().astype("<f4").tobytes() + q.numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check(data, numel)
        if numel == 0:
            return torch.zeros(0)
        n_blocks = math.ceil(numel / self.spec.block)
        absmax = torch.from_numpy(np.frombuffer(data[: 4 * n_blocks], dtype="<f4").astype(np.float32))
        if not torch.isfinite(absmax).all():
            raise CodecError("int8: non-finite block scale")
        q = torch.from_numpy(np.frombuffer(data[4 * n_blocks :], dtype=np.uint8).copy())
        out = self._f.dequantize_blockwise(q, absmax=absmax, code=self._code, blocksize=self.spec.block)
        return out.float().reshape(-1)


#: codec name -> the class that implements it (sizes and error bounds: peer.codecs.specs)
FACTORIES: dict[str, type[Codec]] = {
    "fp32": Float32Codec,
    "fp16": Float16Codec,
    "int8": Blockwise8BitCodec,
    "nf4": NF4Codec,
    "e3m0": E3M0Codec,
    "sparse": SparseTopKCodec,
    "sparse2bit": ChunkSparse2BitCodec,
    "dense2bit": Dense2BitCodec,
    "rotated2bit": Rotated2BitCodec,
}
assert set(FACTORIES) == set(CODEC_SPECS)


def make_codec(name: str) -> Codec:
    codec_spec(name)  # a clear error for an unknown name
    return FACTORIES[name]()
