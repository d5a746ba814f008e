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

4-bit blocks keep their absmax in bfloat16: fp32's range (outer gradients can be tiny) in 2 bytes,
so a number costs 0.53 bytes (7.5x smaller than fp32); its 0.4% rounding is far below the 4-bit
code's own error, and values are normalised by the rounded scale and clamped, so encoding and
decoding use the same scale.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from peer.codecs.elias_fano import elias_fano_decode, elias_fano_encode
from peer.codecs.specs import CODEC_SPECS, CodecSpec, codec_spec, elias_fano_bits


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


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    flat = _flat(x)
    n = flat.numel()
    padded = torch.zeros(math.ceil(n / block) * block)
    padded[:n] = flat
    return padded.view(-1, block), n


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


def _bf16_bytes(t: torch.Tensor) -> bytes:
    return t.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()


def _bf16_from(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype="<i2").copy()).view(torch.bfloat16).float()


class BlockCodec4(Codec):
    """A 4-bit codec: per block a bf16 absmax, then one nibble per value."""

    levels: torch.Tensor  # 16 ascending code values in [-1, 1], indexed by nibble

    @functools.cached_property
    def _midpoints(self) -> list[np.float32]:
        """The 15 midpoints between neighbouring levels: a value's nibble is how many lie below it."""
        return [np.float32(m) for m in ((self.levels[1:] + self.levels[:-1]) / 2).tolist()]

    @functools.cached_property
    def _byte_levels(self) -> np.ndarray:
        """Each of the 256 bytes' two levels (high nibble first), a pair of float32 read as one 8-byte
        item, so that np.take moves whole items."""
        pairs = torch.stack([self.levels.repeat_interleave(16), self.levels.repeat(16)], 1).numpy()
        return pairs.view(np.uint64).reshape(-1)

    def encode(self, x: torch.Tensor) -> bytes:
        block = self.spec.block
        blocks, n = _blocks(x, block)
        scales = _bf16_from(_bf16_bytes(blocks.abs().amax(1)))  # the scale the decoder will see
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        normalized = (blocks / safe[:, None]).clamp(-1, 1).reshape(-1)[:n].numpy()
        # levels ascend, so the nearest level's nibble is the number of midpoints below the value:
        # 15 vector comparisons, a sixth of a binary search's time (torch.bucketize, same codes)
        codes = np.zeros(n, dtype=np.uint8)
        for midpoint in self._midpoints:
            codes += normalized > midpoint
        return _bf16_bytes(scales) + _pack_nibbles(torch.from_numpy(codes))

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check(data, numel)
        block = self.spec.block
        n_blocks = math.ceil(numel / block)
        scales = _bf16_from(data[: 2 * n_blocks])
        if not torch.isfinite(scales).all():
            raise CodecError(f"{self.spec.name}: non-finite block scale")
        # each byte's two levels at once, from a table of all 256 bytes: no per-nibble index array
        packed = np.frombuffer(data, dtype=np.uint8, offset=2 * n_blocks)
        values = np.take(self._byte_levels, packed).view(np.float32)[: n_blocks * block]
        if values.size < n_blocks * block:  # a last block that ends mid-byte or short of a block
            values = np.concatenate([values, np.zeros(n_blocks * block - values.size, np.float32)])
        values = values.reshape(n_blocks, block)
        np.multiply(values, scales.numpy()[:, None], out=values)
        return torch.from_numpy(values.reshape(-1)[:numel])


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


def _pack_crumbs(codes: torch.Tensor) -> bytes:
    """2-bit codes, four to a byte, first in the high bits; the last byte padded with zeros."""
    codes = codes.reshape(-1).to(torch.uint8)
    codes = torch.cat([codes, codes.new_zeros(-codes.numel() % 4)]).view(-1, 4)
    return ((codes[:, 0] << 6) | (codes[:, 1] << 4) | (codes[:, 2] << 2) | codes[:, 3]).numpy().tobytes()


def _unpack_crumbs(data: bytes, n: int) -> torch.Tensor:
    packed = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
    out = torch.stack([(packed >> s) & 3 for s in (6, 4, 2, 0)], dim=1)
    return out.reshape(-1)[:n].long()


class ChunkSparse2BitCodec(Codec):
    """SparseLoCo's recipe (top-k per chunk, 2-bit values), our layout and index code, at the byte
    budget of Covenant-72B's run (1/64 of each chunk, 12-bit indices: 0.219 bits per number).

    Per chunk of 4096 values the 92 largest by magnitude (a partial last chunk of m values: the
    ceil(92·m/4096) largest). Scales: one bf16 reference r per payload (the largest kept magnitude) and per
    chunk a 4-bit code q, its scale s = r·2^-q (q = 15: the chunk is sent as zeros and all of it stays
    in the error feedback); the encoder picks the q of least squared error. A bf16 scale per chunk
    would cost 16 bits; the code costs 4. Each value: a sign bit and a
    magnitude bit, s·0.4 or s (a ratio of 2.5 between the levels: measured on the top 1/64 of chunks,
    1.5 suits Gaussian data best and 4 heavy-tailed Student-t, 2.5 is within 0.1 of the best of both).
    Indices: each chunk's, strictly increasing, Elias-Fano coded (679 bits for 92 of 4096, where
    12-bit indices would take 1,104), so every set has one encoding and a payload one size.
    Layout: r, the chunk codes (nibbles), the index codes (one bit string, zero-padded to a byte),
    the value codes (2 bits each), each part packed whole."""

    LEVELS = (0.4, 1.0)
    ZERO_CHUNK = 15

    def __init__(self, spec: CodecSpec | None = None):
        # a benchmark may vary the density (`topk`); peers of a run use the table's spec
        self.spec = spec or CODEC_SPECS["sparse2bit"]
        if (self.spec.chunk_code_bits, self.spec.bits) != (4, 2):
            raise ValueError(f"{self.spec.name}: this layout packs 4-bit chunk codes and 2-bit values")

    def encode(self, x: torch.Tensor) -> bytes:
        spec = self.spec
        blocks, n = _blocks(x, spec.block)
        if n == 0:
            return b""
        chunks = self.spec.chunk_kept(n)
        ks = torch.tensor([k for _, k in chunks])
        magnitude = blocks.abs()
        magnitude.view(-1)[n:] = -1.0  # padding is never picked: a partial chunk keeps <= its size
        top = magnitude.topk(min(spec.topk, spec.block), dim=1).indices  # largest first
        kept = torch.arange(top.shape[1]) < ks[:, None]  # a partial chunk keeps its first ks
        idx = torch.where(kept, top, spec.block).sort(dim=1).values  # kept ones first, ascending
        vals = blocks.gather(1, idx.clamp(max=spec.block - 1)) * kept
        r = _bf16_from(_bf16_bytes(vals.abs().max().reshape(1)))
        q = self._best_codes(vals.abs(), kept, r)
        scales = torch.where(q == self.ZERO_CHUNK, torch.zeros(()), r * torch.pow(2.0, -q.float()))
        lo, hi = self.LEVELS
        codes = (vals < 0).long() * 2 + (vals.abs() > scales[:, None] * (lo + hi) / 2).long()
        return (
            _bf16_bytes(r)
            + _pack_nibbles(q.long())
            + self._pack_indices(idx, chunks)
            + _pack_crumbs(codes[kept])
        )

    def _pack_indices(self, idx: torch.Tensor, chunks: list[tuple[int, int]]) -> bytes:
        """Every chunk's Elias-Fano code in a row (whole chunks at once, then a partial one)."""
        full = sum(1 for m, _ in chunks if m == self.spec.block)
        bits = [elias_fano_encode(idx[:full, : self.spec.topk], self.spec.block).reshape(-1)]
        if full < len(chunks):
            m, k = chunks[-1]
            bits.append(elias_fano_encode(idx[full:, :k], m).reshape(-1))
        return np.packbits(torch.cat(bits).numpy()).tobytes()

    def _unpack_indices(self, data: bytes, chunks: list[tuple[int, int]]) -> torch.Tensor:
        """`_pack_indices` back to the kept values' indices, chunk after chunk; padding must be zero."""
        bits = torch.from_numpy(np.unpackbits(np.frombuffer(data, dtype=np.uint8)).astype(bool))
        full = sum(1 for m, _ in chunks if m == self.spec.block)
        per = elias_fano_bits(self.spec.block, self.spec.topk)
        try:
            parts = [elias_fano_decode(bits[: full * per].view(full, per), self.spec.block, self.spec.topk)]
            at = full * per
            if full < len(chunks):
                m, k = chunks[-1]
                parts.append(elias_fano_decode(bits[at : at + elias_fano_bits(m, k)].view(1, -1), m, k))
                at += elias_fano_bits(m, k)
        except ValueError as e:
            raise CodecError(f"sparse2bit: {e}") from None
        if bool(bits[at:].any()):
            raise CodecError("sparse2bit: the index code's padding bits are not zero")
        return torch.cat([p.reshape(-1) for p in parts])

    def _best_codes(self, magnitude: torch.Tensor, kept: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """Per chunk the scale code of least squared error over its kept values, among r·2^-q for
        q < 15 and sending zeros (15), which it never exceeds: a chunk is never sent worse than not
        at all, whatever the spread of its values."""
        lo, hi = self.LEVELS
        best_q = torch.full((magnitude.shape[0],), self.ZERO_CHUNK, dtype=torch.long)
        best = magnitude.square().sum(1)
        for q in range(self.ZERO_CHUNK):
            s = r * 2.0**-q
            sent = torch.where(magnitude > s * (lo + hi) / 2, hi, lo) * s
            sse = ((sent - magnitude).square() * kept).sum(1)
            best_q = torch.where(sse < best, q, best_q)
            best = torch.minimum(sse, best)
        return best_q

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check(data, numel)
        spec = self.spec
        if numel == 0:
            return torch.zeros(0)
        chunks = spec.chunk_kept(numel)
        ks = [k for _, k in chunks]
        n_chunks, kept = len(ks), sum(ks)
        r = _bf16_from(data[:2])
        if not torch.isfinite(r).all() or bool((r < 0).any()):
            raise CodecError("sparse2bit: the payload's scale is negative or not finite")
        at = 2
        size = math.ceil(n_chunks * spec.chunk_code_bits / 8)
        q = _unpack_nibbles(data[at : at + size], n_chunks)
        at += size
        size = math.ceil(spec.index_bits(numel) / 8)
        idx = self._unpack_indices(data[at : at + size], chunks)
        codes = _unpack_crumbs(data[at + size :], kept)
        lengths = torch.tensor(ks)
        chunk_of = torch.repeat_interleave(torch.arange(n_chunks), lengths)
        sizes = torch.clamp(numel - torch.arange(n_chunks) * spec.block, max=spec.block)
        if bool((idx >= sizes[chunk_of]).any()):
            raise CodecError("sparse2bit: an index lies beyond its chunk")
        same_chunk = chunk_of[1:] == chunk_of[:-1]
        if bool((same_chunk & (idx[1:] <= idx[:-1])).any()):
            raise CodecError("sparse2bit: indices in a chunk must be strictly increasing")
        scales = torch.where(q == self.ZERO_CHUNK, torch.zeros(()), r * torch.pow(2.0, -q.float()))
        levels = torch.tensor(self.LEVELS)[codes & 1] * torch.where(codes >= 2, -1.0, 1.0)
        out = torch.zeros(numel)
        out[chunk_of * spec.block + idx] = levels * scales[chunk_of]
        return out


class Dense2BitCodec(Codec):
    """MuLoCo's 2-bit dense outer gradient, our format: per block of 128 values a bf16 scale, their
    root mean square, and per value one of the 4 Lloyd-Max levels of a unit Gaussian (±0.4528,
    ±1.5104) times it. The RMS, not the absmax, sets the scale: with 4 levels an absmax scale would
    spend them on a block's one outlier. Clipped tails and rounding are the sender's error feedback.
    Layout: all scales, then 4 codes per byte."""

    spec = CODEC_SPECS["dense2bit"]
    LEVELS = torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104])
    THRESHOLDS = torch.tensor([-0.9816, 0.0, 0.9816])

    def encode(self, x: torch.Tensor) -> bytes:
        blocks, n = _blocks(x, self.spec.block)
        if n == 0:
            return b""
        counts = torch.clamp(n - torch.arange(blocks.shape[0]) * self.spec.block, max=self.spec.block)
        rms = (blocks.double().square().sum(1) / counts).sqrt().float()  # padding is not a value
        scales = _bf16_from(_bf16_bytes(rms))
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.bucketize((blocks / safe[:, None]).reshape(-1)[:n], self.THRESHOLDS)
        return _bf16_bytes(scales) + _pack_crumbs(codes)

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check(data, numel)
        n_blocks = math.ceil(numel / self.spec.block)
        scales = _bf16_from(data[: 2 * n_blocks])
        if not torch.isfinite(scales).all() or bool((scales < 0).any()):
            raise CodecError("dense2bit: a block scale is negative or not finite")
        codes = _unpack_crumbs(data[2 * n_blocks :], numel)
        return self.LEVELS[codes] * scales.repeat_interleave(self.spec.block)[:numel]


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
}
assert set(FACTORIES) == set(CODEC_SPECS)


def make_codec(name: str) -> Codec:
    codec_spec(name)  # a clear error for an unknown name
    return FACTORIES[name]()
