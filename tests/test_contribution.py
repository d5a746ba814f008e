"""A volunteer's contribution over the run: the ledger a peer keeps (and resumes), the record it signs,
what the monitor shows of it (only verified records; rounds confirmed by partners), the page, the
metrics and `pathswarm health`. The real swarm is in tests/test_contribution_swarm.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey
from prometheus_client import generate_latest
from pydantic import ValidationError

from dht.identity import peer_id_of_key
from dht.schema import MAX_CONTRIBUTION_PARTNERS, ClaimRecord, ContributionRecord
from monitoring.metrics import PeerMetrics
from monitoring.swarm.contributions import ContributionBoard
from monitoring.swarm.exporter import SwarmCollector, make_registry
from monitoring.swarm.page import render_page
from monitoring.swarm.status import status_dict
from monitoring.swarm.view import build_view, select_claims
from peer.model.grid import ModelConfig
from peer.run.admission import AdmissionCheck, sign_admission
from peer.run.contribution import check_contribution, sign_contribution
from peer.sync.pending import FragmentDone
from peer.sync.rounds import RoundResult
from peer.training.contribution import ContributionLedger, modules_held

RUN_ID = "a" * 64
GRID = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64, n_levels=2, modules_per_level=2)
KEYS = [RSAPrivateKey() for _ in range(4)]
IDS = [peer_id_of_key(k) for k in KEYS]


def signed(i: int, **numbers) -> ContributionRecord:
    return sign_contribution(ContributionRecord(run_id=RUN_ID, peer_id=IDS[i], **numbers), KEYS[i])


def claim(i: int, **kw) -> ClaimRecord:
    return ClaimRecord(peer_id=IDS[i], path=0, modules=["trunk", "l0m0", "l1m0"], **kw)


def open_board() -> ContributionBoard:
    return ContributionBoard(RUN_ID, None)


def test_a_record_verifies_only_when_signed_by_its_own_peer_for_this_run_and_untouched():
    good = signed(0, tokens=1000, inner_steps=10, rounds_averaged=2)
    assert check_contribution(good, RUN_ID) is None
    # tampered after signing: the numbers are not what the peer signed
    tampered = good.model_copy(update={"tokens": 10**12})
    assert check_contribution(tampered, RUN_ID) == "signature does not match"
    # a record for peer 0 signed with peer 1's key (its public key and signature are peer 1's)
    forged = sign_contribution(ContributionRecord(run_id=RUN_ID, peer_id=IDS[0], tokens=10**12), KEYS[1])
    assert check_contribution(forged, RUN_ID) == "signed by another key"
    unsigned = ContributionRecord(run_id=RUN_ID, peer_id=IDS[0], tokens=10**12)
    assert check_contribution(unsigned, RUN_ID) == "no readable public key"
    assert check_contribution(good, "b" * 64) == "another run"


def test_a_record_names_a_bounded_number_of_partners():
    partners = {f"Qm{i}": 1 for i in range(MAX_CONTRIBUTION_PARTNERS + 1)}
    with pytest.raises(ValidationError):
        ContributionRecord(run_id=RUN_ID, peer_id=IDS[0], averaged_with=partners)


def test_forged_or_tampered_records_are_never_shown_as_a_peers_contribution():
    board = open_board()
    real = signed(0, tokens=1000, inner_steps=10, rounds_averaged=2, online_seconds=60)
    forged = sign_contribution(ContributionRecord(run_id=RUN_ID, peer_id=IDS[0], tokens=10**12), KEYS[1])
    tampered = signed(1, tokens=5).model_copy(update={"tokens": 10**12})
    rows = board.update([forged, real, tampered], {IDS[0]: claim(0), IDS[1]: claim(1)})
    assert [(r.peer_id, r.tokens) for r in rows] == [(IDS[0], 1000)]
    assert board.rejected == {"signed by another key": 1, "signature does not match": 1}
    # the forged record arriving again, alone, changes nothing
    rows = board.update([forged], {IDS[0]: claim(0)})
    assert [(r.peer_id, r.tokens) for r in rows] == [(IDS[0], 1000)]


def test_a_departed_peer_stays_on_the_board_with_its_last_signed_totals():
    board = open_board()
    board.update([signed(0, tokens=1000), signed(1, tokens=500)], {IDS[0]: claim(0), IDS[1]: claim(1)})
    rows = board.update([], {IDS[1]: claim(1)})  # peer 0 left, its record expired
    assert [(r.peer_id, r.rank, r.tokens, r.online) for r in rows] == [
        (IDS[0], 1, 1000, False),
        (IDS[1], 2, 500, True),
    ]


def test_rounds_averaged_are_confirmed_by_a_partners_own_record_never_above_the_claim():
    board = open_board()
    records = [
        signed(0, rounds_averaged=10),
        signed(1, rounds_averaged=6, averaged_with={IDS[0]: 6, IDS[2]: 2}),
        signed(2, rounds_averaged=50, averaged_with={IDS[0]: 4, IDS[1]: 2}),
        signed(3, rounds_averaged=5),  # nobody says they averaged with 3
    ]
    rows = {r.peer_id: r for r in board.update(records, {})}
    assert rows[IDS[0]].rounds_confirmed == 6  # the most any one partner confirms
    assert rows[IDS[1]].rounds_confirmed == 2
    assert rows[IDS[2]].rounds_averaged == 50 and rows[IDS[2]].rounds_confirmed == 2
    assert rows[IDS[3]].rounds_confirmed == 0


def test_where_a_partner_is_admitted_only_admitted_partners_confirm():
    creator = RSAPrivateKey()
    check = AdmissionCheck(RUN_ID, creator.get_public_key().to_bytes())
    board = ContributionBoard(RUN_ID, check)
    admitted = sign_admission(creator, RUN_ID, IDS[1], "invite")
    records = [
        signed(0, rounds_averaged=10),
        signed(1, averaged_with={IDS[0]: 3}),
        signed(2, averaged_with={IDS[0]: 9}),  # not admitted: a key anyone could make
    ]
    claims = {IDS[1]: claim(1, admission=admitted), IDS[2]: claim(2)}
    rows = {r.peer_id: r for r in board.update(records, claims)}
    assert rows[IDS[0]].rounds_confirmed == 3


def _round(members: list[str], outcome: str = "averaged") -> FragmentDone:
    return FragmentDone(0, 10, {"trunk": RoundResult(outcome, torch.zeros(1), len(members), members=members)})


def test_the_ledger_counts_rounds_with_others_and_resumes_its_totals():
    counters = {"step": 30, "tokens": 3000, "paths": {0: 20, 3: 10}}
    ledger = ContributionLedger(lambda: (counters["step"], counters["tokens"], counters["paths"]))
    ledger.model = GRID
    ledger.end_round(_round(["me", "b", "c"]), "me")
    ledger.end_round(_round(["me"], "alone"), "me")  # alone: not a round averaged with others
    ledger.end_round(_round(["me", "b"]), "me")
    meta = ledger.meta()
    assert meta["rounds_averaged"] == 2 and meta["averaged_with"] == {"b": 2, "c": 1}
    # paths 0 (trunk l0m0 l1m0) and 3 (trunk l0m1 l1m1): five distinct modules
    assert meta["modules_held"] == 5 == modules_held(GRID, counters["paths"])
    assert meta["tokens"] == 3000 and meta["inner_steps"] == 30
    resumed = ContributionLedger(lambda: (counters["step"], counters["tokens"], counters["paths"]))
    resumed.restore({"peer_id": "me", "contribution": {**meta, "online_seconds": 7200}}, "me")
    resumed.end_round(_round(["me", "c"]), "me")
    again = resumed.meta()
    assert again["rounds_averaged"] == 3 and again["averaged_with"] == {"b": 2, "c": 2}
    assert 7200 <= again["online_seconds"] < 7210  # time online adds up over starts
    older = ContributionLedger(lambda: (0, 0, {}))
    older.restore({"step": 5, "peer_id": "me"}, "me")  # a checkpoint from before the ledger: no totals
    assert older.meta()["rounds_averaged"] == 0 and older.meta()["averaged_with"] == {}


def _status_with_board() -> dict:
    board = open_board()
    records = [
        signed(0, tokens=123456, inner_steps=40, rounds_averaged=4, modules_held=3, online_seconds=5400),
        signed(1, tokens=99, rounds_averaged=3, averaged_with={IDS[0]: 3}),
    ]
    view = build_view("r", RUN_ID, GRID, select_claims([(claim(0), 1e12)]))
    view.contributions = board.update(records, {IDS[0]: claim(0)})
    return status_dict(view, [])


def test_the_page_ranks_contributions_and_shows_one_volunteers_card():
    status = _status_with_board()
    page = render_page(status, IDS[0][:12])
    assert f'data-contribution="{IDS[0]}" data-tokens="123456" data-steps="40" data-rounds="4"' in page
    assert 'id="my-contribution"' in page and "#1 of 2" in page and "1.50" in page  # 5400 s = 1.50 h
    assert "of them confirmed by partners<b>3</b>" in page
    assert "no signed contribution record" in render_page(status, "QmNobody")


def test_the_monitor_exports_each_contributors_totals():
    status = _status_with_board()
    assert status["contributions"][0]["rounds_confirmed"] == 3
    collector = SwarmCollector(max_peer_series=1)
    board = open_board()
    view = build_view("r", RUN_ID, GRID, select_claims([(claim(0), 1e12)]))
    view.contributions = board.update([signed(0, tokens=7), signed(1, tokens=9)], {})
    collector.publish(view, 0.1, 3)
    text = generate_latest(make_registry(collector)).decode()
    assert f'pathswarm_swarm_peer_contribution_tokens{{peer_id="{IDS[1]}"}} 9.0' in text
    assert IDS[0] not in text.split("pathswarm_swarm_peer_contribution_tokens")[2]  # capped at 1 series
    assert "pathswarm_swarm_contribution_series_omitted 1.0" in text


@pytest.mark.swarm  # runs `pathswarm health` as a process
@pytest.mark.timeout(60)
def test_health_prints_the_peers_contribution_over_the_run():
    metrics = PeerMetrics("r", IDS[0], "0", "test")
    totals = dict(tokens=4096, inner_steps=32, rounds_averaged=3, modules_held=3, online_seconds=9000)
    metrics.follow_contribution(lambda: totals)
    metrics.observe_step(128, 2.5, 100.0)
    port = metrics.serve(0, "127.0.0.1")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "peer", "health", "--metrics_port", str(port), "--timeout_seconds", "5"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    finally:
        metrics.shutdown()
    assert out.returncode == 0, out
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("healthy"), lines
    assert lines[1].startswith(
        "contribution over the run: 4096 tokens trained, 32 inner steps, 3 rounds averaged with others, "
        "3 modules held, 2.50 hours online"
    ), lines


def test_a_checkpoint_resumed_under_another_key_does_not_carry_its_totals_to_the_new_key():
    counters = {"step": 30, "tokens": 3000, "paths": {0: 30}}
    ledger = ContributionLedger(lambda: (counters["step"], counters["tokens"], counters["paths"]))
    ledger.model = GRID
    kept = {"tokens": 3000, "inner_steps": 30, "rounds_averaged": 3, "online_seconds": 900}
    written = {"peer_id": "old", "step": 30, "tokens_total": 3000, "path_steps": {"0": 30}}
    written["contribution"] = kept
    ledger.restore(written, "new")  # no --identity_path: a fresh key resumed the old key's checkpoint
    assert ledger.meta() == dict(tokens=0, inner_steps=0, rounds_averaged=0, modules_held=0,
                                 online_seconds=0, averaged_with={})  # fmt: skip
    counters.update(step=40, tokens=4000, paths={0: 35, 1: 5})  # the new key trains on
    totals = ledger.meta()
    assert (totals["tokens"], totals["inner_steps"], totals["modules_held"]) == (1000, 10, 4)
