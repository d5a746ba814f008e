"""The tools behind sessions 54-55's protocol figures: `benchmarks.round_bytes` (a round's bytes per
member by frame kind), `benchmarks.aggregate_cost` (each aggregator's time, and whether an earlier
commit's aggregate.py gives the same bits) and `benchmarks.codec_cost` (each codec's encode and decode
time, and whether an earlier commit's formats.py sends the same bytes)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import aggregate_cost, codec_cost, round_bytes

REPO = Path(__file__).resolve().parents[1]


def _head() -> str:
    """This checkout's commit, the tools' reference (the test skips outside a git checkout)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    return head.stdout.strip()


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_a_round_of_three_members_counts_each_members_part_to_the_two_others_and_reports_by_kind(tmp_path):
    out = tmp_path / "round_bytes.json"
    round_bytes.main(
        ["--members", "3", "--numel", "4096", "--codec", "fp32", "--rounds", "1", "--out", f"{out}"]
    )
    (row,) = json.loads(out.read_text())["rounds"]
    assert row["outcomes"] == ["averaged"] * 3
    kinds = row["by_kind_per_member"]
    # an fp32 part of 4096 values (16 kB and its 5-byte frame) to each of the two others
    assert kinds["PAYLOAD"] == 2 * (4 * 4096 + 5)
    assert {"REPORT", "ECHO", "DELTA", "ACK"} <= set(kinds)
    assert row["bytes_sent_per_member"] >= kinds["PAYLOAD"] + kinds["REPORT"]


@pytest.mark.swarm  # it runs git
@pytest.mark.timeout(120)
def test_the_aggregation_tool_finds_the_same_bits_at_head_and_names_its_reference(capsys):
    aggregate_cost.main(["--numel", "2048", "--repeats", "1", "--reference", _head()])
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith(("| dense", "| sparse"))]
    assert len(rows) == 10 and all(line.endswith("| yes |") for line in rows), table


@pytest.mark.swarm  # it runs git
@pytest.mark.timeout(120)
def test_the_codec_tool_finds_the_same_bytes_at_head_for_every_codec(capsys):
    codec_cost.main(["--numel", "5000", "--repeats", "1", "--reference", _head()])
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| codec")]
    assert [r.split(" | ")[0][2:] for r in rows] == list(codec_cost.CODECS), table
    assert all(line.endswith("| yes |") for line in rows), table
