"""A round's slot in the inbox holds at most `max_senders` senders, whatever they left in it: parts,
reports, or sit-out notices (a key costs nothing, so each kind of entry must count against the cap)."""

from __future__ import annotations

import pytest

from peer.codecs.formats import make_codec
from peer.sync.inbox import Inbox, Refused
from tests.sync_members import MODULE


@pytest.mark.timeout(30)
def test_sit_out_notices_take_a_senders_place_in_a_rounds_cap():
    inbox = Inbox({MODULE: [16]}, make_codec("fp32"), lambda peer, module: True, 2, 0.0)
    for sender in ("a", "b"):
        inbox.note_sat_out(sender, inbox.check_key(sender, MODULE, 0, 0))
    with pytest.raises(Refused, match="full"):
        inbox.check_key("c", MODULE, 0, 0)
    assert inbox.slot((MODULE, 0, 0)).sat_out == {"a", "b"}
    assert inbox.check_key("a", MODULE, 0, 0) == (MODULE, 0, 0)  # one already in keeps its place


@pytest.mark.timeout(30)
def test_late_parts_of_many_keys_leave_only_the_latest_senders_remembered():
    """A part for a round that is over here is remembered (a holder behind us: the straggler bound
    waits longer for it), for the `max_senders` latest senders only: keys that each held a claim
    once cannot grow the inbox."""
    inbox = Inbox({MODULE: [16]}, make_codec("fp32"), lambda peer, module: True, 2, 0.0)
    inbox.set_current(MODULE, 0, 5)
    for i, sender in enumerate(("a", "b", "c", "a")):
        with pytest.raises(Refused, match="stale"):
            inbox.check_key(sender, MODULE, 0, i)
    assert inbox.came_after[(MODULE, 0)] == {"c": 2, "a": 3}
