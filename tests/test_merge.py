"""Diverged copies of a fragment with no majority among them, merged between real peers on loopback:
every member ends with the same bits, one far-off copy cannot drag the result, and a member that
serves a copy other than the one it reported is left out."""

from __future__ import annotations

import pytest
import torch

from peer.sync.merge import ReportedCopies, install_copy_handler, merged_copy
from peer.sync.module_sync import state_digest
from tests.sync_members import MODULE, sync_group

pytestmark = pytest.mark.swarm

NUMEL = 3001


def _copies(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(NUMEL, generator=gen)
    return [
        (base + 0.01 * torch.randn(NUMEL, generator=gen), 0.1 * torch.randn(NUMEL, generator=gen))
        for _ in range(n)
    ]


def _merge_everywhere(members, copies, served=None):
    """Each member remembers its copy (or `served[i]` under copy i's digest) and merges with all others."""
    digests = [state_digest(*c) for c in copies]
    for i, m in enumerate(members):
        kept = ReportedCopies(keep_seconds=60)
        kept.remember(MODULE, 0, digests[i], (served or copies)[i])
        install_copy_handler(m.service, kept)
    ids = [m.peer_id for m in members]
    futures = []
    for i, m in enumerate(members):
        reported = dict(zip(ids, digests, strict=True))  # the round's voters, this member included
        futures.append(
            m.service.submit(merged_copy(m.service, MODULE, 0, copies[i], digests[i], reported, 10.0))
        )
    return [f.result(timeout=60) for f in futures]


def test_two_diverged_copies_merge_into_their_mean_on_both_members(dht_factory):
    copies = _copies(2)
    with sync_group(dht_factory, 2, 1) as members:
        results = _merge_everywhere(members, copies)
    (theta, momentum), used = results[0]
    assert all(torch.equal(theta, r[0][0]) and torch.equal(momentum, r[0][1]) for r in results)
    assert used == sorted(m.peer_id for m in members)
    assert torch.allclose(theta, (copies[0][0] + copies[1][0]) / 2, atol=1e-6)
    assert torch.allclose(momentum, (copies[0][1] + copies[1][1]) / 2, atol=1e-6)


def test_a_far_off_copy_moves_the_merge_of_four_by_little_and_all_end_equal(dht_factory):
    copies = _copies(4, seed=1)
    honest = torch.stack([c[0] for c in copies[:3]]).mean(0)
    copies[3] = (copies[3][0] * 1000, copies[3][1])
    with sync_group(dht_factory, 4, 1) as members:
        results = _merge_everywhere(members, copies)
    theta = results[0][0][0]
    assert all(torch.equal(theta, r[0][0]) for r in results)
    spread = max(float((c[0] - honest).norm()) for c in copies[:3])
    assert float((theta - honest).norm()) < 2 * spread  # the plain mean would be ~250x off


def test_a_member_serving_another_copy_than_it_reported_is_left_out_of_the_merge(dht_factory):
    copies = _copies(3, seed=2)
    served = list(copies)
    served[2] = (copies[2][0] + 1.0, copies[2][1])  # reports one copy's digest, serves a poisoned one
    with sync_group(dht_factory, 3, 1) as members:
        results = _merge_everywhere(members, copies, served)
        honest_ids = sorted(m.peer_id for m in members[:2])
    for (theta, _), used in results[:2]:
        assert used == honest_ids
        assert torch.allclose(theta, (copies[0][0] + copies[1][0]) / 2, atol=1e-6)
    assert torch.equal(results[0][0][0], results[1][0][0])


def test_a_copy_holding_values_no_state_may_have_is_left_out_of_a_pairs_merge(dht_factory):
    copies = _copies(2, seed=3)
    copies[1] = (torch.full_like(copies[1][0], 1e37), copies[1][1])  # finite, and far past any state
    with sync_group(dht_factory, 2, 1) as members:
        results = _merge_everywhere(members, copies)
    (theta, momentum), used = results[0]
    assert used == [members[0].peer_id]  # the honest member keeps its own copy, unmoved
    assert torch.equal(theta, copies[0][0]) and torch.equal(momentum, copies[0][1])


def test_a_member_a_round_behind_still_downloads_the_copy_we_reported_before_our_latest_round(dht_factory):
    # a healed partition's halves run a round apart: the half behind asks for the copy the half ahead
    # reported in the round it already left; refusing it made the merge one-sided (the copies stayed split)
    older, newer, theirs = _copies(3, seed=3)
    digests = [state_digest(*c) for c in (older, newer, theirs)]
    with sync_group(dht_factory, 2, 1) as members:
        ahead, behind = members
        kept = ReportedCopies(keep_seconds=60)
        kept.remember(MODULE, 0, digests[0], older)
        kept.remember(MODULE, 0, digests[1], newer)  # its next round
        install_copy_handler(ahead.service, kept)
        install_copy_handler(behind.service, ReportedCopies(keep_seconds=60))
        reported = {ahead.peer_id: digests[0], behind.peer_id: digests[2]}
        coro = merged_copy(behind.service, MODULE, 0, theirs, digests[2], reported, 10.0)
        (theta, _), used = behind.service.submit(coro).result(timeout=60)
    assert used == sorted(reported)
    assert torch.allclose(theta, (older[0] + theirs[0]) / 2, atol=1e-6)


def test_reported_copies_keep_only_the_latest_two_rounds_per_fragment():
    copies = _copies(3, seed=4)
    kept = ReportedCopies(keep_seconds=60)
    for c in copies:
        kept.remember(MODULE, 0, state_digest(*c), c)
    assert kept.find(MODULE, 0, state_digest(*copies[0])) is None  # memory stays bounded
    assert all(kept.find(MODULE, 0, state_digest(*c)) is c for c in copies[1:])
    assert kept.find(MODULE, 1, state_digest(*copies[2])) is None
