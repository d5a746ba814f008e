"""What `benchmarks.goodput` reads off its peers' logs (split rounds, moves) and off the machine (idle
CPU), apart from the arms that run them."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from statistics import fmean

#: what a member logs when the digests in a round's reports show its copy split from the group's:
#: every member that merges logs it, so a split is counted once per (module, fragment, round)
SPLIT_LINE = re.compile(
    r"(\S+) fragment (\d+) round (\d+): (?:merged the diverged copies|our copy differs .*\(it drifted\))"
)
#: what a peer logs when it rotates to another path (peer.training.peer)
MOVE_MARK = "rotating from path"
#: a peer's first inner step (peer.training.history.first_step_note)
FIRST_STEP = re.compile(r"first inner step (\d+(?:\.\d+)?) s after the peer started")
#: a peer's log (p2.log) or the kept log of one of its earlier lives (p2.1.log: the life its first kill ended)
PEER_LOG = re.compile(r"(p\d+)(?:\.(\d+))?\.log")
#: a peer's round end and its move after it (peer.training.peer): a move is of the last round logged
ROUND_OR_MOVE = re.compile(
    r"INFO peer\.training\.peer: (?:round (\d+) step|rotating from path \d+ to path (\d+))"
)


def count_splits(logs: Path) -> int:
    """Rounds whose reports showed a member's copy split from the others' (`SPLIT_LINE`), each once
    however many of its members logged it (restarted processes' logs included)."""
    found = set()
    for log in logs.glob("p*.log"):
        found |= {m.groups() for m in SPLIT_LINE.finditer(log.read_text(errors="replace"))}
    return len(found)


def start_seconds(logs: Path) -> dict:
    """Seconds from each peer process's start to its first inner step: `launch` for each peer's first
    life, `restart` for every later one (a killed life's log is kept as pN.K.log, K its kill, the living
    one is pN.log), and `restarts_without_a_step`: later lives killed before they trained a step."""
    lives: dict[str, list[tuple[float, Path]]] = {}
    for log in logs.glob("p*.log"):
        if found := PEER_LOG.fullmatch(log.name):
            order = float(found.group(2)) if found.group(2) else float("inf")  # the living one is the last
            lives.setdefault(found.group(1), []).append((order, log))
    out: dict = dict(launch=[], restart=[], restarts_without_a_step=0)
    for peer in sorted(lives):
        for i, (_, log) in enumerate(sorted(lives[peer])):
            step = FIRST_STEP.search(log.read_text(errors="replace"))
            if step is not None:
                out["launch" if i == 0 else "restart"].append(float(step.group(1)))
            elif i > 0:
                out["restarts_without_a_step"] += 1
    return out


def describe_starts(starts: dict | None) -> str:
    """`start_seconds` for a table: the mean (and max) of launches and of restarts."""
    if starts is None:  # runs written before session 53 have none
        return "–"
    said = [f"{fmean(v):.1f} ({max(v):.1f})" if v else "–" for v in (starts["launch"], starts["restart"])]
    missed = starts["restarts_without_a_step"]
    return f"{said[0]}, {said[1]}" + (f"; {missed} killed before a step" if missed else "")


def _moves(logs: Path) -> list[tuple[int, int, str]]:
    """(round, target path, peer) of every move in the peers' logs: a move is of the last round logged."""
    moves = []
    for log in logs.glob("p*.log"):
        peer, last_round = log.name.split(".")[0], None  # p1.1.log: p1 restarted
        for found in ROUND_OR_MOVE.finditer(log.read_text(errors="replace")):
            if found.group(1) is not None:
                last_round = int(found.group(1))
            elif last_round is not None:
                moves.append((last_round, int(found.group(2)), peer))
    return moves


def _movers_beyond_one(logs: Path, by: Callable[[tuple[int, int, str]], object]) -> int:
    """Moves beyond the first of each group of moves, the moves grouped `by` (round, target path, peer)."""
    movers: dict[object, set[str]] = {}
    for move in _moves(logs):
        movers.setdefault(by(move), set()).add(move[2])
    return sum(len(peers) - 1 for peers in movers.values())


def count_double_moves(logs: Path) -> int:
    """Moves onto a path that another peer moved onto at the same round's end: peers whose views of the
    claims gave different plans (every peer should compute the same one, with one mover per target)."""
    return _movers_beyond_one(logs, lambda move: move[:2])


def count_extra_moves(logs: Path) -> int:
    """Moves beyond the first at one round's end, onto any path: the rotation moves one peer a round, so
    a second mover planned on a view that differed (one that saw the first mover's new claim, session 51)."""
    return _movers_beyond_one(logs, lambda move: move[0])


def cpu_seconds() -> tuple[float, float]:
    """(idle, all) CPU time of the whole machine so far, from Linux's /proc/stat ((0, 0) elsewhere):
    a window's idle share shows a swarm stalled in its rounds, which training would otherwise fill."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    return float(fields[3] + fields[4]), float(sum(fields[:8]))  # idle + iowait; user..steal
