"""The swarm as one picture, computed from the run's claims: no DHT, no clock, no I/O.

`select_shards` turns the records read under a run's claim shards, one shard at a time, into one claim
per peer (at most `MAX_CLAIMS_PER_SHARD` of each shard, chosen as every peer chooses them, so a flood
of keys cannot grow the monitor's memory); `build_view` turns those
claims and the run's grid into a `SwarmView`: peers by state, holders per path and module, modules
down to their last holder or orphaned, fragment lag, throughput, loss, sync outcomes and bad parts.
Every number here is what peers *claim* about themselves, except the tokens/s, which the monitor
measures from the claims' token counters over its own clock (`rates`), and the confirmed holders:
what a peer holds follows from its path, never from the module list it writes (a claim whose list is
not its path's is refused and counted), and a holder counts as confirmed only with the run creator's
admission where the run has admitted anyone. Claimed and confirmed holders are shown side by side;
orphaned and under-replicated modules are judged on the confirmed ones, so no stranger's claim hides
a module nobody admitted trains. The monitor shows all this and decides nothing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dht.claim_choice import keep_of_shard
from dht.keys import MAX_CLAIMS_PER_SHARD, claim_shard
from dht.schema import ClaimRecord, StashRecord
from dht.shard_store import Admitted
from monitoring.metrics import BAD_PART_REASONS, OUTCOMES
from monitoring.swarm.contributions import ContributionRow
from peer.model.grid import ModelConfig, all_module_ids, all_paths, is_path_of, path_module_ids

if TYPE_CHECKING:  # the plan is computed beside the view (monitoring/swarm/plan.py), not in it
    from monitoring.swarm.plan import PlanView

STATES = ("joining", "training", "leaving")
REACHABILITY = ("direct", "relay", "unreachable", "unknown")
#: label values a peer's counts are filed under; anything else a peer writes becomes "other"
SYNC_OUTCOMES = (*OUTCOMES, "partial")
#: a module with fewer ready holders than this is one departure away from losing its training
MIN_HOLDERS = 2


def peer_state(claim: ClaimRecord) -> str:
    """leaving: announced its departure; joining: still starting or catching up; training: the rest."""
    if claim.leaving:
        return "leaving"
    return "training" if claim.ready else "joining"


@dataclass(frozen=True)
class Selected:
    """Claims kept for the view, by peer id, and how many records were read before the cap."""

    claims: dict[str, ClaimRecord]
    records_read: int
    capped: bool


def select_shards(
    shards: Iterable[list[tuple[ClaimRecord, float]]],
    reader: str = "",
    admitted: Admitted | None = None,
    cap: int = MAX_CLAIMS_PER_SHARD,
) -> Selected:
    """One claim per peer id (the most advanced step wins, the later on a tie), from at most `cap`
    records of each shard, chosen as every pathswarm reader chooses them (`keep_of_shard`). `shards`
    may be a generator reading one shard at a time: only the kept records are held."""
    out: dict[str, tuple[ClaimRecord, float]] = {}
    read, capped = 0, False
    for records in shards:
        read, capped = read + len(records), capped or len(records) > cap
        for claim, expiry in keep_of_shard(records, reader, admitted, cap):
            previous = out.get(claim.peer_id)
            if previous is None or (claim.step, expiry) >= (previous[0].step, previous[1]):
                out[claim.peer_id] = (claim, expiry)
    return Selected({pid: c for pid, (c, _) in out.items()}, read, capped)


def select_claims(
    records: list[tuple[ClaimRecord, float]],
    reader: str = "",
    admitted: Admitted | None = None,
    cap: int = MAX_CLAIMS_PER_SHARD,
) -> Selected:
    """`select_shards` of records read together, grouped by the shard of each claim's path."""
    by_shard: dict[int, list[tuple[ClaimRecord, float]]] = defaultdict(list)
    for record in records:
        by_shard[claim_shard(record[0].path)].append(record)
    return select_shards(by_shard.values(), reader, admitted, cap)


@dataclass
class PeerRow:
    """One peer as the status page and the per-peer series show it."""

    peer_id: str
    path: int
    state: str
    #: measured by the monitor from the peer's token counter (`MeasuredRates`), not its claim
    tokens_per_second: float
    tokens_total: int
    outer_round: int
    step: int
    loss: float | None
    reachability: str
    software_version: str
    client_mode: bool
    sync_outcomes: dict[str, int]
    bad_parts: dict[str, int]
    bytes_sent: int
    bytes_received: int
    #: what the peer says its rate is, shown beside the measured one
    claimed_tokens_per_second: float = 0.0
    #: its counter rises implausibly fast: shown, left out of the swarm's total
    implausible: bool = False


@dataclass
class SwarmView:
    """What the monitor exports and the status page draws, for one poll of the DHT."""

    run: str
    run_id: str
    paths: list[int]
    modules: list[str]
    peers: list[PeerRow] = field(default_factory=list)
    by_state: dict[str, int] = field(default_factory=dict)
    path_holders: dict[int, int] = field(default_factory=dict)
    #: training peers claiming each module (their path's), admitted or not
    module_holders: dict[str, int] = field(default_factory=dict)
    #: those of them with the creator's admission (all of them while the run has admitted nobody)
    module_holders_confirmed: dict[str, int] = field(default_factory=dict)
    #: per module: the largest gap, over its fragments, between holders' applied sync counts
    module_round_spread: dict[str, int] = field(default_factory=dict)
    #: per module: the highest applied sync count of any holder, summed over fragments
    module_round: dict[str, int] = field(default_factory=dict)
    #: keepers (bootstrap --keep_state) holding a copy of each module
    module_kept: dict[str, int] = field(default_factory=dict)
    #: grid cells: per path, per module on it, the holders of that module
    grid: dict[int, dict[str, int]] = field(default_factory=dict)
    #: the sum of the training peers' measured tokens/s (implausible counters left out)
    tokens_per_second: float = 0.0
    #: peers whose token counter rises implausibly fast
    implausible: int = 0
    loss_by_path: dict[int, float] = field(default_factory=dict)
    sync_outcomes: dict[str, int] = field(default_factory=dict)
    bad_parts: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    by_version: dict[str, int] = field(default_factory=dict)
    by_reachability: dict[str, int] = field(default_factory=dict)
    claims_read: int = 0
    claims_capped: bool = False
    #: claims left out because their module list is not their path's (or the path is off the grid)
    claims_refused: int = 0
    #: claims carrying the run creator's admission
    admitted: int = 0
    #: each volunteer's contribution over the run, departed ones included, most tokens first
    #: (monitoring/swarm/contributions.py: signed claims, rounds confirmed by partners)
    contributions: list[ContributionRow] = field(default_factory=list)
    #: contribution records refused in the last poll (forged, tampered, another run), by reason
    contributions_rejected: dict[str, int] = field(default_factory=dict)
    #: the scheduler's plan for these claims and its predicted round time, beside the measured one
    plan: PlanView | None = None

    @property
    def under_replicated(self) -> list[str]:
        return [m for m in self.modules if self.module_holders_confirmed.get(m, 0) < MIN_HOLDERS]

    @property
    def orphaned(self) -> list[str]:
        return [m for m in self.modules if self.module_holders_confirmed.get(m, 0) == 0]

    @property
    def uncovered_paths(self) -> list[int]:
        return [p for p in self.paths if self.path_holders.get(p, 0) == 0]


def _spread(rounds: list[list[int]]) -> int:
    """Largest max-min gap over fragment positions between holders' round lists."""
    width = max((len(r) for r in rounds), default=0)
    gaps = [0]
    for i in range(width):
        column = [r[i] for r in rounds if i < len(r)]
        gaps.append(max(column) - min(column))
    return max(gaps)


def _known(counts: dict[str, int], allowed: tuple[str, ...]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for key, value in counts.items():
        out[key if key in allowed else "other"] += max(0, value)
    return dict(out)


def _label(text: str, allowed: tuple[str, ...] | None = None, max_len: int = 32) -> str:
    """A label value from a peer's own words: bounded, and mapped to a known set where one exists."""
    if allowed is not None:
        return text if text in allowed else "other"
    clean = "".join(ch for ch in text[:max_len] if ch.isprintable())
    return clean or "unknown"


def build_view(
    run: str,
    run_id: str,
    model: ModelConfig,
    selected: Selected,
    stash: list[StashRecord] | None = None,
    rates: tuple[dict[str, float], set[str]] | None = None,
    admitted: Admitted | None = None,
    seen_admission: bool = False,
) -> SwarmView:
    """The swarm view of `selected` claims in a run whose grid is `model`; `rates`: the measured
    tokens/s of each peer and the implausible ones (`MeasuredRates.update`; none: all zero);
    `admitted` checks a claim's admission token, and only admitted holders are confirmed once any
    claim is admitted or `seen_admission` (the run admitted someone in an earlier poll)."""
    measured, implausible = rates if rates is not None else ({}, set())
    claims = {pid: c for pid, c in selected.claims.items() if is_path_of(model, c.path, c.modules)}
    with_token = {pid for pid, c in claims.items() if admitted is not None and admitted(pid, c.admission)}
    confirmed = with_token if with_token or seen_admission else set(claims)
    paths = list(range(model.n_paths))
    modules = all_module_ids(model)
    view = SwarmView(run, run_id, paths, modules)
    view.claims_read, view.claims_capped = selected.records_read, selected.capped
    view.claims_refused, view.admitted = len(selected.claims) - len(claims), len(with_token)
    states: Counter[str] = Counter({s: 0 for s in STATES})
    path_holders: Counter[int] = Counter({p: 0 for p in paths})
    module_holders: Counter[str] = Counter({m: 0 for m in modules})
    module_confirmed: Counter[str] = Counter({m: 0 for m in modules})
    rounds: dict[str, list[list[int]]] = defaultdict(list)
    losses: dict[int, list[float]] = defaultdict(list)
    outcomes: Counter[str] = Counter()
    bad: Counter[str] = Counter()
    versions: Counter[str] = Counter()
    reach: Counter[str] = Counter({r: 0 for r in REACHABILITY})
    for peer_id, c in sorted(claims.items()):
        state = peer_state(c)
        states[state] += 1
        version, reachable = _label(c.software_version), _label(c.reachability, REACHABILITY)
        versions[version] += 1
        reach[reachable] += 1
        view.peers.append(
            PeerRow(
                peer_id,
                c.path,
                state,
                measured.get(peer_id, 0.0),
                c.tokens_total,
                c.outer_round,
                c.step,
                c.loss,
                reachable,
                version,
                c.client_mode,
                _known(c.sync_outcomes, SYNC_OUTCOMES),
                _known(c.bad_parts, BAD_PART_REASONS),
                c.bytes_sent,
                c.bytes_received,
                c.tokens_per_second,
                peer_id in implausible,
            )  # fmt: skip
        )
        view.implausible += peer_id in implausible
        # outcomes, bad parts and bytes are totals since each peer started: summed over every live peer
        outcomes.update(view.peers[-1].sync_outcomes)
        bad.update(view.peers[-1].bad_parts)
        view.bytes_sent += c.bytes_sent
        view.bytes_received += c.bytes_received
        if state != "training":
            continue  # a joining copy is not caught up yet, a leaving one is about to go
        if peer_id not in implausible:
            view.tokens_per_second += measured.get(peer_id, 0.0)
        if c.path in path_holders:
            path_holders[c.path] += 1
        if c.loss is not None:
            losses[c.path].append(c.loss)
        for m in c.modules:
            module_holders[m] += 1
            module_confirmed[m] += peer_id in confirmed
            rounds[m].append(list(c.module_rounds.get(m, [])))
    view.by_state = dict(states)
    view.path_holders = dict(path_holders)
    view.module_holders = dict(module_holders)
    view.module_holders_confirmed = dict(module_confirmed)
    view.module_round_spread = {m: _spread(rounds.get(m, [])) for m in modules}
    view.module_round = {m: max((sum(r) for r in rounds.get(m, [])), default=0) for m in modules}
    kept: Counter[str] = Counter({m: 0 for m in modules})
    for record in stash or []:
        kept.update(m for m in record.modules if m in kept)
    view.module_kept = dict(kept)
    view.grid = {p: {m: module_holders[m] for m in path_module_ids(model, path)}
                 for p, path in enumerate(all_paths(model))}  # fmt: skip
    view.loss_by_path = {p: sum(v) / len(v) for p, v in sorted(losses.items())}
    view.sync_outcomes, view.bad_parts = dict(outcomes), dict(bad)
    view.by_version, view.by_reachability = dict(versions), dict(reach)
    return view


def top_peers(view: SwarmView, limit: int) -> list[PeerRow]:
    """The peers that get series of their own when there are more than `limit`: training ones first,
    then the fastest; ties by peer id, so the choice is stable between polls."""
    order = sorted(view.peers, key=lambda r: (r.state != "training", -r.tokens_per_second, r.peer_id))
    return order[: max(0, limit)]
