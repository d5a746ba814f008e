"""A holder's BYE counts for the time we held the module it named, not for a later visit of ours."""

from __future__ import annotations

import pytest

from peer.codecs.formats import make_codec
from peer.sync.inbox import Inbox
from peer.sync.standing import Standing

pytestmark = pytest.mark.timeout(30)


def test_a_bye_heard_before_we_left_a_module_does_not_mark_its_holder_gone_when_we_come_back():
    claims = {"p": {"trunk", "l0m1"}}  # what p's claim lists now
    inbox = Inbox(
        {"trunk": [8], "l0m1": [8]}, make_codec("fp32"), lambda peer, module: module in claims.get(peer, ()),
        32, 0.0, Standing(None, "open", lambda peer: ""),
    )  # fmt: skip
    # p leaves l0m1 and the trunk while we hold both (its claim then lists neither: gone)
    inbox.note_bye("p", ["trunk", "l0m1"])
    claims["p"] = set()
    assert inbox.gone("p", "l0m1") and inbox.gone("p", "trunk")
    # we move to a path without l0m1 (the trunk stays ours), p comes back to the trunk and l0m1,
    # and we move back onto l0m1
    inbox.hold({"trunk": [8], "l1m0": [8]})
    claims["p"] = {"trunk", "l0m1"}
    inbox.hold({"trunk": [8], "l0m1": [8]})
    # l0m1 is for p's claim to say again; the trunk we never left: its BYE still holds until p sends
    # a part of it or says HELLO
    assert not inbox.gone("p", "l0m1")
    assert inbox.gone("p", "trunk")
    assert inbox.fragment_sizes == {"trunk": [8], "l0m1": [8]}
