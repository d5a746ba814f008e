"""Who counts in a peer's decisions: admitted keys, never a number of keys.

`Standing` answers, for one run, whether a peer is admitted — from the token that came with its
message (every member of a round sees the same one) or from its claim (for a peer's own local
choices: whom to ask, whose "you are behind" to believe) — and which of a set of peers vote. The
run's mode decides what a key without admission may do (`peer.run.admission`): in an `invite` run
nothing (`takes_part`), in an `open` run it trains on probation and never votes. Where none of the
peers concerned is admitted (an open run whose creator runs no authority), all of them vote alike:
`voters` says so in one place, so every rule that counts has the same weak spot, documented in the
threat model, rather than each its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from peer.run.admission import AdmissionCheck


class Standing:
    """Admission of peers to one run, by token, for the sync layer's decisions."""

    def __init__(self, check: AdmissionCheck | None, mode: str, token_of: Callable[[str], str] | None = None):
        """`check` verifies tokens (None: nobody is ever admitted); `token_of(peer)` gives the token in
        a peer's current claim ("" if none)."""
        self.check = check
        self.mode = mode
        self.token_of = token_of or (lambda peer: "")
        #: this peer's own token ("" while on probation), sent with its parts and reports
        self.own_token = ""

    def admitted(self, peer: str, token: str | None = None) -> bool:
        """Whether `token` (default: the one in `peer`'s claim) admits `peer` to this run."""
        if self.check is None:
            return False
        return self.check.admitted(peer, self.token_of(peer) if token is None else token)

    def takes_part(self, peer: str, token: str | None = None) -> bool:
        """Whether `peer` may send us parts, reports and requests at all: anyone in an open run, only
        admitted keys in an invite run."""
        return self.mode != "invite" or self.admitted(peer, token)

    def voters(self, tokens: dict[str, str]) -> list[str]:
        """The peers (peer -> token) whose votes count: the admitted ones, or all of them when none is."""
        admitted = sorted(p for p, t in tokens.items() if self.admitted(p, t))
        return admitted or sorted(tokens)

    def trusted(self, peers: Iterable[str]) -> list[str]:
        """`voters` for peers known by their claims (local decisions: donors, confirmers, keepers)."""
        peers = list(peers)
        return self.voters({p: self.token_of(p) for p in peers})
