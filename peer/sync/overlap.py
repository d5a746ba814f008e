"""τ, the inner steps a fragment's round may overlap, as each peer measures it (`OverlapTuner`)."""

from __future__ import annotations

import logging
import math
import time

logger = logging.getLogger(__name__)


class OverlapTuner:
    """τ from measured sync time: when fragment syncs keep outlasting the τ steps meant to hide them,
    τ is raised as far as the schedule allows (τ < H/P: a fragment's sync must be applied before the
    next fragment's starts); once they fit in one step less again, two rounds' worth of fragment
    syncs in a row, it is lowered by one, never below the manifest's. A raised τ is not free: a merge
    with α < 1 replaces the steps trained on the fragment while its round was in flight, so each step
    of τ drops that much training, and a τ raised by one stretch of slow syncs (a busy CPU, a
    congested hour) would otherwise drop it for the rest of the run. τ only changes when the run
    overlaps at all (τ > 0 in the manifest): τ = 0 is blocking DiLoCo by choice. Holders may differ
    in τ: it only moves when each merges the same θ̃ into its own local model, never what the group
    averages."""

    #: syncs in a row that must outlast τ before it is raised (one slow sync is not a trend)
    LATE_SYNCS = 2
    #: a sync counts as late when the loop waited this share of a step for it (less is noise)
    LATE_SHARE_OF_STEP = 0.25

    def __init__(self, tau: int, inner_steps: int, fragments: int):
        self.tau = tau
        self.floor = tau  # the manifest's: never lowered below it
        self.max_tau = max(0, inner_steps // fragments - 1)
        # lowered only after every fragment's round fit twice: one quick fragment is not a trend
        self.early_syncs = 2 * max(1, fragments)
        self.step_seconds: float | None = None
        self._started: float | None = None
        self._late = 0
        self._early = 0
        self._warned = False

    def step_started(self) -> None:
        self._started = time.monotonic()

    def step_ended(self) -> None:
        """One inner step's compute time (syncs excluded), smoothed."""
        if self._started is None:
            return
        dt = time.monotonic() - self._started
        self.step_seconds = dt if self.step_seconds is None else 0.8 * self.step_seconds + 0.2 * dt

    def sync_waited(self, seconds: float, took_seconds: float | None = None) -> None:
        """The loop waited `seconds` for a sync that was due (0: it had ended); `took_seconds`, where
        known, is how long its round ran from the step it started after."""
        if self.tau == 0 or not self.step_seconds:
            return
        if seconds < self.LATE_SHARE_OF_STEP * self.step_seconds:
            self._late = 0
            self._lower_if_early(took_seconds)
            return
        self._early = 0
        self._late += 1
        if self._late < self.LATE_SYNCS:
            return
        self._late = 0
        wanted = self.tau + math.ceil(seconds / self.step_seconds)
        if self.tau < self.max_tau:
            raised = min(self.max_tau, wanted)
            logger.info(
                f"fragment syncs outlast τ = {self.tau} steps by {seconds:.2f}s "
                f"({self.step_seconds:.2f}s/step): raising τ to {raised}"
            )
            self.tau = raised
        elif not self._warned:
            self._warned = True
            logger.warning(
                f"fragment syncs outlast τ = {self.tau} steps by {seconds:.2f}s, and τ cannot grow "
                f"past H/P − 1 = {self.max_tau}: more fragments per module, a smaller codec or a faster "
                "link would hide them"
            )

    def _lower_if_early(self, took_seconds: float | None) -> None:
        """Counts a sync that τ − 1 steps would have hidden without any wait; lowers τ by one after
        `early_syncs` of them in a row."""
        fits = took_seconds is not None and took_seconds <= (self.tau - 1) * self.step_seconds
        if self.tau <= self.floor or not fits:
            self._early = 0
            return
        self._early += 1
        if self._early < self.early_syncs:
            return
        self._early = 0
        self.tau -= 1
        self._warned = False
        logger.info(
            f"the last {self.early_syncs} fragment syncs fit in {self.tau} steps "
            f"({self.step_seconds:.2f}s/step): lowering τ to {self.tau}"
        )
