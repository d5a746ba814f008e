"""`benchmarks.sparse_outer`'s split code (MuLoCo's unquantized norms): a module's 1-D parameters go in
their own codec and the rest in the run's, and error feedback keeps what either left out."""

from __future__ import annotations

import torch

from benchmarks.sparse_outer_train import _send, _vectors
from peer.codecs.formats import make_codec
from peer.config import OuterOptimizerConfig
from peer.model.grid import ModelConfig
from peer.model.transformer import GridModel
from peer.sync.module_sync import ModuleSync


def test_the_one_dimensional_parameters_go_in_their_own_codec_and_the_rest_in_the_runs():
    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64)
    part = GridModel(cfg, seed=0).path_model((0, 0)).parts["l0m0"]
    ms = ModuleSync(cfg, "l0m0", part, OuterOptimizerConfig(), 1)
    with torch.no_grad():
        for p in part.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    vectors = _vectors(ms, 0)
    one_d = sum(p.numel() for p in part.parameters() if p.dim() == 1)
    assert vectors is not None and int(vectors.sum()) == one_d > 0
    delta = ms.corrected_outer_gradient(0, make_codec("dense2bit"), 1.0)
    two_bit, exact = make_codec("dense2bit"), make_codec("fp32")
    payload, decoded = _send(ms, 0, two_bit, 1.0, vectors, exact)
    decoded = torch.from_numpy(decoded)
    assert torch.equal(decoded[vectors], delta[vectors])  # sent exactly
    rest = delta[~vectors].contiguous()
    assert torch.equal(decoded[~vectors], two_bit.decode(two_bit.encode(rest), rest.numel()).view(-1))
    assert len(payload) == exact.spec.wire_bytes(one_d) + two_bit.spec.wire_bytes(rest.numel())
    # what went out is what the group gets; the unsent rest is kept, none of it on the vectors
    assert torch.equal(ms.errors[0], delta - decoded)
    assert not ms.errors[0][vectors].any() and ms.errors[0][~vectors].abs().sum() > 0
