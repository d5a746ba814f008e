"""Signed reports of a round, relayed between its members, and what they agree on.

A member's report says which outer gradient it received from each sender (a digest of weight,
standing and payload) and the digest of its own copy before the round. Reports are signed with the
reporter's key, so any member can relay another's report and nobody can forge one. After the report
phase every member names to every other the reports it holds, by digest (`Kind.ECHO`), and sends
those the other lacks (`Kind.NEED`); then every member decides on the union: a member that sent
different reports to different members is caught by whoever holds
two of them, with the evidence to show (`RoundReports.equivocators`), and its report and its part
are left out by all.

`agreed_senders` is the round's rule: a sender's part counts when a strict majority of the voters
(the reporters with standing, `Standing.voters`) list the same digest for it — never because one
report omits it, and never because of reports of keys without standing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter
from collections.abc import Callable

from hivemind.utils.crypto import RSAPrivateKey

from dht.identity import canonical_bytes, signer_of
from peer.sync import wire
from peer.sync.wire import Report

logger = logging.getLogger(__name__)

#: how long an echo waits for our report's push to the same member to be answered, so that the member
#: holds our report when our echo names it and need not ask for it; usually a few milliseconds
ECHO_PUSH_WAIT_SECONDS = 0.5


def _body(report: Report) -> bytes:
    """What a report's signature covers: every field but the signature, in a canonical encoding."""
    return canonical_bytes(report.model_dump(mode="json", exclude={"signature"}))


def report_digest(report: Report) -> str:
    """What an echo names a report by: SHA-256 of what its signature covers. Two reports of one
    reporter with different digests are an equivocation (`RoundReports.add` compares the same bytes)."""
    return hashlib.sha256(_body(report)).hexdigest()


def sign_report(report: Report, key: RSAPrivateKey, peer_id: str) -> Report:
    """`report` as `peer_id` (the owner of `key`) signs it."""
    public_key = key.get_public_key().to_bytes().decode()
    unsigned = report.model_copy(update={"reporter": peer_id, "public_key": public_key})
    return unsigned.model_copy(update={"signature": key.sign(_body(unsigned)).decode()})


def verify_report(report: Report) -> bool:
    """True if `report` is signed by the key whose peer id is its `reporter`."""
    owner, public = signer_of(report.public_key)
    if owner is None or owner != report.reporter:
        return False
    try:
        return public.verify(_body(report), report.signature.encode())
    except Exception:
        return False


class RoundReports:
    """The verified reports of one round by reporter, and the reporters caught equivocating."""

    def __init__(self) -> None:
        self.reports: dict[str, Report] = {}
        #: reporter -> two different reports it signed for this round (the evidence)
        self.equivocators: dict[str, tuple[Report, Report]] = {}

    def add(self, report: Report) -> bool:
        """Takes in a verified report; False if it is not signed by its reporter (then it is ignored)."""
        if not verify_report(report):
            return False
        known = self.reports.get(report.reporter)
        if known is None:
            self.reports[report.reporter] = report
        elif _body(known) != _body(report) and report.reporter not in self.equivocators:
            self.equivocators[report.reporter] = (known, report)
        return True

    def honest(self) -> dict[str, Report]:
        """The reports of reporters not caught equivocating."""
        return {r: rep for r, rep in self.reports.items() if r not in self.equivocators}


def agreed_senders(reports: dict[str, Report], voters: list[str], excluded: set[str]) -> dict[str, str]:
    """sender -> the digest a strict majority of `voters` reported receiving from it (senders in
    `excluded` never count)."""
    counts: dict[str, Counter] = {}
    for voter in voters:
        for sender, digest in reports[voter].received.items():
            counts.setdefault(sender, Counter())[digest] += 1
    agreed = {}
    for sender, digests in counts.items():
        if sender in excluded:
            continue
        digest, count = max(digests.items(), key=lambda kv: (kv[1], kv[0]))
        if 2 * count > len(voters):
            agreed[sender] = digest
    return agreed


def majority_state(reports: dict[str, Report], voters: list[str]) -> str | None:
    """The copy digest a strict majority of `voters` held before the round, if any."""
    if not voters:
        return None
    digest, count = Counter(reports[v].state_digest for v in voters).most_common(1)[0]
    return digest if 2 * count > len(voters) else None


def missing_reports(
    reports: RoundReports, held: list[tuple[str, str]], wanted: Callable[[str], bool], room: int
) -> list[int]:
    """The positions in an echo's `held` (reporter, digest) of the reports we lack: a reporter we
    hold no report of, or one of another digest (the evidence of an equivocation). None of a reporter
    already caught (we hold its two reports) or not `wanted` (one that takes no part in the round: its
    report would be dropped), and no more than can matter, however many names a hostile echo lists:
    one other digest of a reporter we hold (it is the evidence), two of one we do not (an
    equivocator's pair), and reporters we hold none of for at most `room` (the round's reporters we
    may still take in)."""
    have: dict[str, set[str]] = {r: {report_digest(rep)} for r, rep in reports.reports.items()}
    asked: dict[str, set[str]] = {}
    out = []
    for i, (reporter, digest) in enumerate(held):
        if reporter in reports.equivocators or digest in have.get(reporter, ()):
            continue
        digests = asked.get(reporter, set())
        new_reporter = reporter not in have and not digests
        full = len(digests) >= (1 if reporter in have else 2) or (new_reporter and room <= 0)
        if digest in digests or full or not wanted(reporter):
            continue
        room -= new_reporter
        asked[reporter] = digests | {digest}
        out.append(i)
    return out


async def send_echo(
    service, member: str, echo: wire.Echo, held: list[Report], deadline: float, key, pushed, sent, gone
) -> None:
    """Names the reports we hold to `member` (`echo`, `held` in its order) once `pushed`, our report's
    push to it, is answered or a moment has passed, and sends those it asks for; the bytes go to
    `sent[key]` while the round counts them. A member that cannot be reached at all (not merely slow)
    goes into `gone`: its own echo is not waited for."""
    loop = asyncio.get_running_loop()
    if pushed is not None:
        await asyncio.wait({pushed}, timeout=min(ECHO_PUSH_WAIT_SECONDS, max(0.0, deadline - loop.time())))
    try:
        nbytes = await service.echo(member, echo, held, max(0.1, deadline - loop.time()))
        if key in sent:
            sent[key] += nbytes
    except Exception as e:  # it decides on what it holds; the next round's digests catch the rest
        logger.debug(f"{key}: echo to {member} failed: {type(e).__name__}: {e}")
        if not isinstance(e, TimeoutError):  # the dial failed or the stream was reset: nobody is there
            gone.setdefault(member, f"unreachable ({type(e).__name__})")
            service.inbox.slot(key).changed.set()
