"""A peer's measured round pace outlives a restart (peer/sync/stragglers.py): kept beside the rounds it
sent, in its checkpoint directory, for this run and an hour; anything else starts without a pace."""

from __future__ import annotations

import json
import logging
import time

import pytest

from peer.sync.stragglers import FILE_NAME, KEPT_SECONDS, MIN_ROUNDS, MIN_SECONDS, MULTIPLE, StragglerBound

pytestmark = pytest.mark.timeout(30)


def test_a_restarted_peer_waits_as_long_as_the_pace_it_measured_before_not_the_timeout(tmp_path):
    before = StragglerBound(tmp_path, "run-a")
    for seconds in (1.5, 2.0, 2.5):
        before.record(seconds)
    assert before.seconds() == max(MIN_SECONDS, MULTIPLE * 2.0)
    # a fresh bound has no pace until MIN_ROUNDS rounds: a new peer, or one without a checkpoint dir
    assert StragglerBound().seconds() is None and MIN_ROUNDS == 3
    after = StragglerBound(tmp_path, "run-a")  # the next life, same checkpoint directory
    assert after.seconds() == before.seconds()


def test_the_pace_of_another_run_or_of_more_than_an_hour_ago_is_not_used(tmp_path):
    bound = StragglerBound(tmp_path, "run-a")
    for seconds in (2.0, 2.0, 2.0):
        bound.record(seconds)
    assert StragglerBound(tmp_path, "run-b").seconds() is None
    data = json.loads((tmp_path / FILE_NAME).read_text())
    data["at"] = time.time() - KEPT_SECONDS - 60
    (tmp_path / FILE_NAME).write_text(json.dumps(data))
    assert StragglerBound(tmp_path, "run-a").seconds() is None


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '["a list"]',
        '{"run": "run-a", "at": 1.0, "gather_seconds": ["fast", "slow", "fast"]}',
        '{"run": "run-a", "at": 1.0, "gather_seconds": [-1.0, 2.0, 2.0]}',
        '{"run": "run-a", "at": 1.0, "gather_seconds": [' + ", ".join(["1.0"] * 1000) + "]}",
    ],
)
def test_a_file_that_is_not_a_pace_is_ignored_with_a_warning_naming_it(tmp_path, caplog, text):
    (tmp_path / FILE_NAME).write_text(text)
    with caplog.at_level(logging.WARNING):
        bound = StragglerBound(tmp_path, "run-a")
    assert bound.seconds() is None
    assert FILE_NAME in caplog.text
    bound.record(1.0)  # and it is replaced by this life's measurement
    assert json.loads((tmp_path / FILE_NAME).read_text())["gather_seconds"] == [1.0]
