"""Downloading a module's state among hostile donors: each donor is a real `SyncService` on its own DHT
node. A poisoned donor (a different state at the same rounds) is refused because other holders do
not confirm it; a slow-loris donor (a header, then a byte now and then) is cut off at the download
deadline; the joiner ends with an honest holder's exact state. With several honest donors the state
comes in pieces from all of them, and pieces stay of one state while the donors' rounds move on."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from peer.codecs.formats import make_codec
from peer.run.admission import AdmissionCheck, sign_admission
from peer.sync import state_fetch, wire
from peer.sync.inbox import Inbox
from peer.sync.service import SyncService
from peer.sync.standing import Standing
from peer.sync.state_fetch import fetch_confirmed
from peer.sync.state_transfer import (
    StateHistory,
    confirmed,
    digests_of,
    download_range,
    install_state_handlers,
)
from peer.sync.wire import Kind
from tests.sync_members import CREATOR, MODULE, RUN_ID

pytestmark = pytest.mark.swarm

NUMELS = [1000, 1000]  # one fragment: θ̄, then its momentum
ROUNDS = [7]


def _service(dht_factory, standing: Standing | None = None) -> SyncService:
    dht, key = dht_factory()
    inbox = Inbox({MODULE: [NUMELS[0]]}, make_codec("fp32"), lambda peer, module: True, 8, 0.0, standing)
    return SyncService(dht, RUN_ID, inbox, stream_timeout_seconds=30, key=key)


def _holder(dht_factory, tensors: list[torch.Tensor], rounds: list[int] = ROUNDS) -> SyncService:
    service = _service(dht_factory)
    history = StateHistory()
    history.record(MODULE, rounds, digests_of(tensors))
    install_state_handlers(service, lambda module: (rounds, tensors) if module == MODULE else None, history)
    return service


def _slow_loris(dht_factory) -> SyncService:
    service = _service(dht_factory)

    async def dribble(sender, body, reader, writer):
        request = wire.parse(wire.StateRequest, body)
        stop = sum(NUMELS) if request.stop is None else request.stop
        header = wire.StateHeader(
            run=service.run,
            module=MODULE,
            fragment_rounds=ROUNDS,
            numels=NUMELS,
            start=request.start,
            stop=stop,
        )
        payload = wire.pack(Kind.PAYLOAD, b"\0" * 4 * (stop - request.start))
        await wire.write(writer, wire.pack_header(Kind.STATE_HEADER, header))
        for i in range(len(payload)):  # one byte a second: never done
            await wire.write(writer, payload[i : i + 1])
            await asyncio.sleep(1.0)

    service.extra_handlers[Kind.STATE_REQUEST] = dribble
    return service


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 256 numbers, so a test state of a few thousand numbers is striped over every donor."""
    monkeypatch.setattr(state_fetch, "MIN_PIECE_NUMBERS", 256)


@pytest.mark.timeout(120)
def test_a_joiner_refuses_a_poisoned_donor_cuts_off_a_slow_one_and_takes_the_honest_state(
    dht_factory, small_pieces
):
    gen = torch.Generator().manual_seed(0)
    honest = [torch.randn(n, generator=gen) for n in NUMELS]
    poisoned = [t.clone() for t in honest]
    poisoned[0][::10] += 100.0  # the same rounds, another state
    services = []
    try:
        slow = _slow_loris(dht_factory)
        bad = _holder(dht_factory, poisoned)
        good = [_holder(dht_factory, honest) for _ in range(3)]
        joiner = _service(dht_factory)
        services = [slow, bad, *good, joiner]
        donors = [s.peer_id for s in (slow, bad, *good)]
        started = time.monotonic()
        got = joiner.submit(
            fetch_confirmed(joiner, MODULE, NUMELS, donors, timeout=3.0, confirm_timeout=3.0)
        ).result(timeout=90)
        seconds = time.monotonic() - started
    finally:
        for s in services:
            s.shutdown()
    assert got is not None
    sources, rounds, tensors, confirmed = got
    # the striped attempt took a poisoned piece from `bad` and was refused as a whole; then, whole
    # states one donor after another: the slow one cut off, the poisoned one refused, the first good one
    assert sources == [good[0].peer_id] and confirmed and rounds == ROUNDS
    assert all(torch.equal(a, b) for a, b in zip(tensors, honest, strict=True))
    assert joiner.refused["unconfirmed"] == 2
    assert seconds < 30  # the slow donor cost a download deadline each time, not its whole dribble


class MovingHolder:
    """A holder whose copy moves on to the next round right after it served its first pieces (one per
    stream a joiner opens to it at once)."""

    def __init__(self, dht_factory, before: list[torch.Tensor], after: list[torch.Tensor]):
        self.service = _service(dht_factory)
        self.states = [(ROUNDS, before), ([ROUNDS[0] + 1], after)]
        self.served = 0
        history = StateHistory()
        for rounds, tensors in self.states:
            history.record(MODULE, rounds, digests_of(tensors))
        install_state_handlers(self.service, self.snapshot, history)

    def snapshot(self, module: str):
        state = self.states[0 if self.served < state_fetch.STREAMS_PER_DONOR else 1]
        self.served += 1
        return state


def _fetch(joiner: SyncService, donors: list[str]):
    coro = fetch_confirmed(joiner, MODULE, LARGE, donors, timeout=5.0, confirm_timeout=3.0)
    return joiner.submit(coro).result(timeout=60)


LARGE = [4096, 4096]  # 32 pieces of 256 numbers


@pytest.mark.timeout(90)
def test_a_joiner_takes_pieces_of_the_state_from_every_donor_at_once(dht_factory, small_pieces):
    gen = torch.Generator().manual_seed(1)
    state = [torch.randn(n, generator=gen) for n in LARGE]
    donors, joiner = [], None
    try:
        donors = [_holder(dht_factory, state) for _ in range(4)]
        joiner = _service(dht_factory)
        got = _fetch(joiner, [d.peer_id for d in donors])
        sent = [d.bytes_sent for d in donors]
    finally:
        for s in [*donors, joiner]:
            if s is not None:
                s.shutdown()
    assert got is not None and got.confirmed and got.rounds == ROUNDS
    assert sorted(got.donors) == sorted(d.peer_id for d in donors)
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, state, strict=True))
    # every donor served a share, and together no more than the state (plus frame headers)
    assert all(s > 0 for s in sent) and sum(sent) < 4 * sum(LARGE) * 1.05


@pytest.mark.timeout(90)
def test_pieces_stay_of_one_state_while_the_donors_copies_move_on(dht_factory, small_pieces):
    gen = torch.Generator().manual_seed(2)
    before = [torch.randn(n, generator=gen) for n in LARGE]
    after = [t + 1.0 for t in before]
    holders, joiner = [], None
    try:
        holders = [MovingHolder(dht_factory, before, after) for _ in range(2)]
        joiner = _service(dht_factory)
        got = _fetch(joiner, [h.service.peer_id for h in holders])
    finally:
        for s in [*(h.service for h in holders), joiner]:
            if s is not None:
                s.shutdown()
    # both donors kept serving the state they started with: the pieces add up to it, from both
    assert got is not None and got.rounds == ROUNDS and len(got.donors) == 2
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, before, strict=True))


def _states(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    honest = [torch.randn(n, generator=gen) for n in NUMELS]
    return honest, [t + 1.0 for t in honest]


@pytest.mark.timeout(90)
def test_no_yes_on_a_tie_or_on_unknowns_and_a_sole_sender_or_the_joiner_never_confirms_itself(dht_factory):
    honest, other = _states(3)
    services = []
    try:
        yes, no, unknown = _holder(dht_factory, honest), _holder(dht_factory, other), _service(dht_factory)
        joiner = _service(dht_factory)
        services = [yes, no, unknown, joiner]
        digests = digests_of(honest)

        def ask(confirmers: list[SyncService]) -> bool:
            ids = [c.peer_id for c in confirmers]
            return joiner.submit(confirmed(joiner, MODULE, ROUNDS, digests, ids, 2.0)).result(timeout=60)

        assert ask([yes])
        assert not ask([yes, no])  # a tie is not a yes
        assert not ask([unknown])  # "unknown" is not a yes
        # one donor, one other holder that never had that state: refused, not loaded on the donor's word
        fetched = joiner.submit(
            fetch_confirmed(joiner, MODULE, NUMELS, [yes.peer_id], 3.0, 1.0, holders=[unknown.peer_id])
        ).result(timeout=60)
        assert fetched is None
        # the donor alone, nobody else to ask: the only voice there is, loaded and said to be unconfirmed
        alone = joiner.submit(fetch_confirmed(joiner, MODULE, NUMELS, [yes.peer_id], 3.0, 1.0)).result(
            timeout=60
        )
        assert alone is not None and not alone.confirmed
        # lists that name the joiner itself (a round's members ahead can): it is neither a donor nor
        # a confirmer of its own download, so the donor is still the only voice
        me = joiner.peer_id
        named = joiner.submit(
            fetch_confirmed(joiner, MODULE, NUMELS, [me, yes.peer_id], 3.0, 1.0, holders=[me])
        ).result(timeout=60)
        assert named is not None and named.donors == [yes.peer_id] and not named.confirmed
    finally:
        for s in services:
            s.shutdown()


@pytest.mark.timeout(120)
def test_strangers_ahead_of_admitted_holders_neither_set_nor_confirm_a_joiners_state(
    dht_factory, small_pieces
):
    honest, poisoned = _states(4)
    tokens: dict[str, str] = {}
    check = AdmissionCheck(RUN_ID, CREATOR.get_public_key().to_bytes())
    services = []
    try:
        admitted = [_holder(dht_factory, honest) for _ in range(2)]
        # two fresh keys serve and vouch for the same made-up state, a million rounds ahead
        sybils = [_holder(dht_factory, poisoned, rounds=[10**6]) for _ in range(2)]
        for s in admitted:
            tokens[s.peer_id] = sign_admission(CREATOR, RUN_ID, s.peer_id, "invite")
        joiner = _service(dht_factory, Standing(check, "open", lambda peer: tokens.get(peer, "")))
        services = [*admitted, *sybils, joiner]
        donors = [s.peer_id for s in (*sybils, *admitted)]  # the sybils first, as their claims are ahead
        got = joiner.submit(fetch_confirmed(joiner, MODULE, NUMELS, donors, 3.0, 2.0)).result(timeout=90)
    finally:
        for s in services:
            s.shutdown()
    assert got is not None and got.confirmed and got.rounds == ROUNDS
    assert set(got.donors) <= {s.peer_id for s in admitted}
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, honest, strict=True))


def test_a_holder_serves_a_peer_asking_for_its_state_again_and_again_only_at_that_peers_rate(dht_factory):
    """A 100-byte request must not buy a whole state upload whenever the asker likes: beyond its own
    rate (here one state per second) the holder answers "busy" at once and uploads nothing."""
    from dht.serve_limits import ServeLimits, ServeLimitSettings

    tensors = [torch.randn(n) for n in NUMELS]
    state_bytes = 4 * sum(NUMELS)
    limits = ServeLimits(ServeLimitSettings(1e9, 8, state_bytes, 4, 0.5))
    holder = _service(dht_factory)
    history = StateHistory()
    history.record(MODULE, ROUNDS, digests_of(tensors))
    install_state_handlers(holder, lambda m: (ROUNDS, tensors) if m == MODULE else None, history, limits)
    asker = _service(dht_factory)

    def ask():
        return asker.call(download_range(asker, holder.peer_id, MODULE, NUMELS, 0, sum(NUMELS), 10), 30)

    rounds, numbers = ask()
    assert rounds == ROUNDS and numbers.tobytes() == torch.cat(tensors).numpy().tobytes()
    ask()  # the first second's tokens, then in debt by one state
    sent = holder.bytes_sent
    with pytest.raises(wire.WireError, match="busy: over"):
        ask()
    assert holder.bytes_sent - sent < 1000  # the refusal, not the state
    time.sleep(2.2)  # the debt paid at one state per second
    assert ask()[0] == ROUNDS


def test_a_confirmer_past_the_rounds_without_that_state_says_so_and_is_not_asked_again(dht_factory):
    """A holder that is past the state's rounds and never held it will never confirm it: it says so,
    and the download is refused at once instead of after four tries over five seconds (a restarted
    churn peer spent 5 s per refused state so, twice per restart). A holder behind those rounds may
    still get there, so it is asked again."""
    honest, other = _states(3)
    services = []
    try:
        past, behind = _holder(dht_factory, other, rounds=[9]), _holder(dht_factory, other, rounds=[5])
        joiner = _service(dht_factory)
        services = [past, behind, joiner]
        digests = digests_of(honest)

        def ask(confirmer: SyncService) -> tuple[bool, float]:
            started = time.monotonic()
            coro = confirmed(joiner, MODULE, ROUNDS, digests, [confirmer.peer_id], 2.0)
            return joiner.submit(coro).result(timeout=60), time.monotonic() - started

        (said_past, fast), (said_behind, slow) = ask(past), ask(behind)
    finally:
        for s in services:
            s.shutdown()
    assert not said_past and not said_behind
    assert fast < 1.5 <= 4.0 < slow, (fast, slow)
