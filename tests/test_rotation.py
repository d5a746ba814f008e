"""The rotation rule on synthetic claims: deterministic, at most one mover, only when it helps."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from dht.schema import MAX_PATH_STEPS_ENTRIES, ClaimRecord
from peer.model.grid import ModelConfig
from peer.offline.grid_checkpoints import PeerCheckpoint, path_steps
from peer.run.admission import AdmissionCheck, sign_admission
from peer.swarm.claims import steering_claims
from peer.swarm.rotation import (
    RotationRead,
    claimed_path_steps,
    live_claims,
    plan_rotation,
    round_view,
    swarm_path_steps,
)
from peer.sync.standing import Standing

GRID = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64, n_levels=2, modules_per_level=2)


def claim(peer: str, path: int, steps: dict[int, int], **extra) -> ClaimRecord:
    return ClaimRecord(
        peer_id=peer,
        path=path,
        modules=["trunk"],
        path_steps={str(p): n for p, n in steps.items()},
        **extra,
    )


def three_peers(**extra) -> dict[str, ClaimRecord]:
    return {
        "a": claim("a", 0, {0: 40}),
        "b": claim("b", 1, {1: 40}),
        "c": claim("c", 2, {2: 40}, **extra),
    }


def test_one_peer_moves_to_the_uncovered_path_and_every_view_agrees():
    claims = three_peers()
    rotation = plan_rotation(GRID, claims, round_index=4, every_rounds=2)
    assert rotation is not None
    assert rotation.target == 3 and rotation.mover in claims
    assert rotation.source == claims[rotation.mover].path
    assert rotation.steps == {0: 40, 1: 40, 2: 40, 3: 0}
    # the same view in another order gives the same answer
    reordered = dict(reversed(list(claims.items())))
    assert plan_rotation(GRID, reordered, round_index=4, every_rounds=2) == rotation


def test_the_mover_changes_with_the_round():
    movers = {plan_rotation(GRID, three_peers(), r, every_rounds=1).mover for r in range(1, 40)}
    assert movers == {"a", "b", "c"}


def test_the_least_trained_uncovered_path_is_the_target_and_a_most_trained_peer_moves():
    # d left path 3 after training it; path 1 was trained longest
    claims = {
        "a": claim("a", 0, {0: 60}),
        "b": claim("b", 1, {1: 50, 3: 30}),
        "c": claim("c", 2, {2: 20, 0: 20}),
    }
    steps = swarm_path_steps(GRID, claims)
    assert steps == {0: 80, 1: 50, 2: 20, 3: 30}
    rotation = plan_rotation(GRID, claims, round_index=2, every_rounds=2)
    assert (rotation.mover, rotation.source, rotation.target) == ("a", 0, 3)


def test_a_tolerance_makes_near_equal_paths_candidates():
    claims = {"a": claim("a", 0, {0: 41}), "b": claim("b", 1, {1: 40}), "c": claim("c", 2, {2: 39})}
    strict = plan_rotation(GRID, claims, round_index=2, every_rounds=2)
    assert strict.mover == "a"
    movers = {plan_rotation(GRID, claims, r, every_rounds=1, tolerance=10).mover for r in range(1, 40)}
    assert movers == {"a", "b", "c"}


@pytest.mark.parametrize("round_index", [0, 1, 3, 5])
def test_no_move_between_rotation_rounds(round_index):
    assert plan_rotation(GRID, three_peers(), round_index, every_rounds=2) is None


def test_no_move_when_rotation_is_off():
    assert all(plan_rotation(GRID, three_peers(), r, every_rounds=0) is None for r in range(10))


def test_no_move_when_every_path_is_covered():
    claims = {**three_peers(), "d": claim("d", 3, {3: 5})}
    assert plan_rotation(GRID, claims, round_index=2, every_rounds=2) is None


def test_no_move_when_peers_cover_all_but_a_doubled_path_is_the_start_rules_business():
    # four peers, one path doubled: as many peers as paths, so should_move (at start) handles it
    claims = {**three_peers(), "d": claim("d", 0, {0: 5})}
    assert plan_rotation(GRID, claims, round_index=2, every_rounds=2) is None


def test_client_mode_and_leaving_peers_neither_cover_nor_move():
    claims = {
        "a": claim("a", 0, {0: 40}),
        "b": claim("b", 1, {1: 40}, client_mode=True),
        "c": claim("c", 2, {2: 40}, leaving=True),
    }
    rotation = plan_rotation(GRID, claims, round_index=2, every_rounds=2)
    assert rotation.mover == "a"
    # b's steps count (it trained path 1), c's do not (it left); path 2 is untrained now
    assert rotation.steps == {0: 40, 1: 40, 2: 0, 3: 0}
    assert rotation.target in (2, 3)


def test_no_move_to_a_path_trained_as_much():
    claims = {"a": claim("a", 0, {0: 10}), "b": claim("b", 1, {1: 10, 2: 20, 3: 20})}
    assert plan_rotation(GRID, claims, round_index=2, every_rounds=2) is None


def test_a_claim_names_at_most_its_most_trained_paths():
    own = {p: p + 1 for p in range(MAX_PATH_STEPS_ENTRIES + 10)}
    claimed = claimed_path_steps({**own, 999: 0})
    assert len(claimed) == MAX_PATH_STEPS_ENTRIES and "999" not in claimed and "0" not in claimed
    ClaimRecord(peer_id="a", path=0, modules=["trunk"], path_steps=claimed)


def test_a_claim_refuses_malformed_path_steps():
    with pytest.raises(ValueError):
        ClaimRecord(peer_id="a", path=0, modules=["trunk"], path_steps={"x": 1})
    with pytest.raises(ValueError):
        ClaimRecord(peer_id="a", path=0, modules=["trunk"], path_steps={"1": -1})


def test_eval_counts_a_rotated_peers_steps_on_every_path_it_trained():
    manifest = SimpleNamespace(model=GRID)
    rotated = PeerCheckpoint(Path("a"), {"path": [1, 1], "step": 50, "path_steps": {"0": 30, "3": 20}}, {})
    older = PeerCheckpoint(Path("b"), {"path": [0, 1], "step": 40}, {})  # before path_steps existed
    assert path_steps(manifest, [rotated, older]) == {0: 30, 1: 40, 2: 0, 3: 20}


def test_made_up_steps_count_at_most_h_per_round_so_far_and_no_longer_stop_a_rotation():
    # a and b share path 0 (80 steps); paths 2 and 3 are uncovered, and d says it trained both forever
    claims = {
        "a": claim("a", 0, {0: 40}),
        "b": claim("b", 0, {0: 40}),
        "d": claim("d", 1, {2: 2**39, 3: 2**39}),
    }
    assert plan_rotation(GRID, claims, round_index=4, every_rounds=2) is None  # believed: stopped
    # at round 4 with H = 10 no claim holds more than 50 steps in all: 25 on each is less than 80
    rotation = plan_rotation(GRID, claims, round_index=4, every_rounds=2, steps_per_round=10)
    assert rotation is not None and rotation.source == 0 and rotation.target in (2, 3)
    assert rotation.steps == {0: 80, 1: 0, 2: 25, 3: 25}
    # honest counts within the bound are untouched
    assert plan_rotation(GRID, three_peers(), 4, 2, steps_per_round=10).steps == {0: 40, 1: 40, 2: 40, 3: 0}


def test_step_counts_without_admission_do_not_steer_rotation_once_anyone_is_admitted():
    creator = RSAPrivateKey()
    check = AdmissionCheck("e5" * 32, creator.get_public_key().to_bytes())
    standing = Standing(check, "open")
    token = {p: sign_admission(creator, "e5" * 32, p, "invite") for p in ("a", "b", "c")}
    claims = {p: claim(p, i, {i: 40}, admission=token[p]) for i, p in enumerate(("a", "b", "c"))}
    # two free keys (client mode: they cover no path) say they trained path 3 for ages: believed,
    # nothing moves there
    claims |= {f"free{i}": claim(f"free{i}", 0, {3: 10**6}, client_mode=True) for i in range(2)}
    assert plan_rotation(GRID, claims, round_index=4, every_rounds=2) is None
    steering = set(steering_claims(claims, standing))
    assert steering == {"a", "b", "c"}
    rotation = plan_rotation(GRID, claims, round_index=4, every_rounds=2, counted=steering)
    assert rotation is not None and rotation.target == 3 and rotation.steps[3] == 0
    # our own claim counts with our token as it is now (admitted since the view was read)
    claims["a"] = claim("a", 0, {0: 40})
    standing.own_token = token["a"]
    assert "a" in steering_claims(claims, standing, me="a") and "a" not in steering_claims(claims, standing)
    # a run where nobody is admitted yet: every claim steers (the same set in every peer's view)
    assert steering_claims({p: claim(p, 0, {}) for p in ("x", "y")}, standing).keys() == {"x", "y"}


def test_views_in_which_a_peers_announcement_of_the_round_had_or_had_not_arrived_plan_on_the_same_counts():
    """Peers plan alike only from the same counts: a peer whose round ended first read the others'
    claims of the round before and moved where they did not (goodput rotation arm, session 29), and
    carrying such a claim one round on by H steps was wrong for a round trained through (longer than
    H: two peers moved onto one path, session 45). Counts are taken as of the round before, which a
    claim of either round gives exactly; a claim further behind is read again until it catches up."""

    def claim(peer, outer_round, steps, ready=True, path=0, round_steps=None) -> ClaimRecord:
        return ClaimRecord(peer_id=peer, path=path, modules=["trunk"], outer_round=outer_round,
                           path_steps={str(path): steps}, ready=ready,
                           round_steps={} if round_steps is None else {str(path): round_steps})  # fmt: skip

    def reader(*views):
        reads, views = [], iter(views)

        def read():
            reads.append(next(views))
            return reads[-1]

        return read, reads

    def view(**kw):
        return round_view(kw.pop("read", None), dict, 4, wait_seconds=30.0, stop=threading.Event(), **kw)

    # b's round 4 trained 65 steps (through a late round): one view still has its claim of round 3
    a = claim("a", 4, 200, round_steps=50)
    early, late = (
        {"a": a, "b": claim("b", 3, 150, path=1)},
        {"a": a, "b": claim("b", 4, 215, path=1, round_steps=65)},
    )
    read, reads = reader(early, late)
    first, counted = view(read=read)
    second, _ = view(read=read)
    assert len(reads) == 2 and counted == first
    assert swarm_path_steps(GRID, first) == swarm_path_steps(GRID, second) == {0: 150, 1: 150, 2: 0, 3: 0}
    # the view in hand is planned on without a read when nothing in it lags
    read, reads = reader()
    assert swarm_path_steps(GRID, view(read=read, in_hand=late)[0])[1] == 150 and reads == []
    # two rounds behind: read again until it announces the round before (a mover is not waited for)
    read, reads = reader(
        {"a": a, "b": claim("b", 3, 150, path=1), "c": claim("c", 1, 0, ready=False)},
    )
    lagging = {"a": a, "b": claim("b", 2, 100, path=1), "c": claim("c", 1, 0, ready=False)}
    claims, _ = view(read=read, in_hand=lagging)
    assert len(reads) == 1 and claims["b"].path_steps == {"1": 150} and claims["c"].outer_round == 1
    # a claim that never announces the round holds the plan back `wait_seconds`, no longer
    lagging = {"a": claim("a", 4, 200), "b": claim("b", 2, 100)}
    claims, _ = round_view(lambda: lagging, dict, 4, wait_seconds=0.2, stop=threading.Event())
    assert claims == lagging
    # nor past a stop request (SIGTERM)
    stopped = threading.Event()
    stopped.set()
    assert round_view(lambda: lagging, dict, 4, wait_seconds=30.0, stop=stopped)[0] == lagging


def test_a_peer_that_reads_the_movers_new_claim_plans_the_same_rotation_and_does_not_move_too():
    """In the goodput rotation arm (session 51) the mover went at round 20's end from path 3 to the
    uncovered path 2; another peer, reading its new claim, saw path 3 uncovered and moved there as well.
    A claim of the round on a path it trained nothing of in that round is read on the path it trained."""

    def at_round_20(peer, path, steps):
        return claim(peer, path, steps, outer_round=20, round_steps={str(path): 50})

    before = {
        "a": at_round_20("a", 1, {1: 822}),
        "b": at_round_20("b", 3, {3: 797}),
        "c": at_round_20("c", 0, {0: 791, 2: 737}),
    }
    plan = plan_rotation(GRID, round_view(lambda: before, dict, 20, 1.0, threading.Event())[0], 20, 4, 50)
    assert plan is not None and plan.target == 2
    mover, source = plan.mover, plan.source
    moved = before[mover].model_copy(update={"path": 2})
    seen, _ = round_view(lambda: before | {mover: moved}, dict, 20, 1.0, threading.Event())
    assert seen[mover].path == source
    assert plan_rotation(GRID, seen, 20, 4, 50) == plan
    # the claim of a peer that did not move, or moved in an earlier round, is read as it is
    assert all(seen[p].path == before[p].path for p in before if p != mover)
    moved_before = claim("b", 2, {3: 797, 2: 50}, outer_round=20, round_steps={"2": 50})
    seen, _ = round_view(lambda: before | {"b": moved_before}, dict, 20, 1.0, threading.Event())
    assert seen["b"].path == 2


def test_free_keys_claiming_paths_hold_no_path_unless_they_took_part_in_our_latest_trunk_round():
    creator = RSAPrivateKey()
    standing = Standing(AdmissionCheck("e5" * 32, creator.get_public_key().to_bytes()), "open")
    token = {p: sign_admission(creator, "e5" * 32, p, "invite") for p in ("a", "b")}
    claims = {p: claim(p, i, {i: 40}, admission=token[p]) for i, p in enumerate(("a", "b"))}
    # c is on probation and trains path 2 (it sends its parts); free keys claim path 3 and more
    # claims than there are paths, and never send a part
    claims["c"] = claim("c", 2, {2: 40})
    claims |= {f"free{i}": claim(f"free{i}", 3, {}) for i in range(4)}
    counted = set(steering_claims(claims, standing))
    assert counted == {"a", "b"}
    assert plan_rotation(GRID, claims, 4, 2, counted=counted) is None  # the claims believed: no rotation
    took_part = frozenset({"a", "b", "c"})  # the agreed senders of our latest trunk round
    rotation = plan_rotation(GRID, claims, 4, 2, counted=counted, took_part=took_part)
    assert rotation is not None and rotation.target == 3 and rotation.source in (0, 1)
    # c, on probation, holds its path because it took part: path 2 is not a target
    without_c = plan_rotation(GRID, claims, 4, 2, counted=counted, took_part=frozenset({"a", "b"}))
    assert without_c is not None and without_c.target in (2, 3)
    assert set(live_claims(claims, counted, took_part)) == {"a", "b", "c"}
    # with nobody admitted every claim counts, as before (the limit of an open run without a creator)
    unadmitted = {p: c.model_copy(update={"admission": ""}) for p, c in claims.items()}
    everyone = set(steering_claims(unadmitted, standing))
    assert plan_rotation(GRID, unadmitted, 4, 2, counted=everyone, took_part=took_part) is None


def test_the_heartbeat_reads_again_only_in_the_round_before_a_rotation_round_that_can_move_anyone():
    read = RotationRead(every_rounds=4, share=0.5)
    read.round_ended(1)
    read.round_ended(2)  # round 3 is no rotation round
    assert read.due is None and not read.take()
    read.round_ended(2, possible=lambda: pytest.fail("asked outside the round before a rotation"))
    read.round_ended(3, possible=lambda: False)  # every path held: round 4 moves nobody
    assert read.due is None
    read.round_ended(7)
    assert read.due is not None and read.until(read.due + 60.0) == read.due
    assert read.until(read.due - 1.0) == read.due - 1.0  # a beat before it comes first
    read.due -= 1.0  # it is due now
    assert read.take() and read.due is None and not read.take()
    assert RotationRead(every_rounds=0).until(5.0) == 5.0
