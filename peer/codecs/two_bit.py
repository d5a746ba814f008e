"""The 2-bit codecs of `peer.codecs.specs`: sparse2bit (SparseLoCo's top-k recipe), dense2bit
(MuLoCo's 2-bit dense code) and rotated2bit (dense2bit's levels after a randomized Hadamard rotation).
Each sends 2 bits per value it sends; what it leaves out is the sender's error feedback."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from peer.codecs.base import (
    Codec,
    CodecError,
    _bf16_bytes,
    _bf16_from,
    _blocks,
    _pack_nibbles,
    _unpack_nibbles,
)
from peer.codecs.elias_fano import elias_fano_decode, elias_fano_encode
from peer.codecs.specs import CODEC_SPECS, CodecSpec, elias_fano_bits


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


def hadamard(rows: torch.Tensor) -> torch.Tensor:
    """The unnormalised Walsh-Hadamard transform of each row (a power-of-two length), in butterflies
    of elementwise sums and differences: the same bits on any device and torch version, which a
    matrix product (its summation order is the library's) would not promise."""
    n = rows.shape[1]
    h = 1
    while h < n:
        pairs = rows.reshape(-1, n // (2 * h), 2, h)
        rows = torch.stack([pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]], dim=2)
        rows = rows.reshape(-1, n)
        h *= 2
    return rows


class Rotated2BitCodec(Dense2BitCodec):
    """dense2bit's levels after a randomized Hadamard rotation (EDEN, Vargaftik et al. 2022): each
    block of 128 is multiplied by random signs and rotated (H·D/√128), then coded as dense2bit codes
    a block. Rotated, a block's values are near Gaussian whatever the outer gradient's tails, which
    4 Lloyd-Max levels fit; and since each payload draws its own signs, the members' rounding errors
    are independent and partly cancel in their average. The signs come from SHAKE-128 of the
    payload's 4-byte seed, so every holder decodes the same bits; the seed is a hash of the values
    (deterministic runs, a different draw per sender and round). The last block is padded with
    zeros and sent whole. Layout: seed, all scales, 4 codes per byte."""

    spec = CODEC_SPECS["rotated2bit"]

    def _signs(self, seed: bytes) -> torch.Tensor:
        bits = np.unpackbits(np.frombuffer(hashlib.shake_128(seed).digest(self.spec.block // 8), np.uint8))
        return torch.from_numpy(1.0 - 2.0 * bits.astype(np.float32))

    def encode(self, x: torch.Tensor) -> bytes:
        block = self.spec.block
        blocks, n = _blocks(x, block)
        if n == 0:
            return b""
        seed = hashlib.blake2b(blocks[:32].numpy().tobytes(), digest_size=4).digest()
        rotated = hadamard(blocks * self._signs(seed))  # √block × the orthogonal rotation
        rms = rotated.double().square().mean(1).sqrt().float()
        scales = _bf16_from(_bf16_bytes(rms))
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.bucketize((rotated / safe[:, None]).reshape(-1), self.THRESHOLDS)
        return seed + _bf16_bytes(scales) + _pack_crumbs(codes)

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check(data, numel)
        if numel == 0:
            return torch.zeros(0)
        block, at = self.spec.block, self.spec.header_bytes
        n_blocks = math.ceil(numel / block)
        scales = _bf16_from(data[at : at + 2 * n_blocks])
        if not torch.isfinite(scales).all() or bool((scales < 0).any()):
            raise CodecError("rotated2bit: a block scale is negative or not finite")
        codes = _unpack_crumbs(data[at + 2 * n_blocks :], n_blocks * block).view(n_blocks, block)
        rotated = self.LEVELS[codes] * scales[:, None]
        # H·H = block·I: the inverse rotation is H/block (an exact power of two), then the signs
        return (hadamard(rotated) / block * self._signs(data[:at])).reshape(-1)[:numel]
