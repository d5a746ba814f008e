"""What other peers can make this one upload, bounded (`ServeLimits`).

A request for a module's state, a merge copy or an artifact chunk costs its asker about a hundred
bytes and the server megabytes of upload and a read: without limits any peer could make a holder
upload its whole state again and again, for free, and take the bandwidth its rounds need. Keys are
free, so a limit per asker alone bounds nothing; three limits hold together:

* the total: bytes per second over all askers (a token bucket that may run into debt by one
  request, so a state larger than a second's budget still goes out whole, and the next waits) and
  uploads at once;
* askers without standing (not admitted to the run, `Standing.admitted`) share only part of both,
  so a flood of fresh keys leaves the rest to admitted peers;
* each asker: bytes per second and uploads at once of its own.

A refused request is answered at once with the reason ("busy: ..."); an asker moves on to another
donor, as it does when one is slow.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

#: askers whose own buckets are remembered (the least recent go first; a forgotten one starts full)
MAX_ASKERS_KEPT = 4096


@dataclass(frozen=True)
class ServeLimitSettings:
    """The limits (from `PeerConfig`); bytes per second are sustained rates, bursts one second's."""

    bytes_per_second: float
    uploads_at_once: int
    per_asker_bytes_per_second: float
    per_asker_uploads_at_once: int
    #: the share of the total bytes and uploads that askers without standing may take together
    stranger_share: float


#: the defaults (a peer's `--serve_*` flags take theirs from here): a home uplink of 100 Mbit/s or more
#: keeps room for rounds; a state larger than a second's worth still goes out whole
DEFAULT_SERVE_LIMITS = ServeLimitSettings(
    bytes_per_second=32e6,
    uploads_at_once=8,
    per_asker_bytes_per_second=16e6,
    per_asker_uploads_at_once=4,
    stranger_share=0.5,
)


class _Bucket:
    """Tokens (bytes) refilled at `rate` up to one second's worth; may go into debt by one request."""

    def __init__(self, rate: float, now: float):
        self.rate, self.tokens, self.at = rate, rate, now

    def ready(self, now: float) -> bool:
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        return self.tokens > 0

    def take(self, nbytes: int) -> None:
        self.tokens -= nbytes


class ServeLimits:
    """Decides, per request, whether to serve it now; `release` when its upload ended."""

    def __init__(
        self, settings: ServeLimitSettings = DEFAULT_SERVE_LIMITS, clock: Callable[[], float] = time.monotonic
    ):
        self.settings = settings
        self.clock = clock
        now = clock()
        self._total = _Bucket(settings.bytes_per_second, now)
        self._strangers = _Bucket(settings.bytes_per_second * settings.stranger_share, now)
        self._askers: OrderedDict[str, _Bucket] = OrderedDict()
        self._uploads: dict[str, int] = {}
        self._stranger_uploads = 0
        self._lock = threading.Lock()  # handlers of several event loops (sync, artifacts) share one
        #: refusals by reason, for metrics and tests
        self.refused: dict[str, int] = {}

    def acquire(self, asker: str, nbytes: int, has_standing: bool) -> str | None:
        """None if `asker` may be sent `nbytes` now (then `release(asker, has_standing)` after the
        upload), else why not."""
        s = self.settings
        with self._lock:
            now = self.clock()
            own = self._askers.pop(asker, None) or _Bucket(s.per_asker_bytes_per_second, now)
            self._askers[asker] = own
            while len(self._askers) > MAX_ASKERS_KEPT:
                self._askers.popitem(last=False)
            busy = sum(self._uploads.values())
            strangers_at_once = max(1, int(s.uploads_at_once * s.stranger_share))
            checks = (
                ("uploads", busy >= s.uploads_at_once, f"{busy} uploads at once"),
                ("asker_uploads", self._uploads.get(asker, 0) >= s.per_asker_uploads_at_once,
                 f"{s.per_asker_uploads_at_once} uploads to you at once"),
                ("stranger_uploads", not has_standing and self._stranger_uploads >= strangers_at_once,
                 "the uploads for peers without standing are taken"),
                ("asker_rate", not own.ready(now),
                 f"over {s.per_asker_bytes_per_second / 1e6:g} MB/s to you"),
                ("stranger_rate", not has_standing and not self._strangers.ready(now),
                 "over the upload rate for peers without standing"),
                ("rate", not self._total.ready(now), f"over {s.bytes_per_second / 1e6:g} MB/s of uploads"),
            )  # fmt: skip
            for code, refused, why in checks:
                if refused:
                    self.refused[code] = self.refused.get(code, 0) + 1
                    return f"busy: {why}"
            for bucket in (own, self._total, *(() if has_standing else (self._strangers,))):
                bucket.take(nbytes)
            self._uploads[asker] = self._uploads.get(asker, 0) + 1
            self._stranger_uploads += 0 if has_standing else 1
            return None

    def release(self, asker: str, has_standing: bool) -> None:
        with self._lock:
            left = self._uploads.get(asker, 0) - 1
            if left > 0:
                self._uploads[asker] = left
            else:
                self._uploads.pop(asker, None)
            self._stranger_uploads -= 0 if has_standing else 1
