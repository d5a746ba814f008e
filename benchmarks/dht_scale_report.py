"""The DHT scale benchmark's report (benchmarks/dht_scale.py): the markdown table and the PNG, one
row and one line per swarm size and DHT setting."""

from __future__ import annotations

from pathlib import Path

from dht.records import SEARCH_BEAM_SIZE

#: the two DHT settings compared: pathswarm's (beams of `SEARCH_BEAM_SIZE`, validations remembered)
#: and hivemind's defaults (beams of 20, every record validated in full on arrival; pathswarm before)
PATHSWARM = f"pathswarm (beam {SEARCH_BEAM_SIZE}, validations remembered)"
HIVEMIND_DEFAULTS = "hivemind defaults (beam 20, every record validated)"


def row(r: dict) -> str:
    settings = "hivemind defaults" if r["dht_settings"] == HIVEMIND_DEFAULTS else "pathswarm"
    if "error" in r:
        why = r["error"].strip().splitlines()[-1][:240].replace("|", "/")
        return f"| {settings} | {r['nodes']} | stopped: {why} |" + " |" * 7
    leave, kill = r["visible_after_leave_seconds"], r["visible_after_kill_seconds"]
    if r["convergence_seconds_max"] is not None:
        converged = f"{r['convergence_seconds_max']:.1f} ({r['convergence_seconds_median']:.1f})"
    else:
        converged = (
            f"no: {r['converged_nodes']}/{r['nodes']} views; the fullest read of each held "
            f"≥ {100 * r['view_coverage_min']:.0f}% (median {100 * r['view_coverage_median']:.0f}%)"
        )
    work = r["heartbeat_work_seconds_median"]
    late = f"{max(leave):.1f}" if leave else "—"
    if r["still_visible_at_deadline"]:
        late += f" ({r['still_visible_at_deadline']} pairs still visible)"
    return (
        f"| {settings} | {r['nodes']} ({r['client_nodes']} client) | {converged} "
        f"| {r['rpcs_per_node_per_minute']:.0f} "
        f"({r['rpcs_per_node_per_minute_max']:.0f}) | {r['cpu_seconds_per_node_per_minute']:.2f} "
        f"| {100 * r['machine_cpu_busy_fraction']:.0f}% | {work:.1f} "
        f"| {r['rss_mib_per_node']:.0f} / {r['uss_mib_per_node']:.0f} | {late} | "
        + (f"{min(kill):.1f}–{max(kill):.1f} |" if kill else "— |")
    )


def write_report(result: dict, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = result["sizes"]
    table = (
        "| DHT settings | nodes | converged s, max (median) | DHT RPCs / node / min, mean (max) "
        "| CPU s / node / min "
        "| machine busy | heartbeat's publish + read s, median "
        "| RSS / USS MiB per node | left: visible s, max | killed: visible s |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(row(r) for r in sizes) + "\n"
    )
    (out / "dht_scale.md").write_text(table)
    sizes = [r for r in sizes if "error" not in r]
    if not sizes:
        return table
    nan = float("nan")
    cores = result["machine"]["cpus"]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    for settings, style in ((PATHSWARM, "-"), (HIVEMIND_DEFAULTS, "--")):
        rows = [r for r in sizes if r["dht_settings"] == settings]
        if not rows:
            continue
        tag = "hivemind defaults" if settings == HIVEMIND_DEFAULTS else "pathswarm"
        ns = [r["nodes"] for r in rows]
        conv = [nan if r["convergence_seconds_max"] is None else r["convergence_seconds_max"] for r in rows]
        axes[0].plot(ns, conv, "o" + style, color="tab:blue", label=f"{tag}: views hold every claim, s (max)")
        axes[0].plot(ns, [r["heartbeat_work_seconds_median"] or nan for r in rows], "s" + style,
                     color="tab:orange", label=f"{tag}: a heartbeat's publish + read, s")  # fmt: skip
        for r in rows:
            if r["convergence_seconds_max"] is None:
                axes[0].annotate(f"not converged:\nfullest views ≥ {100 * r['view_coverage_min']:.0f}%",
                                 (r["nodes"], r["heartbeat_work_seconds_median"] or 0), fontsize=8,
                                 textcoords="offset points", xytext=(-70, 12))  # fmt: skip
        axes[1].plot(ns, [r["rpcs_per_node_per_minute"] for r in rows], "o" + style, color="tab:blue",
                     label=f"{tag}: mean")  # fmt: skip
        axes[1].plot(ns, [r["rpcs_per_node_per_minute_max"] for r in rows], "s" + style, color="tab:green",
                     label=f"{tag}: max")  # fmt: skip
        axes[2].plot(ns, [r["cpu_seconds_per_node_per_minute"] for r in rows], "^" + style, color="tab:red",
                     label=f"{tag}: CPU s / node / min")  # fmt: skip
        axes[2].plot(ns, [cores * 60 / r["nodes"] for r in rows], ":", color="grey",
                     label=None if settings != PATHSWARM else f"all {cores} cores, shared")  # fmt: skip
    axes[0].axhline(sizes[0]["heartbeat_seconds"], color="grey", ls=":", label="heartbeat period")
    axes[0].set(xlabel="nodes", ylabel="seconds", title="claim views converge?")
    axes[1].set(xlabel="nodes", ylabel="RPCs sent per node per minute", title="DHT requests")
    axes[2].set(xlabel="nodes", ylabel="CPU seconds per node per minute", title="CPU per node (process tree)")
    last = [r for r in sizes if r["dht_settings"] == PATHSWARM][-1:] or sizes[-1:]
    last = last[0]
    for key, label in (
        ("visible_after_leave_seconds", "left (SIGTERM)"),
        ("visible_after_kill_seconds", "killed"),
    ):
        values = sorted(last[key])
        if not values:
            continue
        axes[3].step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
    axes[3].axvline(last["claim_ttl_seconds"], color="grey", ls=":", label="claim TTL")
    axes[3].set(xlabel="seconds the claim stays visible", ylabel="fraction of (departed, observer)",
                title=f"after a departure, {last['nodes']} nodes")  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left" if ax is axes[0] else "best")
    for ax in axes[:3]:
        ax.set_ylim(bottom=0)
    axes[0].set_ylim(top=1.9 * axes[0].get_ylim()[1])  # room for the legend above the lines
    fig.tight_layout()
    fig.savefig(out / "dht_scale.png", dpi=110)
    return table
