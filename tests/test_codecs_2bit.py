"""The 2-bit codecs: sparse2bit (SparseLoCo's top-k recipe) and dense2bit (MuLoCo's 2-bit dense
code): wire size, what they keep, refusal of malformed payloads, and error feedback losing nothing.
Their round-trip error bounds are checked with every codec's in tests/test_streaming.py."""

from __future__ import annotations

import math

import pytest
import torch

from peer.codecs.formats import CodecError, make_codec
from peer.codecs.specs import CODEC_SPECS
from peer.config import OuterOptimizerConfig
from peer.model.grid import ModelConfig
from peer.model.transformer import PathModel
from peer.sync.module_sync import ModuleSync

CHUNK, TOPK = 4096, 92
LOW = 5  # floor(log2(4096 / 92)): low bits per index of a whole chunk
FIRST = TOPK * (LOW + 1) + ((CHUNK - 1) >> LOW)  # bits of a whole chunk's Elias-Fano code: 679


def _gauss(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.01


def _index_bits(data: bytes, numel: int) -> tuple[int, str]:
    """Where sparse2bit's index section starts and its bits (a '0'/'1' string, padding included)."""
    at = 2 + math.ceil(math.ceil(numel / CHUNK) / 2)
    n_bytes = math.ceil(CODEC_SPECS["sparse2bit"].index_bits(numel) / 8)
    return at, "".join(f"{b:08b}" for b in data[at : at + n_bytes])


def _chunks(numel: int) -> list[tuple[int, int]]:
    full, rest = divmod(numel, CHUNK)
    return [(CHUNK, TOPK)] * full + ([(rest, math.ceil(rest * TOPK / CHUNK))] if rest else [])


def _indices(data: bytes, numel: int) -> list[list[int]]:
    """Each chunk's indices, Elias-Fano decoded independently of the codec: per chunk k indices of
    `low` bits each (low = floor(log2(size / k))), then a unary vector whose j-th one stands at
    (index >> low) + j."""
    _, bits = _index_bits(data, numel)
    out, at = [], 0
    for size, k in _chunks(numel):
        low = int(math.floor(math.log2(size / k)))
        lows = [int(bits[at + low * j : at + low * (j + 1)] or "0", 2) for j in range(k)]
        at += low * k
        upper = bits[at : at + k + ((size - 1) >> low)]
        at += len(upper)
        ones = [i for i, c in enumerate(upper) if c == "1"]
        out.append([((p - j) << low) | lows[j] for j, p in enumerate(ones)])
    return out


def _with_index_bits(data: bytes, numel: int, bits: str) -> bytes:
    at, old = _index_bits(data, numel)
    assert len(bits) == len(old)
    packed = bytes(int(bits[i : i + 8], 2) for i in range(0, len(bits), 8))
    return data[:at] + packed + data[at + len(packed) :]


@pytest.mark.parametrize("numel", [1, 63, 64, 65, 4095, 4096, 4097, 3 * 4096 + 1809])
def test_sparse2bit_payload_has_the_tables_exact_size_and_keeps_92_in_4096_per_chunk(numel):
    codec, spec = make_codec("sparse2bit"), CODEC_SPECS["sparse2bit"]
    x = _gauss(numel) + 1e-4  # every value non-zero, so every kept one is sent
    data = codec.encode(x)
    assert len(data) == spec.wire_bytes(numel)
    y = codec.decode(data, numel)
    full, rest = divmod(numel, CHUNK)
    for c in range(full + (1 if rest else 0)):
        part, back = x[c * CHUNK : (c + 1) * CHUNK], y[c * CHUNK : (c + 1) * CHUNK]
        k = TOPK if part.numel() == CHUNK else math.ceil(part.numel() * TOPK / CHUNK)
        top = set(part.abs().topk(k).indices.tolist())
        assert set(back.nonzero().flatten().tolist()) <= top
        assert _indices(data, numel)[c] == sorted(top)  # Elias-Fano, read without the codec
        assert torch.equal(back[list(top)].sign(), part[list(top)].sign())
    with pytest.raises(CodecError, match="bytes"):
        codec.decode(data + b"\0", numel)


def test_sparse2bit_sends_at_least_146x_fewer_bytes_than_fp32_scales_and_indices_included():
    codec, spec = make_codec("sparse2bit"), CODEC_SPECS["sparse2bit"]
    numel = 64 * CHUNK
    data = codec.encode(_gauss(numel))
    bits = 8 * len(data) / numel
    # Covenant-72B: 64 values per chunk with 12-bit indices, 0.219 bits, 146x; Elias-Fano's ~7 bits
    # per index leave room for 92 values and the scales in fewer bytes
    assert bits <= 0.219 and 32 / bits >= 146
    assert abs(8 * spec.wire_bytes_per_value - bits) < 1e-3
    assert int((codec.decode(data, numel) != 0).sum()) == 64 * TOPK


def test_sparse2bit_never_sends_a_chunk_worse_than_not_sending_it():
    """A chunk's one outlier must not drag its other 63 values to a level far above them: the scale
    of least squared error is chosen, sending zeros included."""
    x = torch.full((CHUNK,), 1e-3)
    x[::64] = torch.linspace(1.0, 2.0, 64)
    x[7] = 1000.0
    x = torch.cat([x, _gauss(CHUNK)])
    y = make_codec("sparse2bit").decode(make_codec("sparse2bit").encode(x), x.numel())
    for c in range(2):
        part, back = x[c * CHUNK : (c + 1) * CHUNK], y[c * CHUNK : (c + 1) * CHUNK]
        kept = part.abs().topk(TOPK).indices
        assert float((part[kept] - back[kept]).norm()) < float(part[kept].norm())
    # a scale set by the outlier alone (s = 1000) would send the 91 others at 400 each: error 3.8x;
    # the 2-bit code has no zero, so every kept value costs something, but less than sending nothing
    assert float((x - y).norm() / x.norm()) < 0.97


def test_sparse2bit_refuses_unordered_or_out_of_chunk_indices_and_bad_scales():
    codec = make_codec("sparse2bit")
    numel = CHUNK + 65  # a second chunk of 65 values keeping 2: 5 low bits each, a 4-bit unary vector
    x = _gauss(numel)
    x[10], x[20] = 5.0, 6.0  # two kept indices in the first chunk's first high bucket (0..31)
    data = codec.encode(x)
    codec.decode(data, numel)
    _, bits = _index_bits(data, numel)
    assert _indices(data, numel)[0][:2] == [10, 20]
    # their low bits swapped: 20 then 10, the same set out of order
    swapped = bits[LOW : 2 * LOW] + bits[:LOW] + bits[2 * LOW :]
    with pytest.raises(CodecError, match="strictly increasing"):
        codec.decode(_with_index_bits(data, numel, swapped), numel)
    first = FIRST  # the second chunk's code: lows (5 bits) x 2, then its unary vector (4 bits)
    beyond = bits[:first] + bits[first : first + 5] + "11111" + "1001" + bits[first + 14 :]  # 2nd: 95
    with pytest.raises(CodecError, match="beyond its chunk"):
        codec.decode(_with_index_bits(data, numel, beyond), numel)
    three_ones = bits[:first] + bits[first : first + 10] + "1110" + bits[first + 14 :]
    with pytest.raises(CodecError, match="exactly 2 indices"):
        codec.decode(_with_index_bits(data, numel, three_ones), numel)
    padded = bits[: first + 14] + "1" * (len(bits) - first - 14)
    with pytest.raises(CodecError, match="padding"):
        codec.decode(_with_index_bits(data, numel, padded), numel)
    negative = bytearray(data)
    negative[1] |= 0x80  # the sign bit of the payload's bf16 scale (little-endian)
    with pytest.raises(CodecError, match="negative or not finite"):
        codec.decode(bytes(negative), numel)
    nan = bytearray(data)
    nan[0:2] = (0x7FC0).to_bytes(2, "little")
    with pytest.raises(CodecError, match="negative or not finite"):
        codec.decode(bytes(nan), numel)


def test_dense2bit_sends_every_value_at_2_125_bits_and_refuses_bad_block_scales():
    codec, spec = make_codec("dense2bit"), CODEC_SPECS["dense2bit"]
    x = _gauss(10 * 128 + 17)
    data = codec.encode(x)
    assert len(data) == spec.wire_bytes(x.numel()) and spec.wire_bytes_per_value * 8 == 2.125
    y = codec.decode(data, x.numel())
    assert torch.equal(y.sign(), x.sign())  # 4 levels, none of them 0: every value moves its way
    for scale, fragment in ((b"\x80\xbf", "negative"), (b"\xc0\x7f", "not finite")):
        bad = bytearray(data)
        bad[2 * 10 : 2 * 10 + 2] = scale  # the last (partial) block's bf16 scale
        with pytest.raises(CodecError, match=fragment):
            codec.decode(bytes(bad), x.numel())


@pytest.mark.parametrize("name", ["sparse", "sparse2bit", "dense2bit"])
def test_error_feedback_of_each_feedback_codec_loses_nothing_in_process(name):
    """Two holders, outer SGD lr 1 without momentum, decay 1, plain mean: whatever a holder's payloads
    left out is still in its error buffer, θ̄₀ − θ̄_T = mean over holders of (Σ Δ − e_T), and the
    decoded parts, hence both copies, are the same bits."""
    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=33, blocks_per_module=4)
    outer = OuterOptimizerConfig(lr=1.0, momentum=0.0, nesterov=False)
    codec = make_codec(name)
    assert codec.spec.error_feedback
    models = [PathModel(cfg, (0, 0), seed=6) for _ in range(2)]
    syncs = [ModuleSync(cfg, "l0m0", m.parts["l0m0"], outer, 1) for m in models]
    start = syncs[0].global_flats[0].clone()
    raw = [torch.zeros(start.numel(), dtype=torch.float64) for _ in syncs]
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        parts = []
        for i, (model, ms) in enumerate(zip(models, syncs, strict=True)):
            with torch.no_grad():
                for p in model.parts["l0m0"].parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
            raw[i] += ms.outer_gradient(0).double()
            corrected = ms.corrected_outer_gradient(0, codec, 1.0)
            sent = codec.decode(codec.encode(corrected), corrected.numel())
            ms.settle_feedback(0, corrected, sent)
            parts.append(sent)
        mean = (parts[0] + parts[1]) / 2
        for ms in syncs:
            ms.apply(0, mean)
    a, b = syncs
    assert torch.equal(a.global_flats[0], b.global_flats[0])
    assert all(float(ms.errors[0].norm()) > 0 for ms in syncs)
    applied = (start - a.global_flats[0]).double()
    kept = sum(r - ms.errors[0].double() for r, ms in zip(raw, syncs, strict=True)) / 2
    assert float((applied - kept).abs().max()) < 1e-5 * float(kept.abs().max())
