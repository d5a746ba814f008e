"""A peer's round history: what each outer round cost and achieved, kept in its checkpoints.

One entry per outer round (fragment 0's sync): the round, steps and tokens so far, the mean training
loss of the round, the outcome of every module's sync per fragment, the bytes this peer sent over
the round and for its largest single sync event, how long each of the round's syncs took from its
start to its result, the groups, the training time, and the seconds of the round spent inside inner
steps (`step_seconds`: not waiting on a sync, a rotation or a checkpoint), and where all of the loop's
time went (`loop_parts_seconds`, `LOOP_PARTS`: its laps add up to the loop's time). Benchmarks (the WAN lab,
goodput) and the demo read these entries from the checkpoints. `own_rounds` counts the rounds this
peer completed (across resumes, unlike the swarm's round number in each entry): what --max_rounds
limits. `Throughput` is the tokens per second a peer reports in its claim and metrics.
"""

from __future__ import annotations

import time

from peer.sync.pending import FragmentDone

#: the parts of the training loop, in the order they run: making the batch, the inner step, the loop's
#: own bookkeeping (metrics, the holders' view), syncs and round ends, a rotation, the wait that
#: --max_inner_steps_per_second asks for
LOOP_PARTS = ("batches", "step", "loop", "sync", "rotation", "pace")
#: throughput is reported over windows of at least this long
TOKENS_PER_SECOND_WINDOW_SECONDS = 2.0


def first_step_note(seconds: float) -> str:
    """What a peer logs at its first inner step: a join's or restart's cost as a volunteer sees it
    (benchmarks.goodput reads it off the logs of restarted peers)."""
    return f"first inner step {seconds:.1f} s after the peer started"


class Throughput:
    """Training tokens per second, measured over windows of at least TOKENS_PER_SECOND_WINDOW_SECONDS
    (a single step's rate would jump with every wait on a sync)."""

    def __init__(self) -> None:
        self.tokens_per_second = 0.0
        self._started = time.monotonic()
        self._tokens = 0

    def start(self) -> None:
        """Opens a window (the training loop starts)."""
        self._started, self._tokens = time.monotonic(), 0

    def add(self, tokens: int) -> float:
        """Counts one step's tokens; returns the rate of the last full window."""
        self._tokens += tokens
        elapsed = time.monotonic() - self._started
        if elapsed > TOKENS_PER_SECOND_WINDOW_SECONDS:
            self.tokens_per_second = self._tokens / elapsed
            self.start()
        return self.tokens_per_second


class RoundHistory:
    """Accumulates per-step losses and per-fragment syncs into one entry per outer round."""

    def __init__(self) -> None:
        self.entries: list[dict] = []
        #: outer rounds this peer completed, across resumes (entries are cut to the last 200 in a checkpoint)
        self.own_rounds = 0
        self._losses: list[float] = []
        self._step_seconds = 0.0
        self._bytes = self._peak_bytes = 0
        self._sync_seconds: list[float] = []
        self._fragments: dict[str, dict[str, str]] = {}
        self._seconds_before = 0.0  # training time of the runs this one resumed
        self._clock: float | None = None
        self._laps = dict.fromkeys(LOOP_PARTS, 0.0)
        self._lap_started = time.perf_counter()

    def start_clock(self) -> None:
        self._clock = time.monotonic()
        self._lap_started = time.perf_counter()

    def lap(self, part: str) -> float:
        """Counts the time since the last lap (or the clock's start) as `part` of the loop (one of
        `LOOP_PARTS`); returns the time now (`time.perf_counter`)."""
        now = time.perf_counter()
        self._laps[part] += now - self._lap_started
        self._lap_started = now
        return now

    @property
    def train_seconds(self) -> float:
        """Wall time spent in the training loop, waits on averaging included, across resumes."""
        running = time.monotonic() - self._clock if self._clock is not None else 0.0
        return self._seconds_before + running

    def restore(self, entries: list[dict], train_seconds: float, own_rounds: int | None = None) -> None:
        self.entries = list(entries)
        self._seconds_before = train_seconds
        # A checkpoint from before the count was kept: its history holds one entry per round this peer
        # completed (exact below 200 rounds, a lower bound past them).
        self.own_rounds = len(self.entries) if own_rounds is None else own_rounds

    def add_step(self, loss: float) -> None:
        """One inner step, just made: its training loss; its time (forward, backward, optimizer) is the
        lap since the batch was made."""
        began = self._lap_started
        self._losses.append(loss)
        self._step_seconds += self.lap("step") - began

    def add_sync(self, done: FragmentDone) -> None:
        self._bytes += done.bytes_sent
        # the most this peer put on the wire for one sync event (a fragment, or everything)
        self._peak_bytes = max(self._peak_bytes, done.bytes_sent)
        # a round that ran (not "alone"): the path's modules sync at once, so the slowest is the sync's
        ran = [r.seconds for r in done.results.values() if r.outcome != "alone"]
        if ran:
            self._sync_seconds.append(max(ran))
        self._fragments.setdefault(str(done.fragment), {}).update(done.summary())  # a late sit-out joins it

    def end_round(self, round_index: int, step: int, tokens_total: int, done: FragmentDone) -> dict:
        entry = dict(
            round=round_index,
            step=step,
            loss=sum(self._losses) / max(1, len(self._losses)),
            outcomes=done.summary(),
            overlap_steps=done.overlap_steps,
            fragments=self._fragments,
            bytes_sent=self._bytes,
            peak_sync_bytes=self._peak_bytes,
            sync_seconds=self._sync_seconds,
            groups={mid: r.members for mid, r in done.results.items()},
            tokens_total=tokens_total,
            time=time.time(),
            train_seconds=self.train_seconds,
            step_seconds=self._step_seconds,
            loop_parts_seconds=dict(self._laps),
        )
        self.entries.append(entry)
        self.own_rounds += 1
        self._losses, self._fragments, self._sync_seconds = [], {}, []
        self._bytes = self._peak_bytes = 0
        self._step_seconds = 0.0
        self._laps = dict.fromkeys(LOOP_PARTS, 0.0)
        return entry
