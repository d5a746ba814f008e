"""The outer loop of one peer: Streaming DiLoCo over every module on its path.

Each module is cut into P fragments; fragment p of every module starts syncing after inner steps
t ≡ p·H/P (mod H) (arXiv 2501.18512), so about 1/P of the parameters is on the wire at once. A
fragment's round (`peer.sync.rounds`) runs in the background while inner steps go on; τ steps later
the outer step is applied to the fragment's global copy and merged into the local model with α, for
every τ (τ = 0 waits for the round at once; P = 1, τ = 0, α = 0 is plain per-module DiLoCo). A module held by
nobody else still gets its outer step, from this peer's own Δ.

The round's members are the module's ready holders in the claim view (or this peer's planned
subgroup of them), and its key is the fragment's count of applied syncs, which every holder whose
copy is in step shares: no matchmaking.

`StreamingOuter` is called one way: the peer's sync layer (`PathSync`) advances it each step
(`tick`), takes the syncs whose τ ran out (`due`), collects their results (`collect`) and has each
applied (`apply`) once it dealt with what the result asks of it (a merge, a state download): nothing
here calls back up.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from dht.background_loop import wait_until
from monitoring.metrics import PeerMetrics
from peer.codecs.formats import make_codec
from peer.config import RunManifest, SyncConfig
from peer.faults import fault_point
from peer.model.grid import TRUNK
from peer.sync.dial_budget import DialBudget
from peer.sync.fragments import fragments_due, next_due, sync_offsets
from peer.sync.hello import Greeting
from peer.sync.merge import ReportedCopies
from peer.sync.module_sync import ModuleSync, PreparedStep
from peer.sync.overlap import OverlapTuner
from peer.sync.pending import PendingSync, SyncTotals
from peer.sync.rounds import RoundResult, RoundRunner

logger = logging.getLogger(__name__)

#: (module, round) -> (subgroup index, members) of this peer's planned averaging subgroup, or None
#: when every holder averages together
GroupOf = Callable[[str, int], tuple[int, list[str]] | None]


def sync_clock(n_syncs: int, inner_steps: int, n_fragments: int) -> int:
    """The schedule's position (in inner steps) right after its `n_syncs`-th fragment sync: syncs
    happen in the order of their offsets, fragment p at t_p, t_p + H, ... (fragment 0 at H, 2H, ...)."""
    cycle, p = divmod(n_syncs, n_fragments)
    return cycle * inner_steps + sync_offsets(inner_steps, n_fragments)[p]


#: a round's outcome when this peer was told to leave before it ended: not applied
STOPPED = "stopped"
#: how long a peer told to leave still waits for the results of its rounds in flight
LEAVING_WAIT_SECONDS = 3.0


#: holders without standing that offered us no part lately which one round of a module tries at most
#: (a new random sample each round): claims are free, and a flood of them made every round dial
#: hundreds of keys that never answer (benchmarks/claims_scale.py, open run). A real newcomer is in
#: our rounds from its first part on, and it sends one to every member with standing at once.
MAX_UNPROVEN_MEMBERS = 8
#: the same where the round already has a member with standing or heard from: a newcomer reaches us
#: by its own part then, so the sample is only how newcomers meet each other (each dial of a key that
#: runs no peer cost a flooded open run about 1% of its tokens/s per dial a round, claims_scale);
#: both samples are also bounded in time (`peer.sync.dial_budget`), for rounds many times a second
MAX_UNPROVEN_WITH_COMPANY = 2
#: a holder is heard from while its last part is this many averaging timeouts old at most: a slow
#: peer's rounds may be minutes apart, and a key that never sends a part gains nothing from the length
HEARD_WITHIN_TIMEOUTS = 5


def heard_within(sync: SyncConfig) -> float:
    """How recent a holder's last part must be for it to count as heard from (`Inbox.unproven`)."""
    return HEARD_WITHIN_TIMEOUTS * sync.averaging_timeout_seconds


#: One thread, shared by every path of the process, computes outer steps and their digests when
#: rounds end, so that the training thread only installs them: on a peer whose training thread
#: has a fixed budget (an accelerator's host thread, the WAN lab's quota) this work is overlapped
#: with inner steps like the round's communication is.
_STEP_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="outer-step")


class StreamingOuter:
    """Starts each fragment's round at its offset and applies it τ steps later, for every module."""

    def __init__(
        self,
        syncs: dict[str, ModuleSync],
        manifest: RunManifest,
        peer_id: str,
        metrics: PeerMetrics,
        runner: RoundRunner | None,
        group_of: GroupOf | None = None,
        round_of: Callable[[], int] | None = None,
        totals: SyncTotals | None = None,
        copies: ReportedCopies | None = None,
        dial_budget: DialBudget | None = None,
        overlap: OverlapTuner | None = None,
    ):
        """`runner` runs the rounds, and its codec encodes our outer gradients (None: this peer holds
        its modules alone, every round is its own Δ); `group_of(module, round)` gives this peer's
        planned subgroup of the module's holders (None: all holders average together); `round_of()`
        the swarm's round, which rotates them; `totals` carries on the counts of the path this peer
        rotated away from; `copies` keeps the copy each round reports, for members that merge;
        `dial_budget` how many holders never heard from its rounds dial per second; `overlap` carries
        on the τ of the path this peer rotated away from (the same machine, link and schedule)."""
        self.syncs = syncs
        self.runner = runner
        self.copies = copies
        self._sample = random.Random()  # which unproven holders a round tries: nobody can predict it
        self.dial_budget = dial_budget if dial_budget is not None else DialBudget()
        self.codec = runner.codec if runner is not None else make_codec(manifest.sync.codec)
        self.group_of = group_of
        self.round_of = round_of
        self.sync = manifest.sync
        self.inner_steps = manifest.sync.inner_steps
        self.peer_id = peer_id
        self.metrics = metrics
        #: position in the sync schedule, in inner steps; equal on holders in step (not the step count)
        self.clock = 0
        self.pending: list[PendingSync] = []
        self._tokens_at_sync = [0] * manifest.sync.fragments
        self.totals = totals if totals is not None else SyncTotals()
        self.overlap = overlap or OverlapTuner(self.sync.overlap_steps, self.inner_steps, self.sync.fragments)
        #: until our first fragment sync after we took a run's rounds in progress (`align`: a resume, a
        #: download, a move): our schedule is at a round's first step, the other holders may be most of
        #: the way through it (`_join_the_group`). A new swarm's peers start together (its barrier).
        self.joining = False

    def reset_tokens(self, tokens_total: int) -> None:
        self._tokens_at_sync = [tokens_total] * self.sync.fragments

    def align(self, rounds: list[int]) -> None:
        """Puts the schedule where a module with these fragment rounds is in it (after a restore or
        a download), so this peer syncs each fragment when its other holders do."""
        self.clock = sync_clock(sum(rounds), self.inner_steps, self.sync.fragments)
        self.joining = sum(rounds) > 0

    def tick(
        self, tokens_total: int, holders: dict[str, list[str]], greeting: Greeting | None = None
    ) -> list[tuple[ModuleSync, int, str]]:
        """Advances the schedule by one inner step and starts the syncs due now, once `greeting` (a
        mover's HELLOs) is answered; returns each started (module, fragment, digest of the copy its
        round reports)."""
        self.overlap.step_ended()
        if self.runner is not None and not self.runner.service.training.is_set():
            self.runner.service.training.set()  # in the rounds from the first step on
        if any(p.held_since is not None and not p.detached for p in self.pending):
            return []  # a round past its due step is still running: the schedule waits, training not
        self.clock += 1
        if self.joining:
            self._join_the_group(holders)
        started, due = [], fragments_due(self.clock, self.inner_steps, self.sync.fragments)
        if due and greeting is not None:
            greeting.wait()
        for fragment in due:
            self.joining = False
            started += self._start(fragment, tokens_total, holders)
        return started

    def _join_the_group(self, holders: dict[str, list[str]]) -> None:
        """Starts the next fragment sync now if most of a module's other holders already sent us
        their parts for it. A peer that (re)joined a run in progress — a restart, a download, a move
        — takes the module's round but not the time into it: the holders are up to H steps ahead of
        its schedule and would wait for its part, the straggler wait (seconds) at every join of a
        churning swarm. Its first round is cut short instead: its Δ of the steps it made and their
        tokens as its weight. Most means a strict majority of the other holders with standing
        (`Standing.among`), never a count of keys; and only the first round after a join is cut."""
        if self.runner is None:
            return
        due, fragment = next_due(self.clock, self.inner_steps, self.sync.fragments)
        # less than half a fragment's interval behind, the holders wait only those steps, and a cut
        # would halve our Δ (peers resumed together are a step apart: they must not cut at all)
        if 2 * (due - self.clock) <= self.inner_steps // self.sync.fragments:
            return
        inbox = self.runner.service.inbox
        round_index = self.round_of() if self.round_of else 0
        for mid, ms in self.syncs.items():
            key = (mid, fragment, ms.fragment_rounds[fragment])
            if self.runner.sitting_out.sent_already(key):
                # an earlier life sent it, or its members left us out while we started: it is sat out
                # (peer/sync/sitting_out.py), which needs none of our steps, and the holders, rounds
                # past it, wait for our next part meanwhile
                left = key in self.runner.service.left_out
                why = "left us out while we started" if left else "was sent by an earlier life"
                logger.info(f"{mid}: round {key[2]} {why}: sitting it out at once")
                self.clock = due
                return
            group = self.group_of(mid, round_index) if self.group_of else None
            members = group[1] if group is not None else holders.get(mid, [])
            voters = set(inbox.standing.among([p for p in members if p != self.peer_id]))
            # parts of the round after ours: they applied ours (the state we took was a round old), and
            # the round, started now, finds them past it and fetches their state, not H steps later
            for r, why in ((key[2], "joining it"), (key[2] + 1, "a round behind: starting ours")):
                if voters and 2 * len(agreeing := inbox.senders((mid, fragment, r)) & voters) > len(voters):
                    logger.info(
                        f"{mid}: {len(agreeing)} of {len(voters)} other holders already sent their parts "
                        f"of fragment {fragment}'s round {r}: {why} {due - self.clock} steps early"
                    )
                    self.clock = due
                    return

    def due(self) -> list[PendingSync]:
        """The syncs whose τ ran out, taken off the schedule (the caller collects and applies them).

        With τ > 0 and α > 0 a round still running at its due step is held, not waited for: the
        loop trains on and `tick` keeps the schedule where it is, so that no later round starts
        before this one is applied. The round waits for slower members' parts; our steps meanwhile
        stay in the local model (α of it at the merge) and go into our next Δ and its weight, where
        they would have been idle seconds. A hold ends when the round does, after H/P steps (a round
        whose members died waits seconds for them: our next Δ carries at most twice the steps of a
        round, not hundreds that drift from the group), or after the averaging timeout; then
        `collect` waits. τ = 0 is blocking DiLoCo by choice, and with α = 0 the merge would drop the
        extra steps: both wait."""
        holds = self.sync.overlap_steps > 0 and self.sync.mixing_alpha > 0
        most = self.inner_steps // self.sync.fragments
        now, done, split = time.monotonic(), [], []
        for p in self.pending:
            if p.due_step > self.clock:
                continue
            if p.detached:  # applied when it ends, or at the averaging timeout as a failed round
                if p.finished() or now - p.held_since >= self.sync.averaging_timeout_seconds:
                    done.append(p)
                continue
            if holds and not p.finished():
                p.held_since = now if p.held_since is None else p.held_since
                p.held_steps += 1
                if p.held_steps <= most and now - p.held_since < self.sync.averaging_timeout_seconds:
                    continue
                split += [rest] if (rest := self._detach_sit_outs(p)) is not None else []
            done.append(p)
        self.pending = [p for p in self.pending if p not in done] + split
        self.overlap.step_started()
        return done

    def _detach_sit_outs(self, pending: PendingSync) -> PendingSync | None:
        """Splits the rounds we sit out after a restart (`SittingOut.after_restart`) that are still
        running off a held `pending`, as a sync of their own (None: none). A sit-out waits until its
        partners are past the round, seconds where they restarted too; held with it, our other
        modules sent no part of their next rounds, so their members waited the straggler bound for
        us, and a partner whose own fragment waited on those rounds could not get past the round we
        sat out (the goodput churn arm's double kills, session 51: every peer 5–6 s, twice a run,
        and a split trunk round). The modules we sit out start no round until theirs ended
        (`_start`); the state they then take catches them up."""
        if self.runner is None:
            return None
        fragment, sitting_out = pending.fragment, self.runner.sitting_out
        sitting = [
            mid
            for mid, future in pending.futures.items()
            # not the trunk: its rounds are the peer's clock (every holder is in them, one gets past)
            if mid != TRUNK
            and not future.done()
            and sitting_out.after_restart((mid, fragment, self.syncs[mid].fragment_rounds[fragment]))
        ]
        if not sitting:
            return None
        rest = PendingSync(pending.fragment, pending.due_step, pending.weight, held_since=pending.held_since,
                           held_steps=pending.held_steps, detached=True)  # fmt: skip
        for mid in sitting:
            for field in ("futures", "deltas", "epochs", "digests", "prepared"):
                if mid in (kept := getattr(pending, field)):
                    getattr(rest, field)[mid] = kept.pop(mid)
        logger.info(f"fragment {pending.fragment}: {', '.join(sitting)} sit a round out; the others go on")
        return rest

    def drain(self) -> list[PendingSync]:
        """Every sync still in flight (before a checkpoint or leaving)."""
        done, self.pending = self.pending, []
        return done

    def members_of(self, mid: str, holders: dict[str, list[str]]) -> list[str]:
        """This round's group of a module: our planned subgroup, or every ready holder (us included),
        less all but `MAX_UNPROVEN_MEMBERS` of those with neither standing nor a part offered lately."""
        round_index = self.round_of() if self.round_of else 0
        group = self.group_of(mid, round_index) if self.group_of else None
        members = group[1] if group is not None else holders.get(mid, [])
        if self.runner is not None:
            inbox, within = self.runner.service.inbox, self.sync.averaging_timeout_seconds
            if group is None:
                # holders that offered us outer gradients lately are active, whatever the claim view says
                members = [*members, *inbox.active_holders(mid, within)]
            others = [m for m in members if m != self.peer_id]
            lately = heard_within(self.sync)
            unproven = inbox.unproven(others, lately, mid)
            # one that a round of ours could not reach lately is not dialled again until then: a
            # flood's keys never answer; a real newcomer that was not up yet is heard from its part
            failed = inbox.failed_within(unproven, lately)
            candidates = [m for m in unproven if m not in failed]
            most = MAX_UNPROVEN_WITH_COMPANY if len(others) > len(unproven) else MAX_UNPROVEN_MEMBERS
            # and no more per second than the budget: rounds may come many times a second
            tried = self._sample.sample(candidates, self.dial_budget.take(mid, most, len(candidates)))
            left_out = set(unproven) - set(tried)
            members = [m for m in members if m not in left_out]
        return sorted(set(members) | {self.peer_id})

    def _start(self, fragment: int, tokens_total: int, holders) -> list[tuple[ModuleSync, int, str]]:
        weight = max(1, tokens_total - self._tokens_at_sync[fragment])
        self._tokens_at_sync[fragment] = tokens_total
        pending = PendingSync(fragment, self.clock + self.overlap.tau, float(weight))
        fault_point("outer.before_allreduce")
        started = []
        sitting = {mid for p in self.pending if p.detached for mid in p.futures}
        for mid, ms in self.syncs.items():
            if ms.fragment_size(fragment) == 0 or mid in sitting:
                continue
            delta = ms.corrected_outer_gradient(fragment, self.codec, self.sync.error_feedback_decay)
            members = self.members_of(mid, holders)
            pending.deltas[mid] = delta
            if self.runner is None:
                pending.results[mid] = RoundResult("alone", delta, 1, detail="no other holder")
                continue
            # a round without other members in our view still goes through the runner: a holder we
            # do not see yet may have sent its part already (it joins the round), and one that sends
            # it later must hear that the round was decided without it (`Inbox.check_delta_header`)
            key = (mid, fragment, ms.fragment_rounds[fragment])
            digest = ms.digest(fragment)
            if self.copies is not None:
                # kept before the round starts: a fast member may ask for it before this call returns
                self.copies.remember(mid, fragment, digest, ms.fragment_copy(fragment))
            started.append((ms, fragment, digest))
            pending.epochs[mid] = ms.epoch
            pending.digests[mid] = digest
            future = self.runner.start(key, delta, weight, members, digest)
            pending.futures[mid] = future
            future.add_done_callback(self._prepare_when_done(pending, mid, ms, fragment))
        pending.started_at = time.monotonic()  # the τ steps meant to hide the rounds start now
        self.pending.append(pending)
        return started

    @staticmethod
    def _prepare_when_done(pending: PendingSync, mid: str, ms: ModuleSync, fragment: int):
        def prepare(future: Future) -> None:
            pending.ended_at[mid] = time.monotonic()
            if future.cancelled() or future.exception() is not None:
                return
            result = future.result()
            if result.outcome != "behind":
                pending.prepared[mid] = _STEP_POOL.submit(ms.prepare_step, fragment, result.delta)

        return prepare

    def collect(self, pending: PendingSync) -> dict[str, RoundResult]:
        """Each module's round result (its own Δ, "failed", where the round did not finish in time)."""
        # the round's own deadlines bound it; this is a last resort against a wedged event loop
        limit = self.sync.averaging_timeout_seconds + 2 * self.sync.report_timeout_seconds + 30
        # the hold counts as waiting: τ grows so that the round fits in it next time (`OverlapTuner`)
        waiting_since = pending.held_since if pending.held_since is not None else time.monotonic()
        leaving = self.runner.service.leaving if self.runner is not None else threading.Event()
        until = time.monotonic() + limit
        for mid, future in pending.futures.items():
            if not wait_until(future, until, leaving) and leaving.is_set():
                # told to leave: a few seconds more at most (a round waiting for a gone member held a
                # SIGTERM for its whole averaging timeout); unfinished then, it is not applied
                until = min(until, time.monotonic() + LEAVING_WAIT_SECONDS)
                wait_until(future, until, threading.Event())
            if not future.done() and leaving.is_set():
                pending.results[mid] = RoundResult(STOPPED, pending.deltas[mid], 1, detail="we are leaving")
                continue
            try:
                if not future.done():
                    raise TimeoutError(f"no result in {limit:.0f} s")
                pending.results[mid] = future.result()
            except Exception as e:
                detail = f"{type(e).__name__}: {e}"
                pending.results[mid] = RoundResult("failed", pending.deltas[mid], 1, detail=detail)
        if pending.futures and not pending.detached:  # a sit-out's wait is not the link's
            self.overlap.sync_waited(time.monotonic() - waiting_since, pending.took_seconds())
        fault_point("outer.after_allreduce")
        return pending.results

    def record(self, r: RoundResult) -> None:
        """Counts a round's result in the metrics and the totals."""
        self.metrics.observe_round(r.outcome, r.seconds, r.group_size, r.bytes_sent, r.bytes_received)
        self.totals.add(r)
        for reason, count in r.bad_parts.items():
            for _ in range(count):
                self.metrics.bad_part(reason)

    def apply(self, pending: PendingSync, mid: str, r: RoundResult) -> None:
        """The round's outer step on the module's fragment (and the error feedback's account of what
        our part contributed to it)."""
        ms, fragment = self.syncs[mid], pending.fragment
        if r.outcome == STOPPED:  # we leave with the state before it (`SentRounds` knows we sent it)
            return
        if self.codec.spec.error_feedback:
            ms.settle_feedback(fragment, pending.deltas[mid], _sent_part(pending, mid, r))
        ms.apply(fragment, r.delta, self.sync.mixing_alpha, _prepared(pending, mid, r))
        self.record(r)
        if r.outcome not in ("averaged", "alone"):
            logger.warning(f"{mid} fragment {fragment}: {r.outcome} ({r.detail})")


def _sent_part(pending: PendingSync, mid: str, r: RoundResult):
    """What of our corrected Δ went into the step applied: the payload's part when the group averaged
    it, all of it when we applied it alone, none of it when the group left it out."""
    if r.outcome in ("alone", "failed"):
        return pending.deltas[mid]
    if r.outcome == "excluded":
        return None
    # the runner encoded our part (off this thread) and says what it carried
    return pending.deltas[mid] if r.sent is None else r.sent.view_as(pending.deltas[mid])


def _prepared(pending: PendingSync, mid: str, result: RoundResult) -> PreparedStep | None:
    """The module's outer step computed in the background for this round's Δ̄, if it was (it is
    not when the round failed and our own Δ is applied instead, nor when the training thread got
    here first)."""
    future = pending.prepared.get(mid)
    if future is None:
        return None
    round_future = pending.futures[mid]
    if round_future.exception() is not None or round_future.result() is not result:
        return None
    try:
        return future.result()
    except Exception:
        logger.exception(f"{mid}: the outer step computed in the background failed; computing it again")
        return None
