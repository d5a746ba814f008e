"""A stranger's refused requests cannot fill a holder's log: one WARNING line per reason a minute,
the next saying how many were held back, the metric counting every one. Real members (DHT nodes,
sync services) and the refusal log's own clock, turned by the test."""

from __future__ import annotations

import logging

import pytest

from peer.sync.probe import request_report
from tests.sync_members import MODULE, sync_group
from tests.test_rounds import NUMEL

pytestmark = pytest.mark.swarm


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.timeout(120)
def test_a_strangers_flood_of_refused_requests_is_one_warning_a_minute_and_every_one_is_counted(
    dht_factory, caplog
):
    left: set[str] = set()
    with sync_group(dht_factory, 2, NUMEL, left=left) as members:
        holder, stranger = members
        left.add(stranger.peer_id)  # it holds no claim on the module: its requests are refused
        clock = Clock()
        holder.service.refusal_log.clock = clock
        key = (MODULE, 0, 0)
        with caplog.at_level(logging.WARNING, logger="peer.sync.service"):
            for _ in range(20):
                assert (
                    stranger.service.call(request_report(stranger.service, key, holder.peer_id, 5.0), 10)
                    is None
                )
            clock.now += 61.0
            assert (
                stranger.service.call(request_report(stranger.service, key, holder.peer_id, 5.0), 10) is None
            )
        lines = [r.getMessage() for r in caplog.records if "refused a report_request" in r.getMessage()]
        assert holder.service.refused["not_holder"] == 21
    assert len(lines) == 2, lines
    assert "19 more refused" in lines[1], lines
