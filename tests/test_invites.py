"""The run's authority redeems invite codes one at a time, also when redemptions come at once: each
runs on an executor thread, and two that read the invites before either wrote them back used to each
write what they had read, so that one undid the other's and a redeemed code could be redeemed again
by another key (seen in CI: a "thief" admitted with a code already redeemed)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from hivemind.utils.crypto import RSAPrivateKey

from peer.cli.main import main
from peer.config import AdmissionConfig
from peer.run.record import load_record, load_verified_manifest
from peer.swarm import authority
from peer.swarm.authority import AdmissionAuthority, code_digest, invites_path, new_invite_code, read_invites
from peer.sync import wire
from tests.swarm_harness import write_manifest
from tests.sync_members import sync_group

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


def _both_read_before_either_writes(monkeypatch) -> None:
    """Each redemption waits, after reading the invites, until the other has read them too (for at
    most a second): without the lock both then write back what they read."""
    both = threading.Barrier(2)
    plain = authority.read_invites

    def read_then_wait(path):
        invites = plain(path)
        try:
            both.wait(timeout=1.0)
        except threading.BrokenBarrierError:  # the other waits for our lock: it reads after our write
            pass
        return invites

    monkeypatch.setattr(authority, "read_invites", read_then_wait)


def test_one_invite_code_redeemed_by_two_keys_at_once_admits_exactly_one(
    tmp_path, dht_factory, monkeypatch, capsys
):
    creator = RSAPrivateKey()
    manifest_path, _ = write_manifest(tmp_path, creator=creator, admission=AdmissionConfig(mode="invite"))
    assert main(["run", "invite", "--manifest_path", str(manifest_path), "--count", "3"]) == 0
    codes = capsys.readouterr().out.split()[:3]
    with sync_group(dht_factory, 1, 16) as (member,):
        auth = AdmissionAuthority(
            member.service, creator, load_verified_manifest(manifest_path)[0], load_record(manifest_path),
            invites_path(manifest_path), dict,
        )  # fmt: skip
        _both_read_before_either_writes(monkeypatch)

        def redeem(sender: str, code: str) -> str:
            try:
                return auth._redeem(sender, code)
            except PermissionError as e:
                return str(e)

        with ThreadPoolExecutor(2) as pool:
            same = list(pool.map(redeem, ["QmAlice", "QmThief"], [codes[0], codes[0]]))
            other = list(pool.map(redeem, ["QmBob", "QmCarol"], codes[1:]))
    assert sorted(same) == ["invite", "this invite code was redeemed by another key"]
    assert other == ["invite", "invite"]
    kept = read_invites(invites_path(manifest_path))
    winner = "QmAlice" if same[0] == "invite" else "QmThief"
    assert [kept[code_digest(c)]["peer_id"] for c in codes] == [winner, "QmBob", "QmCarol"]


def test_a_strangers_unknown_codes_are_refused_without_reading_the_invites_again(
    tmp_path, dht_factory, monkeypatch, capsys
):
    """ADMIT requests with codes the authority never issued (any key may send them, as many as it
    likes) are refused from the invites as last read: the file is parsed again only when it changed
    (a redemption, `run invite`), so a flood of guesses costs no read of up to 10,000 entries under
    the file's lock. Codes issued after the authority started and a key's own redeemed code still
    pass; a code another key redeemed is refused."""
    creator = RSAPrivateKey()
    manifest_path, _ = write_manifest(tmp_path, creator=creator, admission=AdmissionConfig(mode="invite"))
    assert main(["run", "invite", "--manifest_path", str(manifest_path), "--count", "2"]) == 0
    codes = capsys.readouterr().out.split()[:2]
    reads = []
    plain = authority.read_invites
    monkeypatch.setattr(authority, "read_invites", lambda path: reads.append(path) or plain(path))
    with sync_group(dht_factory, 1, 16) as (member,):
        auth = AdmissionAuthority(
            member.service, creator, load_verified_manifest(manifest_path)[0], load_record(manifest_path),
            invites_path(manifest_path), dict,
        )  # fmt: skip

        def admit(sender: str, code: str) -> str:
            request = wire.AdmitRequest(run=member.service.run, invite=code)
            try:
                return member.service.call(auth._decide(sender, request), timeout=10)
            except PermissionError as e:
                return str(e)

        guesses = [admit(f"QmStranger{i}", new_invite_code()) for i in range(200)]
        assert set(guesses) == {"unknown invite code"} and len(reads) == 1
        assert admit("QmAlice", codes[0]) == "invite"  # read under the lock, and written
        assert admit("QmThief", codes[0]) == "this invite code was redeemed by another key"
        assert admit("QmAlice", codes[0]) == "invite"  # its own code again (a lost token)
        settled = len(reads)
        assert {admit(f"QmGuess{i}", new_invite_code()) for i in range(200)} == {"unknown invite code"}
        assert len(reads) == settled
        assert main(["run", "invite", "--manifest_path", str(manifest_path), "--count", "1"]) == 0
        late = capsys.readouterr().out.split()[0]
        assert admit("QmBob", late) == "invite"
    assert len(reads) <= settled + 3, reads
