"""The rounds this peer sent its part for, kept across restarts (`SentRounds`).

A member signs one report per round; a second, different one is what an equivocator sends, and every
member that holds both leaves it out and bans it. A peer killed mid-round and restarted from a
checkpoint taken before that round would run the round again with a new outer gradient and sign a new
report while the others still hold the first: an honest volunteer banned for ten minutes (the goodput
churn runs saw it seven times in one run). So before its part leaves, the round is written here, in
the checkpoint directory; after a restart, a round that a previous life already sent for is sat out
(`RoundRunner`): nothing is sent or signed again, and the state is taken from the holders once they
are past it. The same holds within one life: a download that sets the state back to a round we sent
already (the holders were still in it when we went on alone) must not make us sign that round again:
the others still hold our first report (a churn run saw four equivocation bans of that kind).

One small JSON file, `{"run": <run id>, "sent": {"<module>/<fragment>": highest round sent}}`,
replaced atomically; another run's file is ignored (and replaced at the first round).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from peer.errors import ConfigError

FILE_NAME = "sent_rounds.json"
#: entries a file may hold before it is refused as not ours (a grid has far fewer module fragments)
MAX_ENTRIES = 100_000


class SentRounds:
    """The highest round sent per module fragment: this life's and what earlier lives left on disk."""

    def __init__(self, directory: str | os.PathLike | None, run_id: str = ""):
        self.path = Path(directory) / FILE_NAME if directory is not None else None
        self.run_id = run_id
        #: this life's rounds and what earlier lives left on disk: none of them is sent again
        self._sent: dict[str, int] = self._read() if self.path is not None else {}
        #: what earlier lives left on disk (`by_earlier_life`)
        self._earlier = dict(self._sent)
        self._lock = threading.Lock()

    def _read(self) -> dict[str, int]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(raw)
            sent = data["sent"]
            ok = isinstance(data["run"], str) and isinstance(sent, dict) and len(sent) <= MAX_ENTRIES
            ok = ok and all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in sent.items())
        except (ValueError, TypeError, KeyError):
            ok = False
        if not ok:
            raise ConfigError(
                f"{self.path} is not a record of sent rounds ({{'run': ..., 'sent': {{module/fragment: "
                f"round}}}}); move it away to start without it"
            )
        return sent if data["run"] == self.run_id else {}

    @staticmethod
    def _name(module: str, fragment: int) -> str:
        return f"{module}/{fragment}"

    def sent_already(self, module: str, fragment: int, round_index: int) -> bool:
        """Whether this peer, in this life or an earlier one, already sent its part for this round (or
        a later one): a part and report for it would be a second one."""
        with self._lock:
            return self._sent.get(self._name(module, fragment), -1) >= round_index

    def by_earlier_life(self, module: str, fragment: int, round_index: int) -> bool:
        """Whether an earlier life of this peer sent its part for this round (or a later one)."""
        return self._earlier.get(self._name(module, fragment), -1) >= round_index

    def record(self, module: str, fragment: int, round_index: int) -> None:
        """Notes that our part for this round is about to leave; on disk before this returns."""
        name = self._name(module, fragment)
        with self._lock:
            if self._sent.get(name, -1) >= round_index:
                return
            self._sent[name] = round_index
            if self.path is None:
                return
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w") as f:
                json.dump({"run": self.run_id, "sent": self._sent}, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
