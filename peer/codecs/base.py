"""What every codec is: `Codec` (a flat float32 vector to bytes of the exact size its spec gives
and back), `CodecError` (bytes that do not decode), and the block and bf16 helpers codecs share."""

from __future__ import annotations

import math

import numpy as np
import torch

from peer.codecs.specs import CodecSpec


class CodecError(ValueError):
    """Bytes that do not decode to the expected values."""


class Codec:
    """Encodes a flat float32 vector to bytes of the exact size `spec.wire_bytes(numel)`."""

    spec: CodecSpec

    def encode(self, x: torch.Tensor) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        raise NotImplementedError

    def _check(self, data: bytes, numel: int) -> None:
        expected = self.spec.wire_bytes(numel)
        if len(data) != expected:
            raise CodecError(f"{self.spec.name}: {len(data)} bytes, {numel} values need {expected}")


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).to(torch.float32).cpu().contiguous()


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    flat = _flat(x)
    n = flat.numel()
    padded = torch.zeros(math.ceil(n / block) * block)
    padded[:n] = flat
    return padded.view(-1, block), n


def _bf16_bytes(t: torch.Tensor) -> bytes:
    return t.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()


def _bf16_from(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype="<i2").copy()).view(torch.bfloat16).float()


def _pack_nibbles(codes: torch.Tensor) -> bytes:
    codes = codes.reshape(-1).to(torch.uint8)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return ((codes[0::2] << 4) | codes[1::2]).numpy().tobytes()


def _unpack_nibbles(data: bytes, n: int) -> torch.Tensor:
    packed = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    out = torch.empty(packed.numel() * 2, dtype=torch.uint8)
    out[0::2], out[1::2] = packed >> 4, packed & 0x0F
    return out[:n].long()
