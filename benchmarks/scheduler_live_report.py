"""What `benchmarks.scheduler_live` reports from one arm's peers: their round histories (final
checkpoints), their logs (moves, the planner's predictions) and the lab's region changes; then the
table, the JSON and the plot of the three arms."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from peer.model.grid import TRUNK

MOVE = re.compile(r"rotating from path (\d+) to path (\d+)")
TRAINING = re.compile(r"training path (\d+) ")
PREDICTED = re.compile(
    r"online re-plan \(\w+, round \d+\): \w+ path \S+ -> \S+; round [\d.]+s now, ([\d.]+)s planned"
)
JOIN_PLAN = re.compile(r"plan: path \S+ for us; round ([\d.]+)s")


def loss_curve(histories: list[list[dict]], t0: float) -> list[tuple[float, float]]:
    """(seconds since t0, mean over peers of each one's latest round loss) at every round's end."""
    events = sorted((e["time"], i, e["loss"]) for i, h in enumerate(histories) for e in h)
    latest: dict[int, float] = {}
    curve = []
    for t, i, loss in events:
        latest[i] = loss
        # a mean over some peers only would jump when a slow one reports: wait for all of them
        if len(latest) == len(histories):
            curve.append((t - t0, statistics.fmean(latest.values())))
    return curve


def seconds_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, loss in curve if loss <= target), None)


def tokens_per_second(histories: list[list[dict]]) -> float:
    """Mean over peers of the tokens each trained per second between its first and last round."""
    rates = [
        (h[-1]["tokens_total"] - h[0]["tokens_total"]) / (h[-1]["time"] - h[0]["time"])
        for h in histories
        if len(h) >= 2 and h[-1]["time"] > h[0]["time"]
    ]
    return statistics.fmean(rates) if rates else 0.0


def round_seconds(histories: list[list[dict]], after: float) -> float | None:
    """Mean over peers of their median round time, over rounds that began after unix time `after`."""
    medians = []
    for h in histories:
        gaps = [b["time"] - a["time"] for a, b in zip(h, h[1:], strict=False) if a["time"] >= after]
        if gaps:
            medians.append(statistics.median(gaps))
    return statistics.fmean(medians) if medians else None


def round_predictions(histories: list[list[dict]], peer_ids: list[str], path_of, regions, predict,
                      t0: float, changed_at: float | None) -> dict:  # fmt: skip
    """The cost model against every round the peers ran, the whole arm (the headline) and the steady
    window before the regions changed beside it. Each round (one peer, from its previous round's
    end to this one's) is priced on the assignment and the links in force when it ended: every
    peer's path from its latest round by then, the regions of `regions.changes`;
    `predict(paths, region)` is the planner's round time for them. Sums, so long rounds weigh as
    much as the seconds they took."""
    events = sorted((e["time"], i, path_of(e)) for i, h in enumerate(histories) for e in h)
    sums = {"whole": [0.0, 0.0, 0], "before_change": [0.0, 0.0, 0]}
    for h in histories:
        for a, b in zip(h, h[1:], strict=False):
            if a["time"] < t0:
                continue
            paths = {}
            for t, j, k in events:  # each peer's latest path at b's end (its first, before it trained)
                if t <= b["time"] or peer_ids[j] not in paths:
                    paths[peer_ids[j]] = k
            region = next((r for t, r in reversed(regions.changes) if t <= b["time"]), regions.changes[0][1])
            windows = ["whole"] + (["before_change"] if changed_at is None or b["time"] < changed_at else [])
            predicted = predict(paths, tuple(region))
            for w in windows:
                sums[w][0] += predicted
                sums[w][1] += b["time"] - a["time"]
                sums[w][2] += 1
    out = {}
    for w, (p, m, n) in sums.items():
        ratio = p / m if m else None
        out[w] = dict(predicted_seconds=p, measured_seconds=m, rounds=n, predicted_over_measured=ratio)
    return out


def cross_region_fraction(histories: list[list[dict]], regions) -> float:
    """Share of grid-module averaging groups (per peer and round) that spanned both regions."""
    crossed = total = 0
    for h in histories:
        for e in h:
            for module, members in e.get("groups", {}).items():
                if module != TRUNK and len(members) > 1:
                    total += 1
                    crossed += regions.cross_region(members, e["time"])
    return crossed / total if total else 0.0


def logged_predictions(logs: list[str]) -> list[float]:
    """The round time the peers' own plans predicted last (online re-plans, else the join plan)."""
    out = []
    for text in logs:
        found = PREDICTED.findall(text) or JOIN_PLAN.findall(text)
        if found:
            out.append(float(found[-1]))
    return out


ROWS = [
    ("seconds_to_target_loss", "s to target loss", "{:.0f}"),
    ("tokens_per_second", "tokens/s per peer", "{:.0f}"),
    ("moves", "moves", "{}"),
    ("rounds", "rounds (mean per peer)", "{:.1f}"),
    ("cross_region_group_fraction", "groups across regions", "{:.2f}"),
    ("measured_round_seconds", "round s, measured (after change)", "{:.2f}"),
    ("predicted_round_seconds", "round s, cost model (final assignment)", "{:.2f}"),
    ("predicted_over_measured", "predicted / measured, every round of the arm", "{:.2f}"),
    ("predicted_over_measured_before_change", "predicted / measured, before the change", "{:.2f}"),
    ("final_loss", "final mean loss", "{:.3f}"),
]


def table(report: dict) -> str:
    arms = list(report["arms"])
    lines = ["| | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for key, label, fmt in ROWS:
        cells = []
        for a in arms:
            v = report["arms"][a].get(key)
            cells.append("—" if v is None else fmt.format(v))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def ratio(key: str) -> str:
        v = report.get(key)
        return "—" if v is None else f"{v:.2f}"

    lines.append("")
    lines.append(
        f"target loss {report['target_loss']:.3f}; plan_online predicted / measured round time: "
        f"{ratio('predicted_over_measured_round_seconds')} over every round of the arm "
        f"({ratio('predicted_over_measured_before_change')} before the change, "
        f"{ratio('predicted_over_measured_after_last_move')} after the last move)"
    )
    speedup = report.get("plan_online_speedup_over_claims_only")
    if speedup is not None:
        lines.append(f"plan_online reaches the target {speedup:.2f}x as fast as claims_only")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, report: dict, curves: dict[str, list[tuple[float, float]]]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "scheduler_live.json").write_text(json.dumps(report, indent=2) + "\n")
    text = table(report)
    (out / "scheduler_live.md").write_text(text)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, curve in curves.items():
        if curve:
            ax.plot([t for t, _ in curve], [v for _, v in curve], label=arm)
    ax.axhline(report["target_loss"], color="grey", linestyle=":", label="target")
    if report.get("change_at_seconds") is not None:
        ax.axvline(report["change_at_seconds"], color="black", linestyle="--", label="regions change")
    ax.set_xlabel("seconds since every peer trains")
    ax.set_ylabel("mean training loss of the peers' last round")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scheduler_live.png", dpi=120)
    plt.close(fig)
    return text
