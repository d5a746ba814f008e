"""The codecs of `peer.codecs.specs`, installed into hivemind's compression registry.

hivemind picks a codec by a fixed protobuf enum (`runtime_pb2.CompressionType`), so a codec of ours
takes over one of its slots in every process of every peer. We take the three 8-bit slots, whose
hivemind codecs fail under numpy >= 2.4 (they `int()` a one-element array) and which pathswarm
therefore never uses as hivemind shipped them. The slot of the run's codec is recorded in the
manifest, so peers of an incompatible version refuse to join instead of misreading each other.

Every codec decodes to float32; sums are accumulated in fp32 by the reducer. `extract` checks the
buffer length against the declared shape before reading it: a part from another peer is untrusted.

| name | bits | how | slot |
|---|---|---|---|
| fp32 | 32 | raw | NONE |
| fp16 | 16 | hivemind Float16 | FLOAT16 |
| int8 | 8 | bitsandbytes blockwise dynamic, block 256 | BLOCKWISE_8BIT |
| nf4 | 4 | bitsandbytes NF4 blockwise, block 64 | QUANTILE_8BIT |
| e3m0 | 4 | sign + 3-bit exponent, block absmax (Streaming DiLoCo's format), block 64 | UNIFORM_8BIT |
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import runtime_pb2

from peer.codecs.specs import CODEC_SPECS, CodecSpec, codec_spec

CT = runtime_pb2.CompressionType


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    flat = x.detach().reshape(-1).float().cpu()
    n = flat.numel()
    padded = torch.zeros(math.ceil(n / block) * block) if n % block else flat.clone()
    padded[:n] = flat
    return padded.view(-1, block), n


def _pack_nibbles(codes: torch.Tensor) -> bytes:
    codes = codes.reshape(-1).to(torch.uint8)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return ((codes[0::2] << 4) | codes[1::2]).numpy().tobytes()


def _encode(
    codec: CompressionBase, shape: torch.Size, absmax: torch.Tensor, payload: bytes
) -> runtime_pb2.Tensor:
    """Our wire format: one float32 scale per block, then the codes; decoded dtype is float32."""
    return runtime_pb2.Tensor(
        compression=codec.compression_type,
        buffer=absmax.float().numpy().tobytes() + payload,
        size=shape,
        dtype="float32",
        requires_grad=False,
    )


def _decode(
    serialized: runtime_pb2.Tensor, block: int, payload_bytes: Callable[[int], int]
) -> tuple[torch.Size, torch.Tensor, bytes]:
    """Shape, block scales and code bytes of an untrusted message, after checking its length
    (`payload_bytes(n)`: the code bytes n numbers take)."""
    shape = torch.Size(serialized.size)
    n_blocks = math.ceil(shape.numel() / block)
    if len(serialized.buffer) != 4 * n_blocks + payload_bytes(shape.numel()) or serialized.dtype != "float32":
        raise ValueError(f"codec: {len(serialized.buffer)} bytes do not fit shape {tuple(shape)}")
    absmax = torch.from_numpy(np.frombuffer(serialized.buffer[: 4 * n_blocks], dtype=np.float32).copy())
    return shape, absmax, serialized.buffer[4 * n_blocks :]


def _unpack_nibbles(data: bytes, n: int) -> torch.Tensor:
    packed = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    out = torch.empty(packed.numel() * 2, dtype=torch.uint8)
    out[0::2], out[1::2] = packed >> 4, packed & 0x0F
    return out[:n].long()


class _BlockCodec(CompressionBase):
    """A 4-bit codec: per block a float32 absmax, then one nibble per value."""

    spec: CodecSpec
    block: int
    levels: torch.Tensor  # 16 ascending code values in [-1, 1], indexed by nibble

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        blocks, n = _blocks(tensor, self.block)
        absmax = blocks.abs().amax(1).clamp(min=1e-30)
        normalized = (blocks / absmax[:, None]).reshape(-1)
        # levels ascend, so the nearest level is found by bucketing against the midpoints: O(n) memory
        codes = torch.bucketize(normalized, (self.levels[1:] + self.levels[:-1]) / 2)
        return _encode(self, tensor.shape, absmax, _pack_nibbles(codes[:n]))

    def extract(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        shape, absmax, payload = _decode(serialized, self.block, lambda n: math.ceil(n / 2))
        n = shape.numel()
        codes = _unpack_nibbles(payload, n)
        values = self.levels[codes]
        scale = absmax.repeat_interleave(self.block)[:n]
        return (values * scale).reshape(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.spec.wire_bytes_per_value / 4


class NF4Codec(_BlockCodec):
    """NormalFloat4 (Dettmers et al. 2023): quantiles of a normal distribution, the code bitsandbytes
    uses; quantised here with the same table and block size 64, on any device."""

    spec = CODEC_SPECS["nf4"]
    compression_type = CT.Value(spec.hivemind_slot)
    block = spec.block

    def __init__(self):
        # bitsandbytes' NF4 table (bitsandbytes.functional.get_4bit_type("nf4")), in nibble order.
        self.levels = torch.tensor(
            [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]
        )  # fmt: skip


class E3M0Codec(_BlockCodec):
    """Sign and a 3-bit exponent, no mantissa: |x|/absmax rounds to one of {0, 2^-6, ..., 2^0}
    (Streaming DiLoCo quantises outer gradients to E3M0)."""

    spec = CODEC_SPECS["e3m0"]
    compression_type = CT.Value(spec.hivemind_slot)
    block = spec.block

    def __init__(self):
        magnitudes = [0.0] + [2.0**-e for e in range(6, -1, -1)]  # 8 levels
        self.levels = torch.tensor(sorted([-m for m in magnitudes] + magnitudes))  # -0 and 0 both kept


class Blockwise8BitCodec(CompressionBase):
    """bitsandbytes' blockwise dynamic 8-bit quantisation (block 256), decoded to float32."""

    spec = CODEC_SPECS["int8"]
    compression_type = CT.Value(spec.hivemind_slot)
    block = spec.block

    def __init__(self):
        import bitsandbytes.functional as bnb_f

        self._f = bnb_f
        self._code = bnb_f.create_dynamic_map(signed=True)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        flat = tensor.detach().reshape(-1).float().cpu().contiguous()
        q, state = self._f.quantize_blockwise(flat, code=self._code, blocksize=self.block)
        return _encode(self, tensor.shape, state.absmax, q.numpy().tobytes())

    def extract(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        shape, absmax, payload = _decode(serialized, self.block, lambda n: n)
        q = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
        if shape.numel() == 0:
            return torch.zeros(shape)
        out = self._f.dequantize_blockwise(q, absmax=absmax, code=self._code, blocksize=self.block)
        return out.float().reshape(shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.spec.wire_bytes_per_value / 4


#: codec name -> the class that implements it (slots, sizes and error bounds: peer.codecs.specs)
FACTORIES: dict[str, type[CompressionBase]] = {
    "fp32": NoCompression,
    "fp16": Float16Compression,
    "int8": Blockwise8BitCodec,
    "nf4": NF4Codec,
    "e3m0": E3M0Codec,
}
assert set(FACTORIES) == set(CODEC_SPECS)


def install_codec(name: str) -> CompressionBase:
    """Puts one of our codecs into its hivemind registry slot (idempotent; forked averager processes
    inherit it). Only the run's codec is installed: a part arriving in another slot meets hivemind's
    own codec there and is rejected like any undecodable part."""
    factory, slot = FACTORIES[name], codec_spec(name).hivemind_slot
    registry = hivemind_serialization._BASE_COMPRESSION_TYPES
    if not isinstance(registry.get(slot), factory):
        registry[slot] = factory()
    return registry[slot]


def make_codec(name: str) -> tuple[CompressionBase, float]:
    """The installed codec and its relative error bound."""
    return install_codec(name), codec_spec(name).error_bound
