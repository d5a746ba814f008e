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
