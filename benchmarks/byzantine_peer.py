"""A hostile peer for `benchmarks.byzantine`: pathswarm's own peer process, except that every outer
gradient it offers (or the weight it claims for it) is forged just before it goes on the wire.

Benchmark-only: nothing in `peer/` knows about it. Run as `python -m benchmarks.byzantine_peer peer ...`
with `PATHSWARM_ATTACK` set to one of `ATTACKS`; everything else is the real CLI, so the attacker
joins, claims, answers and signs like any peer, which is what a real attacker would do.
"""

from __future__ import annotations

import math
import os
import sys

import torch

from peer.cli.main import main as pathswarm_main
from peer.sync.rounds import RoundRunner

ENV_VAR = "PATHSWARM_ATTACK"


def _random_like(delta: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Gaussian noise with 10x the honest outer gradient's norm."""
    noise = torch.randn(delta.shape, generator=gen)
    return noise * (10 * float(delta.norm()) / max(1e-12, float(noise.norm())))


#: name -> (Δ, weight, generator) -> forged (Δ, weight); the README's threat model lists them
ATTACKS = {
    "scaled_x1000": lambda d, w, g: (d * 1000, w),
    "sign_flip": lambda d, w, g: (d * -10, w),
    "random": lambda d, w, g: (_random_like(d, g), w),
    # an honest-looking direction reversed, carried by a claimed token count a million times its own
    "huge_weight": lambda d, w, g: (-d, w * 1e6),
}


def install(attack: str) -> None:
    if attack not in ATTACKS:
        raise SystemExit(f"{ENV_VAR}={attack!r}: choose one of {', '.join(ATTACKS)}")
    forge = ATTACKS[attack]
    honest_start = RoundRunner.start
    gen = torch.Generator().manual_seed(1234)

    def start(self, key, delta, weight, members, state_digest, payload=None):
        forged, claimed = forge(delta.detach().to(torch.float32), float(weight), gen)
        assert math.isfinite(claimed)
        # an encoded payload of the honest Δ is dropped: the runner encodes the forged one
        return honest_start(self, key, forged, claimed, members, state_digest)

    RoundRunner.start = start


if __name__ == "__main__":
    install(os.environ.get(ENV_VAR, ""))
    sys.exit(pathswarm_main(sys.argv[1:]))
