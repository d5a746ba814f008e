"""Elias-Fano codes of sorted index sets, a row per chunk, as bit tensors (sparse2bit's indices).

k strictly increasing indices below m take k·(l + 1) + ((m − 1) >> l) bits, l = ⌊log2(m/k)⌋ (Elias
1974, Fano 1971): close to log2 C(m, k) and fixed by (m, k), so a payload's size stays exact. The
counts live in `peer.codecs.specs` (pure data); packing rows into bytes is the codec's.
"""

from __future__ import annotations

import torch

from peer.codecs.specs import elias_fano_bits, elias_fano_low_bits


def elias_fano_encode(idx: torch.Tensor, size: int) -> torch.Tensor:
    """Rows of strictly increasing indices below `size` (one chunk each, the same count) to their
    Elias-Fano bits, a row each: every index's low bits (high first), then the unary vector of the
    high parts — a one at (index >> low) + rank. Bit counts: `peer.codecs.specs.elias_fano_bits`."""
    rows, kept = idx.shape
    low = elias_fano_low_bits(size, kept)
    lows = (idx[:, :, None] >> torch.arange(low - 1, -1, -1)) & 1
    upper = torch.zeros(rows, elias_fano_bits(size, kept) - kept * low, dtype=torch.long)
    upper.scatter_(1, (idx >> low) + torch.arange(kept), 1)
    return torch.cat([lows.reshape(rows, kept * low), upper], dim=1).bool()


def elias_fano_decode(bits: torch.Tensor, size: int, kept: int) -> torch.Tensor:
    """`elias_fano_encode`'s rows back to indices; a unary vector without exactly `kept` ones is
    refused with a ValueError (the caller checks order and range)."""
    rows = bits.shape[0]
    low = elias_fano_low_bits(size, kept)
    lows = bits[:, : kept * low].long().view(rows, kept, low)
    lows = (lows << torch.arange(low - 1, -1, -1)).sum(2)
    upper = bits[:, kept * low :]
    if bool((upper.sum(1) != kept).any()):
        raise ValueError(f"a chunk's index code does not hold exactly {kept} indices")
    ranks = upper.nonzero()[:, 1].view(rows, kept)  # row-major: each row's ones in order
    return ((ranks - torch.arange(kept)) << low) | lows
