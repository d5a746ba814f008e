"""What other holders sent this peer for its rounds: outer gradients and reports, validated and bounded.

The inbox accepts a message only for a module this peer holds, from a peer the claim view says holds
it too (and, in an invite run, that the run's creator admitted: `peer.sync.standing`), for a round
inside the window [current, current + LOOKAHEAD_ROUNDS] of that fragment (a faster holder may be a
round or two ahead; older rounds are over). Each sender gets one delivery per round; reports are
signed and kept per reporter, whoever relayed them (`peer.sync.reports`: two different ones from one
reporter are the evidence that it equivocated); the number of senders per round is capped; a payload
is decoded and checked (finite, norm bound) before it counts. Messages are kept until their round is
applied, the last rounds' parts a while longer (for members that missed one the group agreed on). A
sender whose parts fail those checks BAN_AFTER_BAD_PARTS times, or caught sending different reports,
is refused outright for BAN_SECONDS: it costs us nothing more, and every round leaves it out.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from peer.codecs.formats import Codec, CodecError
from peer.sync.aggregate import exact_norm
from peer.sync.reports import RoundReports
from peer.sync.standing import Standing
from peer.sync.wire import DeltaHeader, Report

logger = logging.getLogger(__name__)

#: rounds ahead of a fragment's current round that are buffered (a holder may run ahead this far)
LOOKAHEAD_ROUNDS = 2

Key = tuple[str, int, int]  # (module, fragment, round)

#: refusals that only a broken or hostile sender earns (stale, ahead, duplicate, full happen to honest ones)
HOSTILE_REASONS = frozenset({"shape", "dtype", "nonfinite", "norm", "equivocation"})
#: decided rounds whose parts stay available to members that missed one the group agreed on
RECENT_ROUNDS_KEPT = 64
#: hostile refusals after which a sender is banned, and for how long
BAN_AFTER_BAD_PARTS = 3
BAN_SECONDS = 600.0


def delivery_digest(weight: float, admission: str, payload: bytes) -> str:
    """What members compare to see that a sender sent everyone the same thing (its weight and
    standing included, so that every member weighs it alike)."""
    head = repr(float(weight)).encode() + b"\0" + admission.encode() + b"\0"
    return hashlib.sha256(head + payload).hexdigest()


@dataclass
class Delivery:
    """One member's outer gradient for one round, decoded and checked; `payload` as it came (for a
    member that missed it)."""

    sender: str
    weight: float
    digest: str
    delta: torch.Tensor
    wire_bytes: int
    admission: str = ""
    payload: bytes = b""


class Refused(Exception):
    """A message the inbox does not take; `reason` goes into the sender's ACK and our counters."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class _Slot:
    """Everything received for one round key, and an event set on each arrival."""

    deliveries: dict[str, Delivery] = field(default_factory=dict)
    reports: RoundReports = field(default_factory=RoundReports)
    #: members whose echo (the reports they hold) arrived
    echoes: set[str] = field(default_factory=set)
    #: senders whose outer gradient we refused (malformed, non-finite, banned): not waited for
    refused: dict[str, str] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: the members our round counted when it was decided (None: not decided): an outer gradient from
    #: anyone else comes too late to be in it and is refused as stale, so its sender (a holder that
    #: just joined, whom we did not see yet) stops waiting for ours and takes our state
    decided_with: frozenset[str] | None = None
    #: members that said they send nothing more for this round (they sent it already): not waited for
    sat_out: set[str] = field(default_factory=set)
    #: senders whose header we accepted and whose payload is still coming: on its way, not late
    #: (`stragglers.py`: a slow link is not a silent member)
    incoming: set[str] = field(default_factory=set)
    #: the senders of `deliveries`, replaced whole on each arrival: the training thread reads it
    #: (`Inbox.senders`) while the service's loop adds to the dictionary
    senders: frozenset[str] = frozenset()


class Inbox:
    """Deliveries and reports by round key; lives on the sync service's event loop."""

    def __init__(
        self,
        fragment_sizes: dict[str, list[int]],
        codec: Codec,
        is_holder: Callable[[str, str], bool],
        max_senders: int,
        max_delta_norm: float,
        standing: Standing | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.fragment_sizes = fragment_sizes
        self.codec = codec
        self.is_holder = is_holder
        self.max_senders = max_senders
        self.max_delta_norm = max_delta_norm
        self.standing = standing or Standing(None, "open")
        self.clock = clock
        self.current: dict[tuple[str, int], int] = {}
        self._slots: dict[Key, _Slot] = {}
        #: the parts of decided rounds, for members that missed one the group agreed on
        self._recent: OrderedDict[Key, dict[str, Delivery]] = OrderedDict()
        #: our own signed reports of recent rounds, for a member whose copy of the push was lost
        self._own_reports: OrderedDict[Key, Report] = OrderedDict()
        #: module -> peer -> rounds of ours whose agreed senders included it (what an authority asks)
        self.accepted: dict[str, Counter[str]] = {}
        #: peer -> modules it said it stopped holding (moving or leaving), until it sends a part again
        self._byes: dict[str, set[str]] = {}
        #: the highest round another holder announced per fragment (a hint that we fell behind)
        self.seen_ahead: dict[tuple[str, int], int] = {}
        #: per fragment, holder -> the last round of ours over when its part for it came (a holder
        #: behind us), the `max_senders` latest holders only: keys that held a claim once cannot grow it
        self.came_after: dict[tuple[str, int], dict[str, int]] = {}
        #: module -> holder -> when it last offered us an outer gradient (it is active in the module)
        self.active: dict[str, dict[str, float]] = {}
        self._strikes: dict[str, int] = {}
        self._banned_until: dict[str, float] = {}
        #: peer -> when a round of ours last failed to reach it (`unreachable`, `failed_within`)
        self._unreachable: OrderedDict[str, float] = OrderedDict()

    def strike(self, sender: str, reason: str) -> None:
        """Counts a refusal against `sender`; the BAN_AFTER_BAD_PARTS-th hostile one bans it."""
        if reason not in HOSTILE_REASONS:
            return
        self._strikes[sender] = self._strikes.get(sender, 0) + 1
        if self._strikes[sender] >= BAN_AFTER_BAD_PARTS:
            self._strikes.pop(sender)
            self.ban(sender)
            logger.warning(f"banned {sender} for {BAN_SECONDS:.0f} s: {BAN_AFTER_BAD_PARTS} bad parts")

    def banned(self, sender: str) -> bool:
        if (until := self._banned_until.get(sender)) is not None and self.clock() >= until:
            del self._banned_until[sender]  # served its time
        return sender in self._banned_until

    def active_holders(self, module: str, within_seconds: float) -> list[str]:
        """Holders that offered outer gradients of `module` lately (readable from any thread)."""
        now = time.monotonic()
        recent = dict(self.active.get(module, {})).items()
        return [p for p, t in recent if now - t <= within_seconds and self.is_holder(p, module)]

    def served_state(self, module: str, peers: Iterable[str]) -> None:
        """`peers` sent us `module`'s state and we loaded it: they hold it as surely as a part of it
        would say, so they count as heard from for it (`unproven`). A peer that just moved onto the
        module has had no part of it yet; without this its first rounds left out the very holder it
        downloaded from (under the unproven holders' budget) and applied their own Δ beside its."""
        for peer in peers:
            self.active.setdefault(module, {})[peer] = time.monotonic()

    def unproven(self, peers: Iterable[str], within_seconds: float, module: str | None = None) -> list[str]:
        """Which of `peers` (holders by their claims) neither have standing nor offered us a part (of
        `module`, or of any module) lately: a claim costs a free key nothing, so nothing yet says they
        are peers at all."""
        modules = [module] if module is not None else list(self.active)
        recent: dict[str, float] = {}
        for m in modules:
            for p, t in list(self.active.get(m, {}).items()):
                recent[p] = max(t, recent.get(p, -math.inf))
        now = time.monotonic()
        return sorted(
            p
            for p in set(peers)
            if now - recent.get(p, -math.inf) > within_seconds and not self.standing.admitted(p)
        )

    def unreachable(self, peer: str) -> None:
        """A round of ours could not reach `peer` (no connection, or it stalled)."""
        self._unreachable[peer] = time.monotonic()
        self._unreachable.move_to_end(peer)
        if len(self._unreachable) > 4 * self.max_senders:  # bounded: the oldest failures go first
            self._unreachable.popitem(last=False)

    def failed_within(self, peers: Iterable[str], within_seconds: float) -> set[str]:
        """Which of `peers` a round of ours failed to reach in the last `within_seconds`."""
        now = time.monotonic()
        return {p for p in peers if now - self._unreachable.get(p, -math.inf) <= within_seconds}

    def heard(self, peers: Iterable[str], within_seconds: float) -> list[str]:
        return sorted(set(peers) - set(self.unproven(peers, within_seconds)))  # less the `unproven` ones

    def slot(self, key: Key) -> _Slot:
        if key not in self._slots:
            self._slots[key] = _Slot()
        return self._slots[key]

    def set_current(self, module: str, fragment: int, round_index: int) -> None:
        """The fragment's next round is `round_index`: drop what belongs to earlier rounds."""
        self.current[(module, fragment)] = round_index
        for key in [k for k in self._slots if k[0] == module and k[1] == fragment and k[2] < round_index]:
            self._slots.pop(key)

    def senders(self, key: Key) -> frozenset[str]:
        """Who sent us a part for round `key` so far; safe to call from another thread."""
        return slot.senders if (slot := self._slots.get(key)) is not None else frozenset()

    def keep_parts(self, key: Key, parts: dict[str, Delivery]) -> None:
        """Keeps the parts a round agreed on a while, for members that missed some of them."""
        _keep_latest(self._recent, key, dict(parts))

    def keep_own_report(self, key: Key, report: Report) -> None:
        """Keeps our signed report of round `key` for members that ask for it (`Kind.REPORT_REQUEST`)."""
        _keep_latest(self._own_reports, key, report)

    def check_asker(self, asker: str, module: str) -> None:
        """Raises `Refused` unless `asker` holds `module` and may take part: whom parts go to."""
        if not self.is_holder(asker, module) or not self.standing.takes_part(asker):
            raise Refused("not_holder", f"{asker} holds no claim on {module}")

    def own_report(self, asker: str, key: Key) -> Report | None:
        """Our report of round `key` for `asker` (`check_asker`, not banned); None if none signed yet."""
        if self.banned(asker):
            raise Refused("banned", f"{asker} sent too many bad parts")
        self.check_asker(asker, key[0])
        return self._own_reports.get(key)

    def part(self, key: Key, sender: str, digest: str) -> Delivery | None:
        """`sender`'s part of round `key` with `digest`, if we have it (live or recently decided)."""
        for source in (self._slots.get(key), self._recent.get(key)):
            got = (source.deliveries if isinstance(source, _Slot) else source or {}).get(sender)
            if got is not None and got.digest == digest:
                return got
        return None

    def note_bye(self, sender: str, modules: list[str]) -> None:
        """`sender` stopped holding `modules`: rounds stop waiting for it at once."""
        if len(self._byes) >= 4 * self.max_senders and sender not in self._byes:
            self._byes.pop(next(iter(self._byes)))
        self._byes.setdefault(sender, set()).update(m for m in modules if m in self.fragment_sizes)
        for key, slot in self._slots.items():
            if key[0] in modules:
                slot.changed.set()

    def hold(self, fragment_sizes: dict[str, list[int]]) -> None:
        """The modules we hold from now on (a move); BYEs for those taken up again are forgotten."""
        taken_up = set(fragment_sizes) - set(self.fragment_sizes)
        for modules in list(self._byes.values()):  # from our last visit: see docs/sync-protocol.md
            modules.difference_update(taken_up)
        self.fragment_sizes = fragment_sizes

    def note_sat_out(self, sender: str, key: Key) -> None:
        """`sender` sends no part or report for round `key` (checked: a holder, within our window)."""
        (slot := self.slot(key)).sat_out.add(sender)
        slot.changed.set()

    def holds_up(self, member: str, key: Key) -> bool:
        """Whether `member` sits out a round of ours other than `key` but of its fragment, which we are
        not past: its training waits at that round's end until we are, so its part of `key` comes late."""
        rounds = ((k, s) for k, s in self._slots.items() if k[1] == key[1] and k != key)
        return any(k[2] >= self.current.get(k[:2], 0) and member in s.sat_out for k, s in rounds)

    def note_hello(self, sender: str, modules: list[str]) -> None:
        """`sender`'s claim on `modules` was read after it said HELLO: it holds them again."""
        self._byes.get(sender, set()).difference_update(modules)

    def gone(self, peer: str, module: str) -> bool:
        """Whether `peer` no longer holds `module`: it said so, or its claim no longer lists it."""
        return module in self._byes.get(peer, ()) or not self.is_holder(peer, module)

    def note_accepted(self, module: str, senders: list[str]) -> None:
        counts = self.accepted.setdefault(module, Counter())
        counts.update(s for s in senders)
        if len(counts) > 4 * self.max_senders:  # bounded: the peers seen least go first
            for peer, _ in counts.most_common()[4 * self.max_senders :]:
                del counts[peer]

    def check_key(
        self, sender: str, module: str, fragment: int, round_index: int, token: str | None = None
    ) -> Key:
        if self.banned(sender):
            raise Refused("banned", f"{sender} sent too many bad parts")
        sizes = self.fragment_sizes.get(module)
        if sizes is None:
            raise Refused("not_held", f"we do not hold {module}")
        if not 0 <= fragment < len(sizes):
            raise Refused("shape", f"{module} has no fragment {fragment}")
        if not self.is_holder(sender, module):
            raise Refused("not_holder", f"{sender} holds no claim on {module}")
        if not self.standing.takes_part(sender, token):
            raise Refused("not_admitted", f"{sender} is not admitted to this invite-only run")
        self.active.setdefault(module, {})[sender] = time.monotonic()
        current = self.current.get((module, fragment), 0)
        if round_index > current + LOOKAHEAD_ROUNDS:
            key = (module, fragment)
            self.seen_ahead[key] = max(self.seen_ahead.get(key, 0), round_index)
            raise Refused("ahead", f"round {round_index}, ours is {current}")
        if round_index < current:
            came = self.came_after.setdefault((module, fragment), {})
            came.pop(sender, None)  # the latest last, so the oldest go first
            came[sender] = round_index
            while len(came) > self.max_senders:
                came.pop(next(iter(came)))
            raise Refused("stale", f"round {round_index} is over (ours is {current})")
        key = (module, fragment, round_index)
        slot = self.slot(key)
        # a sit-out notice takes a sender's place too: the slot's sets stay within max_senders
        if (
            sender not in slot.deliveries
            and sender not in slot.reports.reports
            and sender not in slot.sat_out
        ):
            senders = set(slot.deliveries) | set(slot.reports.reports) | slot.sat_out
            if len(senders) >= self.max_senders:
                raise Refused("full", f"{len(senders)} senders already")
        return key

    def note_refused(self, sender: str, header: DeltaHeader, reason: str) -> None:
        """A sender's outer gradient for a round we hold was refused as hostile: the round need not
        wait for it (rounds outside our window or modules we hold are not recorded: no slot for them)."""
        if reason not in HOSTILE_REASONS and reason != "banned":
            return
        k = header.key
        sizes = self.fragment_sizes.get(k.module)
        current = self.current.get((k.module, k.fragment), 0)
        if sizes is None or not 0 <= k.fragment < len(sizes):
            return
        if not current <= k.round <= current + LOOKAHEAD_ROUNDS:
            return
        slot = self.slot((k.module, k.fragment, k.round))
        if sender in slot.refused or len(slot.refused) < self.max_senders:
            slot.refused[sender] = reason
            slot.changed.set()

    def check_delta_header(self, sender: str, header: DeltaHeader) -> Key:
        k = header.key
        key = self.check_key(sender, k.module, k.fragment, k.round, header.admission)
        numel = self.fragment_sizes[k.module][k.fragment]
        if header.codec != self.codec.spec.name:
            raise Refused("dtype", f"codec {header.codec}, the run uses {self.codec.spec.name}")
        if header.numel != numel or header.payload_bytes != self.codec.spec.wire_bytes(numel):
            raise Refused("shape", f"{header.numel} values in {header.payload_bytes} bytes, expected {numel}")
        slot = self.slot(key)
        if sender in slot.deliveries:
            raise Refused("duplicate", "one outer gradient per sender and round")
        if slot.decided_with is not None and sender not in slot.decided_with:
            raise Refused("stale", f"round {k.round} was decided here without {sender}")
        return key

    def decode(self, header: DeltaHeader, payload: bytes) -> torch.Tensor:
        """Decodes and checks an outer gradient (runs in an executor: it costs CPU)."""
        try:
            delta = self.codec.decode(payload, header.numel)
        except CodecError as e:
            raise Refused("shape", str(e)) from None
        norm = exact_norm(delta.numpy())  # NaN or inf where a value is: float32 squares never overflow
        if not math.isfinite(norm):
            raise Refused("nonfinite", "NaN or inf values")
        if self.max_delta_norm > 0 and norm > self.max_delta_norm:
            raise Refused("norm", f"L2 norm {norm:.3g} exceeds {self.max_delta_norm:g}")
        return delta

    def add_delivery(self, key: Key, delivery: Delivery) -> None:
        self._byes.get(delivery.sender, set()).discard(key[0])  # it holds the module again
        slot = self.slot(key)
        if delivery.sender in slot.deliveries:
            raise Refused("duplicate", "one outer gradient per sender and round")
        slot.deliveries[delivery.sender] = delivery
        slot.senders = slot.senders | {delivery.sender}
        slot.changed.set()

    def add_report(self, sender: str, report: Report) -> None:
        """A report `sender` signed and sent us itself."""
        if report.reporter != sender:
            raise Refused("forged", f"a report of {report.reporter[:12]} sent by {sender[:12]} as its own")
        k = report.key
        key = self.check_key(sender, k.module, k.fragment, k.round, report.admission)
        self._take_report(key, report)

    def add_echo(self, sender: str, key: Key, reports: list[Report]) -> None:
        """The reports `sender` holds for round `key`, relayed: each counts as its reporter signed it."""
        key = self.check_key(sender, *key)
        slot = self.slot(key)
        for report in reports:
            if report.key.as_tuple() != key or not self.is_holder(report.reporter, key[0]):
                continue  # a report of another round, or of a peer that holds nothing here
            # a reporter we banned still counts when others relay its signed report: our ban is ours
            # alone, and members that decided on different reports would apply different bits
            if not self.standing.takes_part(report.reporter, report.admission):
                continue
            try:
                self._take_report(key, report)
            except Refused as e:  # one bad report in an echo spoils only itself
                logger.debug(f"a report relayed by {sender} was refused: {e}")
        slot.echoes.add(sender)
        slot.changed.set()

    def _take_report(self, key: Key, report: Report) -> None:
        slot = self.slot(key)
        if report.reporter not in slot.reports.reports and len(slot.reports.reports) >= self.max_senders:
            raise Refused("full", f"{len(slot.reports.reports)} reporters already")
        caught = report.reporter in slot.reports.equivocators
        if not slot.reports.add(report):
            raise Refused("forged", f"a report not signed by {report.reporter[:12]}")
        if not caught and report.reporter in slot.reports.equivocators:
            logger.warning(f"{report.reporter} sent different reports for round {key}: left out and banned")
            self.ban(report.reporter)
        slot.changed.set()

    def ban(self, sender: str) -> None:
        self._banned_until[sender] = self.clock() + BAN_SECONDS

    async def wait(
        self, key: Key, until: Callable[[_Slot], bool], deadline: float, poll_seconds: float = 0.5
    ) -> bool:
        """Waits until `until(slot)` holds or the loop's clock passes `deadline`. `until` is asked
        again at least every `poll_seconds`: it may depend on more than the slot (the claim view)."""
        loop = asyncio.get_running_loop()
        slot = self.slot(key)
        while not until(slot):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            slot.changed.clear()
            try:
                await asyncio.wait_for(slot.changed.wait(), min(remaining, poll_seconds))
            except TimeoutError:
                pass
        return True


def _keep_latest(store: OrderedDict, key: Key, value) -> None:
    """`store[key] = value`, newest last, the oldest dropped past `RECENT_ROUNDS_KEPT` rounds."""
    store[key] = value
    store.move_to_end(key)
    while len(store) > RECENT_ROUNDS_KEPT:
        store.popitem(last=False)
