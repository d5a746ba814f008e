"""`benchmarks.sparse_outer`'s table (sparse_outer.md) and plot (sparse_outer.png: eval loss against
outer rounds and against the bytes each peer sent), from the report it writes as JSON."""

from __future__ import annotations

from pathlib import Path


def _mean_curve(run: dict) -> list[tuple[int, float, float]]:
    """(round, bytes per peer, loss) averaged over seeds, at the rounds every seed measured."""
    curves = [r["curve"] for r in run["per_seed"].values()]
    rounds = sorted(set.intersection(*({p["round"] for p in c} for c in curves)))
    out = []
    for rnd in rounds:
        points = [next(p for p in c if p["round"] == rnd) for c in curves]
        n = len(points)
        out.append(
            (rnd, sum(p["payload_bytes_per_peer"] for p in points) / n, sum(p["loss"] for p in points) / n)
        )
    return out


def _candidate(c: dict) -> str:
    """One tuning candidate's settings and validation loss, as the report lists them."""
    text = f"lr {c['lr']:g} m {c['momentum']:g}"
    text += "" if c["density"] is None else f" d {c['density']:.4g}"
    text += "" if c.get("decay") is None else f" ef decay {c['decay']:g}"
    text += "" if c.get("inner_lr") is None else f" inner lr {c['inner_lr']:g}"
    text += f": {c['validation_loss']:.4f}"
    return text + ("" if c.get("eligible", True) else " (over the byte budget)")


def write_report(out: Path, report: dict) -> str:
    runs = report["runs"]
    lines = [
        f"{report['peers']} replicas, d_model {report['d_model']}, {report['steps']} steps, "
        f"H = {report['inner_steps']} ({report['steps'] // report['inner_steps']} outer rounds), "
        f"P = {report['fragments']}, τ = {report['overlap_steps']} (diloco_fp32: P = 1, τ = 0), error "
        f"feedback decay {report['error_feedback_decay']}, seeds {report['seeds']}; eval loss of replica "
        f"0's global copy; settings {'tuned on the validation split' if report['tuned'] else 'as given'}",
        "",
        "| run | inner (lr) | codec | outer lr | momentum | α | density | ef decay | eval loss "
        "| × diloco_fp32 | × fp32, same inner | bytes: diloco / run | bits / value / round |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        density = "" if r.get("density") is None else f"{r['density']:.4g}"
        decay = "" if r.get("decay") is None else f"{r['decay']:g}"
        same = r.get("eval_loss_ratio_same_inner")
        inner_lr = "" if r.get("inner_lr") is None else f" ({r['inner_lr']:g})"
        lines.append(
            f"| {name} | {'Muon' if r.get('muon') else 'AdamW'}{inner_lr} | {r['codec']} | {r['lr']:g} "
            f"| {r['momentum']:g} | {r['alpha']:g} | {density} | {decay} "
            f"| {r['eval_loss']:.4f} | {r['eval_loss_ratio']:.3f} | {'' if same is None else f'{same:.3f}'} "
            f"| {r['bytes_ratio']:.1f} | {r['wire_bits_per_value_per_round']:.3f} |"
        )
    for name, t in report.get("tuning", {}).items():
        tried = ", ".join(_candidate(c) for c in t["candidates"])
        lines.append(f"\n{name} tuned (validation loss): {tried}; picked {t['picked']}")
    text = "\n".join(lines) + "\n"
    (out / "sparse_outer.md").write_text(text)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_round, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in runs.items():
        curve = _mean_curve(r)
        by_round.plot([c[0] for c in curve], [c[2] for c in curve], marker=".", label=name)
        sent = [(c[1], c[2]) for c in curve if c[1] > 0]
        by_bytes.plot([b for b, _ in sent], [loss for _, loss in sent], marker=".", label=name)
    by_round.set(xlabel="outer round", ylabel="eval loss (global copy)", title="loss against rounds")
    by_bytes.set(xscale="log", xlabel="payload bytes sent per peer", title="loss against bytes sent")
    by_round.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "sparse_outer.png", dpi=120)
    plt.close(fig)
    return text
