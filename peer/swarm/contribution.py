"""Publishing a peer's signed contribution record (peer/run/contribution.py signs it) from its
heartbeat: every few seconds at most, and once more as the peer leaves, with its last totals."""

from __future__ import annotations

import time
from collections.abc import Callable

import hivemind
from hivemind.utils.crypto import RSAPrivateKey

from dht.keys import CONTRIBUTION_REPUBLISH_SECONDS, CONTRIBUTION_TTL_SECONDS, contributions_key
from dht.records import store_record
from dht.schema import ContributionRecord
from peer.run.contribution import sign_contribution


class ContributionPublisher:
    """Signs and stores this peer's contribution record, at most every `every_seconds` (or at once
    with `force`, as the peer leaves). `statement()` gives the unsigned record with the totals now."""

    def __init__(
        self,
        run_name: str,
        run_id: str,
        statement: Callable[[], ContributionRecord],
        every_seconds: float = CONTRIBUTION_REPUBLISH_SECONDS,
    ):
        self.key_name = contributions_key(run_name, run_id)
        self.statement = statement
        self.every_seconds = every_seconds
        self._last = float("-inf")

    def publish(
        self, dht: hivemind.DHT, key: RSAPrivateKey, force: bool = False, admission: str = ""
    ) -> bool:
        """Stores the record, with our admission to the run if we have one (nodes keep admitted
        peers' records first under a flood)."""
        if not force and time.monotonic() - self._last < self.every_seconds:
            return False
        self._last = time.monotonic()
        record = sign_contribution(self.statement().model_copy(update={"admission": admission}), key)
        return store_record(dht, self.key_name, key, record, CONTRIBUTION_TTL_SECONDS)
