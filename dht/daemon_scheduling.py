"""The p2p daemon's threads under SCHED_BATCH (Linux): each of its wake-ups (one per arriving packet
or two, on a capped link) waits for the running thread's time slice instead of preempting it.

On a peer whose cores are busy, the daemon's wake-ups preempt the training thread: each costs it a
context switch and its caches. In the WAN lab (docs/benchmarks/wan.md, session 55) a 4-bit peer's
training thread was preempted 12,000-15,000 times in 30 s (a sparse peer's 4,500-5,100, one that
never syncs 550-760), while it got 98% of its CPU quota in every case: its steps took longer, not
fewer CPU seconds. With the daemon under SCHED_BATCH, 2,500-2,800 times. SCHED_BATCH keeps the
daemon's nice level and its share of the CPU; what it gives up is preempting a thread that is
running, so a packet waits a scheduler tick at most when every core is busy, not at all otherwise.
"""

from __future__ import annotations

import logging
import os

import psutil

logger = logging.getLogger(__name__)

DAEMON_NAME = "p2pd"


def batch_schedule_daemons(root_pid: int | None = None) -> int:
    """Puts every thread of each p2p daemon started below `root_pid` (default: this process; the
    daemon is a child of hivemind's DHT process) under SCHED_BATCH, keeping its nice level; threads
    the daemon starts later inherit the policy. Returns how many threads it changed: 0 where the OS
    has no SCHED_BATCH (not Linux) or no daemon runs."""
    if not hasattr(os, "sched_setscheduler") or not hasattr(os, "SCHED_BATCH"):
        return 0
    changed = 0
    for child in psutil.Process(root_pid).children(recursive=True):
        try:
            if child.name() != DAEMON_NAME:
                continue
            for thread in child.threads():
                os.sched_setscheduler(thread.id, os.SCHED_BATCH, os.sched_param(0))
                changed += 1
        except (psutil.Error, OSError) as e:  # it ended meanwhile, or is not ours to change
            logger.debug(f"{DAEMON_NAME} {child.pid} keeps its scheduling: {e}")
    return changed
