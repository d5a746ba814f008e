"""What the WAN lab measured: throughput in the window where every peer trained, bytes on the wire per
round and per sync, seconds per sync and in matchmaking, evaluation loss, codec errors, the targets,
and the markdown table and plot.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.wan import copies
from benchmarks.wan.options import NO_SYNC
from peer.codecs.specs import codec_spec
from peer.config import RunManifest, SyncConfig
from peer.model.tokenizer import load_tokenizer
from peer.model.transformer import PathModel
from peer.offline.evaluation import evaluate


@dataclass
class Outcome:
    name: str
    manifest: RunManifest
    histories: list[list[dict]]
    finals: list[dict]  # checkpoint meta of each peer
    tensors: dict[str, torch.Tensor]  # peer 0's final checkpoint
    samples: list
    commands: list[list[str]]
    wall_seconds: float
    cpu: dict[str, float] = field(default_factory=dict)
    #: peers grouped by the global copy they ended with, and one checkpoint of each group (`copies`)
    copy_groups: list[list[int]] = field(default_factory=list)
    copies: list[dict[str, torch.Tensor]] = field(default_factory=list)


def _interp(points: list[tuple[float, float]], t: float) -> float:
    """Piecewise-linear value at time t of ascending (time, value) points, clamped at the ends."""
    if t <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        if t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return points[-1][1]


def training_window(histories: list[list[dict]]) -> tuple[float, float]:
    """The wall-clock interval in which every peer was training."""
    starts = [h[0]["time"] - h[0]["train_seconds"] for h in histories]
    ends = [h[-1]["time"] for h in histories]
    return max(starts), min(ends)


def steady_window_end(histories: list[list[dict]], t0: float) -> float | None:
    """The end of the window for throughput in steady state: every peer's last round entry before its
    final one. The final round's entry is written after training stopped and the syncs still in
    flight were drained: a streaming peer waits there for its last fragment rounds with no inner
    steps left to hide them behind, once per run, not once per round (a blocking sync is in every
    round, so DiLoCo's rate is the same either way). None when a peer has too few rounds for it."""
    if any(len(h) < 3 for h in histories):
        return None
    end = min(h[-2]["time"] for h in histories)
    return end if end > t0 else None


def measure(o: Outcome, args: argparse.Namespace) -> dict:
    if any(not h for h in o.histories):
        raise RuntimeError(f"{o.name}: a peer recorded no round")
    t0, t1 = training_window(o.histories)
    if t1 <= t0:
        raise RuntimeError(f"{o.name}: the peers never trained at the same time ({t0:.1f} > {t1:.1f})")
    steady_end = steady_window_end(o.histories, t0) or t1
    tps, tps_to_end, tps_whole, rounds_in_window = [], [], [], []
    for h in o.histories:
        start = h[0]["time"] - h[0]["train_seconds"]
        tokens = [(start, 0.0)] + [(e["time"], float(e["tokens_total"])) for e in h]
        steps = [(start, 0.0)] + [(e["time"], float(e["step"])) for e in h]
        tps.append((_interp(tokens, steady_end) - _interp(tokens, t0)) / (steady_end - t0))
        tps_to_end.append((_interp(tokens, t1) - _interp(tokens, t0)) / (t1 - t0))
        tps_whole.append(h[-1]["tokens_total"] / h[-1]["train_seconds"])
        rounds_in_window.append((_interp(steps, t1) - _interp(steps, t0)) / args.inner_steps)
    n_hosts = len(o.histories)
    wire, wire_rx, peaks, in_bursts = [], [], [], []
    for i in range(n_hosts):
        series = [(t, c[i + 1][0]) for t, c in o.samples]  # host 0 is the hub
        series_rx = [(t, c[i + 1][1]) for t, c in o.samples]
        wire.append(_interp(series, t1) - _interp(series, t0))
        wire_rx.append(_interp(series_rx, t1) - _interp(series_rx, t0))
        found = bursts(series, t0, t1, args.cap_mbit)
        peaks.append(max(found, default=0))
        in_bursts.append(sum(found))
    rounds = sum(rounds_in_window) / n_hosts
    payload = [sum(e.get("bytes_sent") or 0 for e in h) for h in o.histories]
    peak_payload = [max((e.get("peak_sync_bytes") or 0 for e in h), default=0) for h in o.histories]
    has_payload = any(peak_payload)
    steps_done = [f["step"] for f in o.finals]
    matchmaking, sync_seconds = seconds_per_sync(o.histories)
    return dict(
        # steady state (up to the last round before the final one); to the end: with the final drain
        tokens_per_second=sum(tps) / n_hosts,
        tokens_per_second_per_peer=tps,
        tokens_per_second_to_the_end=sum(tps_to_end) / n_hosts,
        steady_window_seconds=steady_end - t0,
        tokens_per_second_whole_run=sum(tps_whole) / n_hosts,
        window_seconds=t1 - t0,
        rounds_in_window=rounds,
        wire_bytes_per_round=sum(wire) / n_hosts / rounds if rounds else 0.0,
        wire_rx_bytes_per_round=sum(wire_rx) / n_hosts / rounds if rounds else 0.0,
        # the part of the egress sent in bursts (syncs) and the steady rest (DHT, heartbeats, matchmaking)
        wire_burst_bytes_per_round=sum(in_bursts) / n_hosts / rounds if rounds else 0.0,
        wire_background_bytes_per_second=(sum(wire) - sum(in_bursts)) / n_hosts / (t1 - t0),
        payload_bytes_per_round=sum(payload) / n_hosts / (max(steps_done) / args.inner_steps)
        if has_payload
        else None,
        # one unit for every configuration: bytes on the veth in the largest burst (hivemind reports
        # no payload); the payload peak, where the peers report it, is kept beside it
        peak_bytes_per_sync=max(peaks),
        peak_payload_bytes_per_sync=max(peak_payload) if has_payload else None,
        matchmaking_seconds_per_sync=matchmaking,
        sync_seconds_per_sync=sync_seconds,
        steps=steps_done,
        outcomes_last_round=o.histories[0][-1].get("outcomes"),
        train_loss_last_round=sum(h[-1]["loss"] for h in o.histories) / n_hosts,
        wall_seconds=o.wall_seconds,
        **o.cpu,
    )


def bursts(series: list[tuple[float, int]], t0: float, t1: float, cap_mbit: float) -> list[int]:
    """Bytes of each burst on one host's veth: a maximal run of consecutive sampling intervals (netlab's
    0.2 s) inside [t0, t1] in which the host sent faster than 10% of its cap. A sync on the wire is
    one burst (its payload, TCP/IP headers, the ACKs of what it receives meanwhile, any DHT traffic
    in the same intervals); the DHT's heartbeats stay far below the threshold. It errs both ways by
    up to an event: two events less than a sample apart merge (a small sparse sync and a claim), a
    sync that stalls below the threshold for a whole sample splits, and a non-sync spike of more
    than 10% of a sample's capacity (a state download) is a burst of its own."""
    threshold = 0.1 * cap_mbit * 1e6 / 8
    out, current = [], 0
    for (ta, a), (tb, b) in zip(series, series[1:], strict=False):
        if ta < t0 or tb > t1:  # whole sample intervals inside the window
            continue
        if tb > ta and (b - a) / (tb - ta) > threshold:
            current += b - a
        elif current:
            out.append(current)
            current = 0
    if current:
        out.append(current)
    return out


def seconds_per_sync(histories: list[list[dict]]) -> tuple[dict | None, dict | None]:
    """Matchmaking and whole-sync seconds over every peer's syncs (None where nothing synced).

    hivemind's peers time each averaging round's matchmaking and all-reduce (`matchmaking_seconds`,
    `sync_seconds` in their entries). Ours record each round's `RoundResult.seconds` (encoding,
    sending, gathering every member's part, reports, agreement) as `sync_seconds` and have no
    matchmaking: a round's group is the claim view's holders and it starts sending at once, so its
    matchmaking is 0 by construction, not measured."""
    entries = [e for h in histories for e in h]
    syncs = [s for e in entries for s in e.get("sync_seconds") or []]
    if not syncs:
        return None, None
    spent = dict(mean=sum(syncs) / len(syncs), max=max(syncs), syncs=len(syncs))
    timed = [e["matchmaking_seconds"] for e in entries if e.get("matchmaking_seconds") is not None]
    if not timed:
        return dict(mean=0.0, max=0.0, syncs=len(syncs), measured=False), spent
    sizes: dict[str, int] = {}
    for e in entries:
        if e.get("group_size") is not None:
            sizes[str(e["group_size"])] = sizes.get(str(e["group_size"]), 0) + 1
    matchmaking = dict(mean=sum(timed) / len(timed), max=max(timed), syncs=len(timed), measured=True,
                       group_sizes=sizes)  # fmt: skip
    return matchmaking, spent


def load_weights(model: PathModel, tensors: dict[str, torch.Tensor], which: str) -> None:
    with torch.no_grad():
        for mid, module in model.parts.items():
            for name, p in module.named_parameters():
                key = f"{mid}/global/{name}" if which == "global" else f"local/parts.{mid}.{name}"
                p.copy_(tensors[key].to(p.dtype))


def eval_loss(manifest: RunManifest, tensors: dict[str, torch.Tensor], which: str, docs: list[str]) -> float:
    model = PathModel(manifest.model, (0,) * manifest.model.n_levels, seed=manifest.seed)
    load_weights(model, tensors, which)
    result = evaluate(model, docs, load_tokenizer(manifest.tokenizer), context=manifest.seq_len)
    return result.nll / result.tokens


def codec_errors(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Relative L2 error and cosine of each compressing codec on an outer-gradient-like vector: the
    gap between a streaming peer's global copy and its local model at the end."""
    from peer.codecs.formats import make_codec
    from peer.codecs.specs import CODEC_NAMES

    parts = []
    for key, value in tensors.items():
        if "/global/" in key:
            mid, name = key.split("/global/")
            parts.append((value - tensors[f"local/parts.{mid}.{name}"]).reshape(-1).float())
    delta = torch.cat(parts)
    out = {}
    for name in CODEC_NAMES:
        if name in ("fp32", "int8"):
            continue
        codec = make_codec(name)
        data = codec.encode(delta)
        back = codec.decode(data, delta.numel())
        out[name] = dict(
            relative_l2_error=float((back - delta).norm() / delta.norm()),
            cosine=float(torch.nn.functional.cosine_similarity(back, delta, dim=0)),
            bytes_per_value=len(data) / delta.numel(),
        )
    return out


def control_share(r: dict, sync: SyncConfig, n_params: int, peers: int) -> tuple[float, float]:
    """Outer-gradient bytes a peer must send per round in an all-gather of `peers` (each Δ to every
    other member), and the share of everything else on its wire (DHT, claims, reports, TCP/IP) over it."""
    payload = (peers - 1) * n_params * codec_spec(sync.codec).wire_bytes_per_value
    return payload, (r["wire_bytes_per_round"] - payload) / payload


def no_sync_baseline(runs: dict[str, dict]) -> dict:
    """no_sync's tokens/s (steady and whole window): the mean of its runs at the start and the end of
    the lab, each of them, and their spread (max / min − 1)."""
    ends = {n: runs[n] for n in NO_SYNC if n in runs}
    out: dict = dict(runs=list(ends))
    for key in ("tokens_per_second", "tokens_per_second_to_the_end"):
        values = [r[key] for r in ends.values()]
        out[key] = sum(values) / len(values) if values else float("nan")
        out[f"{key}_each"] = values
        out[f"{key}_spread"] = max(values) / min(values) - 1 if values and min(values) > 0 else float("nan")
    return out


def targets_report(runs: dict[str, dict], fragments: int) -> dict:
    s, d = runs.get("streaming_4bit"), runs.get("diloco_fp32")
    out: dict = {}
    if d:
        out["diloco_fp32 tokens_per_second_ratio <= 0.8 (communication-bound)"] = _check(
            d["tokens_per_second_ratio"], 0.8, "max"
        )
    # the whole window is the headline (a streaming peer's drain of its last fragment rounds included)
    if s:
        out["streaming_4bit tokens_per_second_ratio_to_the_end >= 0.95 (whole window)"] = _check(
            s["tokens_per_second_ratio_to_the_end"], 0.95, "min"
        )
    if s and d:
        out["streaming_4bit bytes_sent_per_peer_per_round <= 1/7 of diloco_fp32"] = _check(
            s["bytes_sent_per_peer_per_round"] / d["bytes_sent_per_peer_per_round"], 1 / 7, "max"
        )
        out[f"streaming_4bit peak_bytes_per_sync (wire) <= 1/(7*{fragments}) of diloco_fp32"] = _check(
            s["peak_bytes_per_sync"] / d["peak_bytes_per_sync"], 1 / (7 * fragments), "max"
        )
        out["streaming_4bit eval_loss <= 1.01 x diloco_fp32"] = _check(
            s["eval_loss"] / d["eval_loss"], 1.01, "max"
        )
    sp = runs.get("streaming_sparse")
    if sp:
        out["streaming_sparse tokens_per_second_ratio_to_the_end >= 0.95 (whole window)"] = _check(
            sp["tokens_per_second_ratio_to_the_end"], 0.95, "min"
        )
    if sp and d:
        # Covenant-72B's 146x: on the wire (DHT, reports, TCP/IP included) and the outer gradients alone
        out["streaming_sparse bytes_sent_per_peer_per_round (wire) <= 1/146 of diloco_fp32"] = _check(
            sp["bytes_sent_per_peer_per_round"] / d["bytes_sent_per_peer_per_round"], 1 / 146, "max"
        )
        if sp.get("payload_bytes_per_round") and d.get("payload_bytes_per_round"):
            out["streaming_sparse payload_bytes_per_round <= 1/146 of diloco_fp32"] = _check(
                sp["payload_bytes_per_round"] / d["payload_bytes_per_round"], 1 / 146, "max"
            )
        out["streaming_sparse eval_loss <= 1.02 x diloco_fp32"] = _check(
            sp["eval_loss"] / d["eval_loss"], 1.02, "max"
        )
    return out


def _check(value: float, bound: float, kind: str) -> dict:
    met = value <= bound if kind == "max" else value >= bound
    return dict(value=value, bound=bound, met=bool(met))


LEGEND = (
    "Tokens/s ratio: per-peer tokens/s over no_sync's, the mean of its runs at the start and the end "
    "of the lab (each, and their spread, below the table). Whole window: from the moment all peers "
    "trained to the final round's end, which a streaming peer reaches after waiting for its last "
    "fragment rounds once training stopped; steady state: to every peer's last round before its "
    "final one. The per-peer tokens/s column is the steady state's. "
    "Bytes per round: veth egress (payload, DHT, TCP/IP) while all peers trained, per H inner steps. "
    "Peak wire bytes per sync: the largest burst of bytes on a peer's veth (a run of 0.2 s samples "
    "above 10% of the cap: a sync's payload with its TCP/IP overhead), the same unit for every run; "
    "peak payload: the most outer-gradient bytes a peer sent for one sync event, from its history "
    "(hivemind reports none). Matchmaking s per sync: hivemind's `look_for_group`, timed per "
    "averaging round, mean (max) over all peers' rounds; ours has none (a round's group is the "
    "signed claim view's holders, and it starts sending at once), 0 by construction. Sync s: mean "
    "seconds from a sync's start to its result (ours: encoding, all-gather, reports, agreement, "
    "overlapped with τ steps when streaming; hivemind: matchmaking plus all-reduce, which the next "
    "local step waits for). Control share: wire bytes beyond the outer gradients an all-gather must "
    "send (each Δ to every other member), over those. Eval loss: NLL per token on held-out documents "
    "of peer 0's global copy (no_sync and hivemind: its local model, hivemind's right after its last "
    "average) after the same number of steps."
)


def _cell_kb(value: float | None) -> str:
    return "–" if value is None else f"{value / 1e3:,.0f} kB"


def _row(name: str, r: dict) -> str:
    mm, spent = r.get("matchmaking_seconds_per_sync"), r.get("sync_seconds_per_sync")
    if mm is None:
        matchmaking = "–"
    elif mm["measured"]:
        matchmaking = f"{mm['mean']:.1f} (max {mm['max']:.1f})"
    else:
        matchmaking = "0 (none)"
    control = f"{r['control_share']:.1%}" if "control_share" in r else "–"
    sync = "–" if spent is None else f"{spent['mean']:.1f}"
    return (
        f"| {name} | {r['tokens_per_second']:.0f} "
        f"| {r.get('tokens_per_second_ratio_to_the_end', float('nan')):.3f} "
        f"| {r['tokens_per_second_ratio']:.3f} "
        f"| {_cell_kb(r['bytes_sent_per_peer_per_round'])} | {_cell_kb(r['peak_bytes_per_sync'])} "
        f"| {_cell_kb(r['peak_payload_bytes_per_sync'])} | {matchmaking} "
        f"| {sync} | {control} | {r['eval_loss']:.4f} |"
    )


def _sparse(report: dict) -> str:
    sp = report.get("sparse")
    if not sp:
        return ""
    own_tau = sp.get("overlap_steps") not in (None, report["overlap_steps"])
    return (
        f" (streaming_sparse: codec {sp.get('codec', 'sparse')}, outer lr {sp['outer_lr']:g}, "
        f"momentum {sp['outer_momentum']:g}, "
        f"α = {sp['mixing_alpha']:g}" + (f", τ = {sp['overlap_steps']}" if own_tau else "") + ")"
    )


def write_markdown(path: Path, report: dict) -> str:
    runs = report["runs"]
    lines = [
        f"{report['peers']} peers, egress cap {report['cap_mbit']:g} Mbit/s each, loss {report['loss']:g}, "
        f"{report['steps']} steps, H = {report['H']}, streaming P = {report['fragments']}, "
        f"τ = {report['overlap_steps']}, α = {report['mixing_alpha']}, codec {report['codec']}"
        f"{_sparse(report)}; "
        f"compute quota {report['compute_cores']:g} core per peer; model "
        f"{report['model_parameters'] / 1e6:.2f}M parameters "
        f"({report['model_bytes_fp32'] / 1e6:.2f} MB fp32)",
        "",
        "| run | tokens/s per peer | tokens/s ratio, whole window | … steady state "
        "| bytes sent / peer / round "
        "| peak wire bytes / sync | peak payload / sync | matchmaking s / sync | sync s | control share "
        "| eval loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [_row(name, r) for name, r in runs.items()]
    base = report.get("no_sync_baseline")
    if base and base.get("runs"):
        each = ", ".join(f"{v:.0f}" for v in base["tokens_per_second_to_the_end_each"])
        lines += ["", f"no_sync tokens/s per peer, whole window: {each} ({', '.join(base['runs'])}), "
                  f"spread {base['tokens_per_second_to_the_end_spread']:.1%}; steady state: "
                  + ", ".join(f"{v:.0f}" for v in base["tokens_per_second_each"])
                  + f", spread {base['tokens_per_second_spread']:.1%}"]  # fmt: skip
    for name, error in report.get("failed", {}).items():
        lines.append(f"| {name} | failed: {error.splitlines()[0][:80]} |" + " |" * 9)
    cpu = [f"{name} {r['compute_cpu_seconds_per_peer']:.1f} / {r['comm_cpu_seconds_per_peer']:.1f} s, "
           f"{r['training_thread_preemptions_per_peer']:,.0f}" for name, r in runs.items()
           if "training_thread_preemptions_per_peer" in r]  # fmt: skip
    if cpu:
        lines += ["", "CPU per peer, training thread / the rest (sync, p2p daemon, DHT), and times its "
                  "training thread was preempted: " + "; ".join(cpu)]  # fmt: skip
    host = [f"{name} {r['host_steal_seconds']:.1f} / {r['host_cpu_seconds_outside_peers']:.1f} s"
            for name, r in runs.items() if "host_steal_seconds" in r]  # fmt: skip
    if host:
        lines += ["", "The machine's CPU over each run, all cores: stolen by the hypervisor / spent outside "
                  "the peers (the lab itself, other processes): " + "; ".join(host)]  # fmt: skip
    if split := copies.split_lines(runs):
        lines += ["", *split]
    lines += ["", "| target | value | bound | met |", "|---|---:|---:|---|"]
    for name, t in report["targets"].items():
        lines.append(f"| {name} | {t['value']:.4g} | {t['bound']:.4g} | {'yes' if t['met'] else 'NO'} |")
    lines += ["", LEGEND]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def write_plot(path: Path, report: dict, outcomes: dict[str, Outcome]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, o in outcomes.items():
        t0 = min(h[0]["time"] - h[0]["train_seconds"] for h in o.histories)
        h = o.histories[0]
        axes[0].plot([e["time"] - t0 for e in h], [e["loss"] for e in h], marker=".", label=name)
        series = [(t - t0, c[1][0] / 1e6) for t, c in o.samples]
        axes[1].plot([t for t, _ in series], [b - series[0][1] for _, b in series], label=name)
    axes[0].set(xlabel="seconds of training", ylabel="train loss (peer 0, per round)", title="loss vs time")
    axes[1].set(xlabel="seconds", ylabel="MB sent by peer 0 (veth)", title="bytes on the wire")
    runs = report["runs"]
    names = list(runs)
    metrics = [("tokens_per_second_ratio_to_the_end", "tokens/s ratio\n(whole window)"),
               ("bytes_sent_per_peer_per_round", "bytes/round\n(wire)"),
               ("peak_bytes_per_sync", "peak bytes/sync\n(wire)"), ("eval_loss", "eval loss")]  # fmt: skip
    ref = runs.get("diloco_fp32")
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        # log scale: a zero (no_sync sends nothing) is left out rather than drawn
        values = [runs[name][k] / ref[k] if ref and ref[k] and runs[name][k] > 0 else float("nan")
                  for k, _ in metrics]  # fmt: skip
        values = [v if v >= 1e-3 else float("nan") for v in values]  # no_sync's few DHT bytes
        axes[2].bar([i + j * width for i in range(len(metrics))], values, width, label=name)
    axes[2].set_xticks(
        [i + width * (len(names) - 1) / 2 for i in range(len(metrics))], [m for _, m in metrics]
    )
    if ref:
        axes[2].set_yscale("log")
    axes[2].set(title="relative to diloco_fp32 (log; colors as on the left)")
    for ax in axes[:2]:  # the bars share the lines' colors: a third legend would only cover bars
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
