"""The 4-bit block codecs (nf4, e3m0) value by value: each number goes to its block scale's nearest
level, and the receiver reads back exactly level × scale, whatever the vector's length."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peer.codecs.formats import make_codec


@pytest.mark.parametrize("name", ["nf4", "e3m0"])
@pytest.mark.parametrize("numel", [1, 2, 63, 64, 65, 129, 4099])
def test_each_value_is_sent_as_its_nearest_level_and_read_back_as_level_times_scale(name, numel):
    codec = make_codec(name)
    block, levels = codec.spec.block, codec.levels.numpy().astype(np.float64)
    rng = np.random.default_rng(numel)
    x = (rng.normal(size=numel) * 10.0 ** rng.integers(-6, 2)).astype(np.float32)
    x[::5] = 0.0
    data = codec.encode(torch.from_numpy(x))
    n_blocks = -(-numel // block)
    scales = torch.from_numpy(np.frombuffer(data[: 2 * n_blocks], dtype="<i2").copy())
    scales = scales.view(torch.bfloat16).float().numpy()
    packed = np.frombuffer(data, dtype=np.uint8, offset=2 * n_blocks)
    codes = np.stack([packed >> 4, packed & 0x0F], 1).reshape(-1)[:numel]
    scale_of = np.repeat(scales, block)[:numel].astype(np.float64)
    normalized = np.clip(x / np.where(scale_of > 0, scale_of, 1.0), -1, 1)
    # the nearest level; a value exactly between two takes the lower one
    distance = np.abs(normalized[:, None] - levels[None, :])
    nearest = np.array([np.flatnonzero(d <= d.min() + 1e-12)[0] for d in distance])
    chosen = distance[np.arange(numel), codes]
    assert np.all(chosen <= distance[np.arange(numel), nearest] + 1e-6), name
    decoded = codec.decode(data, numel).numpy()
    expected = (codec.levels.numpy()[codes] * np.repeat(scales, block)[:numel]).astype(np.float32)
    assert decoded.dtype == np.float32 and decoded.tobytes() == expected.tobytes()
