"""A hostile peer for `benchmarks.byzantine`: pathswarm's own peer process, with one attack patched in.

Benchmark-only: nothing in `peer/` knows about it. Run as `python -m benchmarks.byzantine_peer peer ...`
with `PATHSWARM_ATTACK` set to one of `ATTACKS` (and `PATHSWARM_COLLUDERS` to how many attackers act
together); everything else is the real CLI, so the attacker joins, claims, answers and signs like any
peer, which is what a real attacker would do.

Attacks on the outer gradient (the attacker is an admitted member, a colluder inside the caps):

* `scaled_x1000`, `sign_flip`, `random`, `huge_weight` — large in norm or weight (they stop at the caps);
* `alie` — "a little is enough" (Baruch et al. 2019): the honest parts' coordinate-wise mean minus z
  standard deviations (z = 1), small enough to pass every norm and distance test;
* `ipm` — inner-product manipulation (Xie et al. 2020): −ε times the honest mean (ε = 0.5);
* `drift` — its own Δ plus half its norm along one fixed direction, round after round;
* `colluding_pair` — two attackers sending ALIE with the z of Baruch et al. for their number.
The rushing ones (alie, ipm, colluding_pair) wait for the honest parts of the round before they send.

Attacks on the protocol, by fresh keys (no admission: on probation in an open run):

* `report_veto` — reports that it received only its own part;
* `stale_takeover` — answers every outer gradient "stale", claims rounds far ahead, serves a made-up
  state (θ̄ = 12345) and confirms any state it is asked about;
* `sybil_repair` — two keys report the same made-up copy every round, serve it, confirm each other;
* `keeper_poison` — claims every module of the grid, asks the keepers to keep its made-up state at
  rounds [10⁶] again and again;
* `two_holder` — a second holder beside a lone honest one: a million times the weight, a hundred
  times the norm, and a 10³⁷ copy reported so that the pair's copies tie.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
from statistics import NormalDist

import torch

from peer.cli.main import main as pathswarm_main

ENV_VAR = "PATHSWARM_ATTACK"
COLLUDERS_VAR = "PATHSWARM_COLLUDERS"
#: the made-up value of every number of a poisoned state
POISON = 12345.0

DELTA_ATTACKS = ("scaled_x1000", "sign_flip", "random", "huge_weight")
INBOUND_ATTACKS = ("alie", "ipm", "drift", "colluding_pair")
PROTOCOL_ATTACKS = ("report_veto", "stale_takeover", "sybil_repair", "keeper_poison", "two_holder")
ATTACKS = DELTA_ATTACKS + INBOUND_ATTACKS + PROTOCOL_ATTACKS
#: attackers an attack takes (acting together)
ATTACKERS = {"colluding_pair": 2, "sybil_repair": 2}


def _random_like(delta: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Gaussian noise with 10x the honest outer gradient's norm."""
    noise = torch.randn(delta.shape, generator=gen)
    return noise * (10 * float(delta.norm()) / max(1e-12, float(noise.norm())))


def _forge(attack: str):
    """(own Δ, weight, honest parts seen, generator) -> forged (Δ, weight)."""
    colluders = int(os.environ.get(COLLUDERS_VAR, "1"))

    def alie(z: float):
        def forge(d, w, honest, g):
            if len(honest) < 2:
                return d, w
            stacked = torch.stack(honest)
            return stacked.mean(0) - z * stacked.std(0), w

        return forge

    def drift(d, w, honest, g):
        direction = torch.randn(d.shape, generator=torch.Generator().manual_seed(d.numel()))
        return d + 0.5 * float(d.norm()) * direction / float(direction.norm()), w

    members = 6  # the benchmark's colluding_pair run: four honest peers and two attackers
    s = math.floor(members / 2 + 1) - colluders
    pair_z = NormalDist().inv_cdf((members - s) / members)
    return {
        "scaled_x1000": lambda d, w, h, g: (d * 1000, w),
        "sign_flip": lambda d, w, h, g: (d * -10, w),
        "random": lambda d, w, h, g: (_random_like(d, g), w),
        # an honest-looking direction reversed, carried by a claimed token count a million times its own
        "huge_weight": lambda d, w, h, g: (-d, w * 1e6),
        "alie": alie(1.0),
        "ipm": lambda d, w, h, g: ((-0.5 * torch.stack(h).mean(0)) if h else -d, w),
        "drift": drift,
        "colluding_pair": alie(pair_z),
        "two_holder": lambda d, w, h, g: (d * 100, w * 1e6),
    }[attack]


def _patch_outer_gradient(attack: str) -> None:
    from peer.sync.rounds import RoundRunner

    forge = _forge(attack)
    rushing = attack in ("alie", "ipm", "colluding_pair")
    colluders = int(os.environ.get(COLLUDERS_VAR, "1"))
    honest_round = RoundRunner._round
    gen = torch.Generator().manual_seed(1234)

    async def round_(self, key, own, weight, members, state_digest, payload=None):
        honest = []
        if rushing:  # wait for the honest parts (all but the other colluders'), then send
            inbox = self.service.inbox
            others = [m for m in members if m != self.me]
            need = max(1, len(others) - (colluders - 1))
            deadline = asyncio.get_running_loop().time() + 0.5 * self.settings.averaging_timeout_seconds

            def enough(slot) -> bool:
                return sum(s != self.me for s in slot.deliveries) >= need

            await inbox.wait(key, enough, deadline)
            honest = [d.delta for s, d in inbox.slot(key).deliveries.items() if s != self.me]
        forged, claimed = forge(own, weight, honest, gen)
        assert math.isfinite(claimed)
        # an encoded payload of the honest Δ is dropped: the round encodes the forged one
        return await honest_round(self, key, forged.to(torch.float32), claimed, members, state_digest, None)

    RoundRunner._round = round_


def _poisoned(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    n = len(tensors) // 2
    return [torch.full_like(t, POISON) for t in tensors[:n]] + [torch.zeros_like(t) for t in tensors[n:]]


def _patch_serve_poison(far_rounds: int | None) -> None:
    """Serve a made-up state (at rounds far ahead, if given), and confirm any state asked about."""
    from peer.sync.path_sync import PathSync

    def snapshot(self, module):
        ms = self.syncs.get(module)
        if ms is None:
            return None
        rounds = [far_rounds] * ms.n_fragments if far_rounds else list(ms.fragment_rounds)
        return rounds, _poisoned(ms.state_tensors())

    PathSync._snapshot = snapshot
    from peer.sync import state_transfer

    honest_install = state_transfer.install_state_handlers

    def install(service, snapshot_fn, history):
        honest_install(service, snapshot_fn, history)
        from peer.sync import wire
        from peer.sync.wire import Ack, Kind

        async def confirm_anything(sender, body, reader, writer):
            wire.parse(wire.Confirm, body)
            await wire.write(writer, wire.pack_header(Kind.ACK, Ack(ok=True)))

        service.extra_handlers[Kind.CONFIRM] = confirm_anything

    state_transfer.install_state_handlers = install
    import peer.sync.path_sync as path_sync

    path_sync.install_state_handlers = install


def _patch_claim(all_modules: bool, far_rounds: int | None) -> None:
    from peer.model.grid import all_module_ids
    from peer.swarm.membership import Membership

    honest_record = Membership.claim_record

    def claim_record(self, leaving=False):
        record = honest_record(self, leaving)
        update = {}
        if all_modules:
            update["modules"] = all_module_ids(self.manifest.model)
        if far_rounds:
            update["module_rounds"] = {m: [far_rounds] * self.manifest.sync.fragments for m in record.modules}
        return record.model_copy(update=update)

    Membership.claim_record = claim_record


def _patch_reports(only_self: bool, fake_copy: bool) -> None:
    """Reports listing only our own part, and/or the digest of a made-up copy (served on request)."""
    import peer.sync.rounds as rounds
    from peer.sync.merge import ReportedCopies
    from peer.sync.module_sync import state_digest

    honest_sign = rounds.sign_report
    made_up: dict[int, tuple[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    def copy_of(numel: int):
        if numel not in made_up:
            copy = (torch.full((numel,), POISON), torch.zeros(numel))
            made_up[numel] = (state_digest(*copy), copy)
        return made_up[numel]

    def sign(report, key, peer_id):
        update = {}
        if only_self:
            update["received"] = {k: v for k, v in report.received.items() if k == peer_id}
        if fake_copy:
            update["state_digest"] = copy_of(_NUMELS.get(report.key.module, 1))[0]
        return honest_sign(report.model_copy(update=update), key, peer_id)

    rounds.sign_report = sign
    honest_find = ReportedCopies.find

    def find(self, module, fragment, digest):
        for known, copy in made_up.values():
            if known == digest:
                return copy
        return honest_find(self, module, fragment, digest)

    ReportedCopies.find = find


_NUMELS: dict[str, int] = {}


def _remember_fragment_sizes() -> None:
    """The made-up copy must be of the fragment's size: learn it from the peer's own sync layer."""
    from peer.sync.path_sync import PathSync

    honest_start = PathSync.start

    def start(self, *args, **kwargs):
        honest_start(self, *args, **kwargs)
        for mid, ms in self.syncs.items():
            _NUMELS[mid] = ms.fragment_size(0)

    PathSync.start = start


def _patch_stale() -> None:
    from peer.sync.inbox import Inbox, Refused

    def stale(self, sender, header):
        raise Refused("stale", "round is over (ours is far ahead)")

    Inbox.check_delta_header = stale


def _patch_keep_requests() -> None:
    """Every few seconds, asks every keeper to keep our (made-up) state of every module we claim."""
    from peer.training.peer import Peer

    honest_start = Peer.start

    def start(self):
        honest_start(self)

        def nag():
            while not self.stop_requested.wait(5.0):
                try:
                    keepers = self.membership.keepers()
                    if keepers:
                        self.sync.hand_over(list(self.sync.syncs), keepers)
                except Exception:
                    pass

        threading.Thread(target=nag, daemon=True).start()

    Peer.start = start


def install(attack: str) -> None:
    global POISON
    if attack not in ATTACKS:
        raise SystemExit(f"{ENV_VAR}={attack!r}: choose one of {', '.join(ATTACKS)}")
    if attack in DELTA_ATTACKS + INBOUND_ATTACKS:
        _patch_outer_gradient(attack)
    elif attack == "report_veto":
        _patch_reports(only_self=True, fake_copy=False)
    elif attack == "stale_takeover":
        _patch_stale()
        _patch_serve_poison(far_rounds=10**6)
        _patch_claim(all_modules=False, far_rounds=10**6)
    elif attack == "sybil_repair":
        _remember_fragment_sizes()
        _patch_reports(only_self=False, fake_copy=True)
        _patch_serve_poison(far_rounds=None)
    elif attack == "keeper_poison":
        _patch_serve_poison(far_rounds=10**6)
        _patch_claim(all_modules=True, far_rounds=10**6)
        _patch_keep_requests()
    elif attack == "two_holder":
        _patch_outer_gradient(attack)
        _remember_fragment_sizes()
        _patch_reports(only_self=False, fake_copy=True)
        POISON = 1e37  # a copy whose mean with an honest one would still pass a finiteness check


if __name__ == "__main__":
    install(os.environ.get(ENV_VAR, ""))
    sys.exit(pathswarm_main(sys.argv[1:]))
