"""Deterministic fault injection, so tests can crash or stall a peer at an exact point.

Code marks the places worth breaking with ``fault_point("name")``. Nothing happens unless the
environment variable ``PATHSWARM_FAULTS`` names that point::

    PATHSWARM_FAULTS="checkpoint.before_manifest=kill,train.step@3=stall:2.5,outer.before_allreduce=raise"

Each comma-separated entry is ``name=action`` or ``name@N=action``; the second form fires only the N-th
time this process reaches the point (counting from 1), the first fires every time. Actions:

- ``kill``: SIGKILL the current process at once (no cleanup, no atexit, no flushing: a power cut);
- ``stall:SECONDS``: sleep that long, e.g. to push a peer past an all-reduce deadline;
- ``raise``: raise ``InjectedFault(name)``.

The variable is parsed once (again only if its value changes, which also resets the counters), so an
unset variable costs one dictionary lookup per point. ``KNOWN_POINTS`` is the registry of points the code
base marks; a spec naming any other point is accepted but logged, since a typo would otherwise never fire.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

ENV_VAR = "PATHSWARM_FAULTS"

KNOWN_POINTS: dict[str, str] = {
    "checkpoint.after_tensors": "checkpoint tensors file written, fsynced and renamed; no manifest yet",
    "checkpoint.before_manifest": "manifest temp file is durable but not yet renamed into place",
    "outer.before_allreduce": "a fragment sync: outer gradients computed, before its round starts",
    "outer.after_allreduce": "a fragment sync: the round's results in, before the outer step",
    "train.step": "each inner training step, before the optimizer step",
    "sync.receive_delta": "another member's outer gradient: header accepted, payload not yet read",
    "sync.between_frames": "sending a request: one frame written, the next not yet (dies mid-stream)",
    "sync.push_report": "sending our signed report of a round to a member (fails as if unreachable)",
    "router.read": "a peer's read of the run's router versions from the DHT (a slow DHT)",
}

ACTIONS = ("kill", "stall", "raise")

logger = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by a ``raise`` action; ``point`` names the fault point that fired."""

    def __init__(self, point: str):
        super().__init__(f"injected fault at {point!r}")
        self.point = point


@dataclass(frozen=True)
class FaultRule:
    """One parsed entry of PATHSWARM_FAULTS: at `point`, do `action` (every hit, or hit `nth`)."""

    point: str
    action: str  # one of ACTIONS
    seconds: float = 0.0  # only for "stall"
    nth: int | None = None  # fire only on this hit (1-based); None = every hit


def parse_faults(spec: str) -> dict[str, list[FaultRule]]:
    """Parse a ``PATHSWARM_FAULTS`` value into rules per point; raises ValueError on a malformed entry."""
    rules: dict[str, list[FaultRule]] = {}
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        target, sep, action = entry.partition("=")
        if not sep:
            raise ValueError(f"{ENV_VAR}: entry {entry!r} is not 'name=action'")
        target, action = target.strip(), action.strip()
        point, at, nth_text = target.partition("@")
        point = point.strip()
        if not point:
            raise ValueError(f"{ENV_VAR}: entry {entry!r} has no point name")
        nth = None
        if at:
            try:
                nth = int(nth_text)
            except ValueError:
                raise ValueError(f"{ENV_VAR}: entry {entry!r}: '@{nth_text}' is not an integer") from None
            if nth < 1:
                raise ValueError(f"{ENV_VAR}: entry {entry!r}: hits are counted from 1")
        kind, colon, arg = action.partition(":")
        if kind == "stall":
            try:
                seconds = float(arg)
            except ValueError:
                raise ValueError(f"{ENV_VAR}: entry {entry!r}: stall needs 'stall:SECONDS'") from None
            if not seconds >= 0:  # also rejects nan
                raise ValueError(f"{ENV_VAR}: entry {entry!r}: stall seconds must be >= 0")
            rule = FaultRule(point, "stall", seconds=seconds, nth=nth)
        elif kind in ("kill", "raise") and not colon:
            rule = FaultRule(point, kind, nth=nth)
        else:
            raise ValueError(f"{ENV_VAR}: entry {entry!r}: unknown action {action!r} (kill, stall:S, raise)")
        if point not in KNOWN_POINTS:
            logger.warning(
                "%s names unknown fault point %r; known: %s", ENV_VAR, point, ", ".join(KNOWN_POINTS)
            )
        rules.setdefault(point, []).append(rule)
    return rules


_lock = threading.Lock()
_parsed_spec: str | None = None
_rules: dict[str, list[FaultRule]] = {}
_hits: dict[str, int] = {}


def _rules_for(point: str, spec: str) -> tuple[list[FaultRule], int]:
    """Rules for ``point`` under ``spec`` and this hit's 1-based number (re-parsing if the spec changed)."""
    global _parsed_spec, _rules
    with _lock:
        if spec != _parsed_spec:
            _rules = parse_faults(spec)
            _parsed_spec = spec
            _hits.clear()
        rules = _rules.get(point)
        if not rules:
            return [], 0
        hit = _hits.get(point, 0) + 1
        _hits[point] = hit
        return rules, hit


def fault_point(name: str) -> None:
    """Mark a place where a test may inject a fault; a no-op unless ``PATHSWARM_FAULTS`` names it."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    rules, hit = _rules_for(name, spec)
    for rule in rules:
        if rule.nth is not None and rule.nth != hit:
            continue
        if rule.action == "kill":
            # A raw write: the logging machinery may hold locks or buffers that SIGKILL never flushes.
            os.write(2, f"pathswarm: injected kill at {name!r} (hit {hit})\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # SIGKILL is asynchronous in principle; never run past the point
            sys.exit(137)
        elif rule.action == "stall":
            logger.warning("injected stall of %.3f s at %r (hit %d)", rule.seconds, name, hit)
            time.sleep(rule.seconds)
        else:
            raise InjectedFault(name)


def reset_faults() -> None:
    """Forget the parsed spec and the hit counters (for tests that reuse one process)."""
    global _parsed_spec
    with _lock:
        _parsed_spec = None
        _rules.clear()
        _hits.clear()
