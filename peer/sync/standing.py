"""Who counts in a peer's decisions: admitted keys, never a number of keys.

`Standing` answers, for one run, whether a peer is admitted — from the token that came with its
message (every member of a round sees the same one) or from its claim (for a peer's own local
choices: whom to ask, whose "you are behind" to believe) — and which of a set of peers vote. The
run's mode decides what a key without admission may do (`peer.run.admission`): in an `invite` run
nothing (`takes_part`), in an `open` run it trains on probation and never votes.

Where none of the peers concerned is admitted, two rules, each in one place:

* `voters` (a round's votes, an authority's vouchers): all of them vote alike — the peers of a
  module that has no admitted holder yet (the start of an open run) must still agree among
  themselves, and every member of a round must reach the same answer from the same reports;
* `trusted` (whose state a joiner, a repair or a keeper takes): all of them only while this peer has
  never seen an admitted key in the run (an open run whose creator runs no authority). Once it has,
  keys without standing are never trusted with a state, even where the admitted holders of a module
  all left: else a stranger would only have to outlast them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from peer.run.admission import AdmissionCheck


class Standing:
    """Admission of peers to one run, by token, for the sync layer's decisions."""

    def __init__(
        self,
        check: AdmissionCheck | None,
        mode: str,
        token_of: Callable[[str], str] | None = None,
        me: str | None = None,
    ):
        """`check` verifies tokens (None: nobody is ever admitted); `token_of(peer)` gives the token in
        a peer's current claim ("" if none); `me`: this peer's id (the creator's own nodes know from
        the start that the run has an authority)."""
        self.check = check
        self.mode = mode
        self.token_of = token_of or (lambda peer: "")
        #: this peer's own token ("" while on probation), sent with its parts and reports
        self.own_token = ""
        #: whether an admitted key (ours included) was ever seen in this run: the run has an authority
        self.seen_admission = check is not None and me == check.creator_peer_id

    def admitted(self, peer: str, token: str | None = None) -> bool:
        """Whether `token` (default: the one in `peer`'s claim) admits `peer` to this run."""
        if self.check is None:
            return False
        yes = self.check.admitted(peer, self.token_of(peer) if token is None else token)
        self.seen_admission = self.seen_admission or yes
        return yes

    def takes_part(self, peer: str, token: str | None = None) -> bool:
        """Whether `peer` may send us parts, reports and requests at all: anyone in an open run, only
        admitted keys in an invite run."""
        return self.mode != "invite" or self.admitted(peer, token)

    def voters(self, tokens: dict[str, str]) -> list[str]:
        """The peers (peer -> token) whose votes count: the admitted ones, or all of them when none is."""
        admitted = sorted(p for p, t in tokens.items() if self.admitted(p, t))
        return admitted or sorted(tokens)

    def among(self, peers: Iterable[str]) -> list[str]:
        """`voters` for peers known by their claims (whose "you are behind" counts, who vouches)."""
        return self.voters({p: self.token_of(p) for p in peers})

    def trusted(self, peers: Iterable[str]) -> list[str]:
        """Which of `peers` (known by their claims) may be trusted with a state: the admitted ones,
        or all of them while no admitted key was ever seen in this run."""
        peers = sorted(set(peers))
        if self.own_token or (self.check is not None and self.check.creator_peer_id in peers):
            self.seen_admission = True
        admitted = [p for p in peers if self.admitted(p)]
        return admitted if admitted or self.seen_admission else peers
