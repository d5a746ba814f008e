"""What a holder answers a peer its claim view does not show yet (a mover, a second before the view
renews): "stale" where the round is over here, so the mover takes our state at once instead of
offering its part again until our view shows it; "not_holder" otherwise, so it offers it again."""

from __future__ import annotations

import pytest

from peer.codecs.formats import make_codec
from peer.sync.inbox import Inbox, Refused
from peer.sync.standing import Standing

pytestmark = pytest.mark.timeout(30)


def _inbox(holders: set[str]) -> Inbox:
    return Inbox(
        {"l1m1": [8]}, make_codec("fp32"), lambda peer, module: peer in holders, 32, 0.0,
        Standing(None, "open", lambda peer: ""),
    )  # fmt: skip


def _reason(inbox: Inbox, sender: str, round_index: int) -> str:
    with pytest.raises(Refused) as refused:
        inbox.check_key(sender, "l1m1", 0, round_index)
    return refused.value.reason


def test_a_mover_not_yet_in_our_view_is_told_at_once_that_a_round_over_here_is_over():
    inbox = _inbox(holders=set())
    inbox.set_current("l1m1", 0, 13)  # we decided round 12 alone: the mover was no member of it
    assert _reason(inbox, "mover", 12) == "stale"
    # its part of the round we are in waits for our view to show it, as before
    assert _reason(inbox, "mover", 13) == "not_holder"


def test_a_holder_in_our_view_is_told_stale_as_before_and_its_part_of_the_current_round_is_taken():
    inbox = _inbox(holders={"mover"})
    inbox.set_current("l1m1", 0, 13)
    assert _reason(inbox, "mover", 12) == "stale"
    assert inbox.check_key("mover", "l1m1", 0, 13) == ("l1m1", 0, 13)
