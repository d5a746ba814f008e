"""What other peers can make a peer upload (`dht.serve_limits.ServeLimits`): a flood of fresh keys
takes no more than the strangers' share of the uploads and of the bytes, admitted askers are still
served through it, and one asker cannot hold more than its own share; on a clock the test turns."""

from __future__ import annotations

import pytest

from dht.serve_limits import ServeLimits, ServeLimitSettings

MB = 1_000_000
SETTINGS = ServeLimitSettings(
    bytes_per_second=32 * MB,
    uploads_at_once=8,
    per_asker_bytes_per_second=16 * MB,
    per_asker_uploads_at_once=2,
    stranger_share=0.5,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_of_fresh_keys_gets_only_the_strangers_share_and_admitted_peers_are_still_served():
    clock = Clock()
    limits = ServeLimits(SETTINGS, clock)
    served = [k for k in range(1000) if limits.acquire(f"sybil{k}", 1 * MB, has_standing=False) is None]
    # four uploads at once (half of eight), and no more bytes than half the rate allows in a second
    assert len(served) == 4, served
    assert limits.acquire("admitted", 8 * MB, has_standing=True) is None
    for k in served:
        limits.release(f"sybil{k}", has_standing=False)
    # over a simulated minute of a flood, strangers move at most their share of the bytes
    sent = 0
    for second in range(60):
        clock.now += 1.0
        for k in range(200):
            if limits.acquire(f"new{second}-{k}", 4 * MB, has_standing=False) is None:
                sent += 4 * MB
                limits.release(f"new{second}-{k}", has_standing=False)
    assert sent <= 60 * 16 * MB + 16 * MB + 4 * MB, sent / MB  # 16 MB/s, a second's burst, one in debt
    assert sent >= 60 * 12 * MB, sent / MB  # and the share is not starved either
    assert limits.acquire("admitted", 8 * MB, has_standing=True) is None


def test_one_asker_gets_its_own_rate_and_uploads_at_once_and_a_whole_state_still_goes_out():
    clock = Clock()
    limits = ServeLimits(SETTINGS, clock)
    # a state larger than a second's budget goes out whole (the bucket runs into debt) ...
    assert limits.acquire("joiner", 40 * MB, has_standing=True) is None
    limits.release("joiner", has_standing=True)
    # ... and the asker then waits until its debt is paid at its own rate
    assert limits.acquire("joiner", 1 * MB, has_standing=True).startswith("busy: over 16 MB/s to you")
    clock.now += (40 - 16) / 16 - 0.2  # it started with a second's tokens
    assert limits.acquire("joiner", 1 * MB, has_standing=True) is not None
    clock.now += 0.3
    assert limits.acquire("joiner", 1 * MB, has_standing=True) is None
    assert limits.acquire("joiner", 1 * MB, has_standing=True) is None  # tokens left over the debt
    assert "uploads to you at once" in limits.acquire("joiner", 1, has_standing=True)
    limits.release("joiner", has_standing=True)
    assert limits.acquire("other", 1 * MB, has_standing=True) is None


@pytest.mark.parametrize("has_standing", [True, False])
def test_the_total_of_uploads_at_once_holds_for_every_asker(has_standing):
    limits = ServeLimits(SETTINGS, Clock())
    for k in range(8):
        assert limits.acquire(f"admitted{k}", 1, has_standing=True) is None
    assert limits.acquire("late", 1, has_standing=has_standing).startswith("busy")
