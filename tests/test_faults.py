"""Fault-injection spec parsing, hit counting, and the raise/stall/kill actions."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer import faults
from peer.faults import ENV_VAR, KNOWN_POINTS, FaultRule, InjectedFault, fault_point, parse_faults

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_faults(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    faults.reset_faults()
    yield
    faults.reset_faults()


def test_known_points_registry():
    for name in (
        "checkpoint.after_tensors",
        "checkpoint.before_manifest",
        "outer.before_allreduce",
        "outer.after_allreduce",
        "train.step",
    ):
        assert name in KNOWN_POINTS


def test_parse():
    rules = parse_faults(" train.step@3=stall:0.5, outer.before_allreduce=raise,train.step@5=kill,, ")
    assert rules == {
        "train.step": [
            FaultRule("train.step", "stall", seconds=0.5, nth=3),
            FaultRule("train.step", "kill", nth=5),
        ],
        "outer.before_allreduce": [FaultRule("outer.before_allreduce", "raise")],
    }
    assert parse_faults("") == {}


@pytest.mark.parametrize(
    "spec",
    [
        "train.step",
        "train.step=explode",
        "train.step=stall",
        "train.step=stall:x",
        "train.step=stall:-1",
        "train.step@0=kill",
        "train.step@x=kill",
        "=kill",
        "train.step=kill:3",
    ],
)
def test_parse_rejects(spec):
    with pytest.raises(ValueError):
        parse_faults(spec)


def test_unset_variable_fires_nothing_even_after_a_spec_was_set(monkeypatch):
    for _ in range(3):
        assert fault_point("train.step") is None
    monkeypatch.setenv(ENV_VAR, "train.step=raise")
    with pytest.raises(InjectedFault):
        fault_point("train.step")
    # the parsed spec follows the variable: once it is gone, nothing fires any more
    monkeypatch.delenv(ENV_VAR)
    for _ in range(3):
        assert fault_point("train.step") is None


def test_raise_every_time(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "outer.after_allreduce=raise")
    fault_point("train.step")  # other points are unaffected
    for _ in range(2):
        with pytest.raises(InjectedFault) as info:
            fault_point("outer.after_allreduce")
        assert info.value.point == "outer.after_allreduce"


def test_nth_hit_counting(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "train.step@3=raise")
    fault_point("train.step")
    fault_point("train.step")
    with pytest.raises(InjectedFault):
        fault_point("train.step")
    fault_point("train.step")  # only the third hit fires


def test_spec_change_resets_counters(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "train.step@2=raise")
    fault_point("train.step")
    monkeypatch.setenv(ENV_VAR, "train.step@2=raise,outer.before_allreduce=stall:0")
    fault_point("train.step")  # hit 1 again under the new spec
    with pytest.raises(InjectedFault):
        fault_point("train.step")


def test_stall(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "train.step=stall:0.2")
    start = time.monotonic()
    fault_point("train.step")
    assert time.monotonic() - start >= 0.2


@pytest.mark.swarm
def test_kill_in_subprocess():
    code = (
        "from peer.faults import fault_point\n"
        "fault_point('train.step')\n"
        "print('first', flush=True)\n"
        "fault_point('train.step')\n"
        "print('survived', flush=True)\n"
    )
    env = {**os.environ, ENV_VAR: "train.step@2=kill", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout == "first\n"
    assert "injected kill" in proc.stderr
