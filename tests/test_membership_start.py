"""A peer's announcement that it is ready (`Membership.start`) on real DHT nodes: two holders of a
module that (re)start at the same moment must see each other before their first round, or each
decides that round alone and their copies split (the goodput churn arm's double kills)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dht.node import start_dht
from dht.schema import ClaimRecord
from monitoring.metrics import PeerMetrics
from peer.config import PeerConfig
from peer.model.grid import all_paths, path_index, path_module_ids
from peer.run.record import load_verified_manifest
from peer.swarm.claims import publish_claim
from peer.swarm.membership import Membership
from peer.swarm.progress import Progress
from tests.swarm_harness import RUN, write_manifest

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


def test_a_holder_that_claimed_after_our_first_read_is_in_our_view_once_we_say_we_are_ready(tmp_path):
    path, _ = write_manifest(tmp_path, grid=(1, 1))
    manifest, record = load_verified_manifest(path)
    first, first_key = start_dht(run_name=RUN, run_id=record.run_id)
    maddrs = [str(a) for a in first.get_visible_maddrs()]
    second, second_key = start_dht(initial_peers=maddrs, run_name=RUN, run_id=record.run_id)
    members = []
    try:
        for dht, key, name in ((first, first_key, "a"), (second, second_key, "b")):
            # heartbeats far apart: only what start() itself reads can show the other holder
            config = PeerConfig(
                run=RUN,
                new_swarm=True,
                manifest_path=path,
                checkpoint_dir=tmp_path / name,
                heartbeat_seconds=14.0,
            )
            members.append(Membership(dht, key, config, manifest, record, Progress, torch.device("cpu")))
        a, b = members
        only_path = all_paths(manifest.model)[0]
        a.read_claims()  # a restarted peer reads the view, then claims its checkpoint's path
        a.claim_path(only_path)
        b.read_claims()
        b.claim_path(only_path)  # the other holder, restarted at the same moment, claims after a's read
        b.start(PeerMetrics(RUN, b.peer_id, "0", "test"))
        a.start(PeerMetrics(RUN, a.peer_id, "0", "test"))
        holders = a.holders()
        for module in path_module_ids(manifest.model, only_path):
            assert b.peer_id in holders.get(module, []), (module, holders)
    finally:
        for m in members:
            m.shutdown()
        second.shutdown()
        first.shutdown()


def test_a_claim_the_heartbeat_made_as_we_moved_is_stored_with_the_path_we_moved_to(tmp_path):
    # the heartbeat's publish waits while the move's own store is in flight; made before the move and
    # stored after it, its record put the mover back on its old path in every view (same step, later
    # expiry) until the next beat: holders of its new modules left it out of their rounds as gone
    # (goodput rotation arm: a 5 s stall of every peer, twice in 30 runs)
    path, _ = write_manifest(tmp_path)
    manifest, record = load_verified_manifest(path)
    dht, key = start_dht(run_name=RUN, run_id=record.run_id)
    config = PeerConfig(run=RUN, new_swarm=True, manifest_path=path, checkpoint_dir=tmp_path / "a")
    member = Membership(dht, key, config, manifest, record, Progress, torch.device("cpu"))
    try:
        old, new = all_paths(manifest.model)[:2]
        member.claim_path(old)
        with member._lock:  # the move's store is in flight
            beat = threading.Thread(target=member.publish_claim)
            beat.start()
            time.sleep(0.5)  # the heartbeat waits for the lock
            member.path, member.ready = new, False  # Membership.move_to
            publish_claim(dht, key, RUN, record.run_id, member.claim_record())
        beat.join(30)
        assert not beat.is_alive()
        claim = member.read_claims()[member.peer_id]
        assert claim.path == path_index(manifest.model, new), claim
    finally:
        member.shutdown()
        dht.shutdown()


def test_in_the_round_before_a_rotation_round_the_heartbeat_reads_the_claims_between_its_beats(tmp_path):
    """The rotation of round r is planned on every claim of round r - 1, and a view one beat old had the
    others' claims of round r - 2: the training thread read the DHT at the round's end (2–3% of the
    goodput rotation arm). Half a round after our round r - 1 ends the heartbeat reads once more; in
    other rounds it reads only at its beats."""
    path, _ = write_manifest(tmp_path)
    manifest, record = load_verified_manifest(path)
    dht, key = start_dht(run_name=RUN, run_id=record.run_id)
    maddrs = [str(a) for a in dht.get_visible_maddrs()]
    other_dht, other = start_dht(initial_peers=maddrs, run_name=RUN, run_id=record.run_id)
    progress = Progress()
    config = PeerConfig(run=RUN, new_swarm=True, manifest_path=path, checkpoint_dir=tmp_path / "a",
                        heartbeat_seconds=14.0, rotate_every_rounds=4)  # fmt: skip
    member = Membership(dht, key, config, manifest, record, lambda: progress, torch.device("cpu"))
    try:
        ours, theirs = all_paths(manifest.model)[:2]
        member.claim_path(ours)
        member.start(PeerMetrics(RUN, member.peer_id, "0", "test"))
        claim = ClaimRecord(peer_id=str(other_dht.peer_id), path=path_index(manifest.model, theirs),
                            modules=path_module_ids(manifest.model, theirs), outer_round=2)  # fmt: skip
        assert publish_claim(other_dht, other, RUN, record.run_id, claim)

        def rounds_end(*rounds: int) -> None:
            for r in rounds:
                progress.outer_round = r
                member.announce()
                time.sleep(0.2)

        rounds_end(1, 2)  # round 3 is no rotation round: nothing read between beats
        time.sleep(1.0)
        assert claim.peer_id not in member.claims
        rounds_end(3)  # round 4 is
        deadline = time.monotonic() + 5.0
        while claim.peer_id not in member.claims and time.monotonic() < deadline:
            time.sleep(0.05)
        assert claim.peer_id in member.claims
    finally:
        member.shutdown()
        other_dht.shutdown()
        dht.shutdown()
