"""When a peer's own rounds have run away from its fellow holders' and it must yield to them.

After a partition heals (or after a stretch a peer trained alone) one lineage of a module can be
rounds ahead of the others. The holders behind never load it: a state only its sender vouches for
is never confirmed (`peer.sync.state_fetch`). So the lone lineage yields: when, several rounds in a
row, the members with standing that refused our round as beyond their lookahead outnumber those
that took it (`RoundResult.lagging`), this peer takes their state, which they confirm for each
other. A joiner still downloading refuses a round or so; a lone lineage is refused every round.
"""

from __future__ import annotations

from collections import Counter

#: rounds in a row a fragment's lagging members must outnumber those that took our round
STRAY_ROUNDS = 2


class StrayWatch:
    """Counts, per (module, fragment), the rounds in a row whose lagging members outnumbered the rest."""

    def __init__(self, rounds: int = STRAY_ROUNDS) -> None:
        self.rounds = rounds
        self._runs: Counter[tuple[str, int]] = Counter()

    def strayed(self, module: str, fragment: int, lagging: list[str]) -> bool:
        """Notes one round's `lagging` members; True (and the count starts again) once this fragment has
        had `rounds` such rounds in a row: time to take the lagging members' state."""
        key = (module, fragment)
        self._runs[key] = self._runs[key] + 1 if lagging else 0
        if self._runs[key] < self.rounds:
            return False
        self._runs[key] = 0
        return True
