"""Draws docs/figures/architecture.png: `python docs/figures/architecture.py` (needs matplotlib, in the
[dev] extra). Three panels: the grid of modules and the path each peer trains, the processes and
records around the peers, and one module's fragment schedule (Streaming DiLoCo)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).with_suffix(".png")
PEERS = {"A": (0, 0), "B": (0, 1), "C": (1, 0), "D": (1, 1)}  # peer -> its path (module per level)
COLOURS = {"A": "#1b6ca8", "B": "#d1495b", "C": "#2a9d8f", "D": "#e9a23b"}
BOX = "#f4f4f4"
EDGE = "#555555"


def box(ax, x, y, w, h, text, *, fc=BOX, size=9, weight="normal", align="center"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                fc=fc, ec=EDGE, lw=1.0))  # fmt: skip
    tx = x + w / 2 if align == "center" else x + 0.15
    ax.text(tx, y + h / 2, text, ha=align, va="center", fontsize=size, weight=weight, linespacing=1.35)


def arrow(ax, a, b, text="", *, both=False, rad=0.0, offset=(0, 0), colour=EDGE, size=8):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="<|-|>" if both else "-|>", mutation_scale=11,
                                 connectionstyle=f"arc3,rad={rad}", color=colour, lw=1.1,
                                 shrinkA=2, shrinkB=2))  # fmt: skip
    if text:
        mx, my = (a[0] + b[0]) / 2 + offset[0], (a[1] + b[1]) / 2 + offset[1]
        ax.text(mx, my, text, ha="center", va="center", fontsize=size, color="#333333",
                bbox=dict(fc="white", ec="none", pad=1.0))  # fmt: skip


def grid_panel(ax):
    """Left: trunk + two levels of two modules; each peer's path drawn through its modules."""
    ax.set_xlim(-1.6, 7.4)
    ax.set_ylim(-1.9, 5.6)
    ax.axis("off")
    ax.set_title("A 2×2 grid: each peer trains one path,\nthe holders of each module keep it in sync",
                 fontsize=11, loc="left")  # fmt: skip
    box(ax, 0.5, -0.6, 1.4, 5.2, "")
    ax.text(1.2, 4.3, "trunk", ha="center", va="center", fontsize=10, weight="bold")
    ax.text(1.2, 3.72, "embeddings,\nnorm, head", ha="center", va="center", fontsize=7.5, color="#333333")
    centre = {}
    for level in range(2):
        for k in range(2):
            x, y = 2.9 + level * 2.2, 2.5 - k * 2.7
            box(ax, x, y, 1.4, 1.6, "")
            ax.text(x + 0.7, y + 1.35, f"l{level}m{k}", ha="center", va="center", fontsize=10, weight="bold")
            centre[f"l{level}m{k}"] = (x + 0.7, y + 0.6)
    ax.text(3.6, 4.45, "level 0", ha="center", fontsize=9, color="#333333")
    ax.text(5.8, 4.45, "level 1", ha="center", fontsize=9, color="#333333")
    for i, (peer, path) in enumerate(PEERS.items()):
        y0 = 3.2 - i * 1.18
        ax.add_patch(plt.Circle((-0.9, y0), 0.33, fc=COLOURS[peer], ec="none"))
        ax.text(-0.9, y0, peer, ha="center", va="center", color="white", fontsize=10, weight="bold")
        ax.text(-0.9, y0 - 0.55, f"path {path[0] * 2 + path[1]}", ha="center", fontsize=7.5)
        # within a module box, the paths through it keep their order: the one from above stays above
        pts = [(-0.55, y0), (2.2, y0)]
        for lv, k in enumerate(path):
            cx, cy = centre[f"l{lv}m{k}"]
            through = [q for q, pq in PEERS.items() if pq[lv] == k]
            dy = 0.25 if through.index(peer) == 0 else -0.25
            pts += [(cx - 0.45, cy + dy), (cx + 0.45, cy + dy)]
        pts.append((7.0, pts[-1][1]))
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, color=COLOURS[peer], lw=2.4, solid_capstyle="round", zorder=3)
    ax.text(-1.5, -1.25, "holders average:  trunk A B C D · l0m0 A B · l0m1 C D · l1m0 A C · l1m1 B D",
            fontsize=8.5, color="#333333")  # fmt: skip
    sync = "each sync: Δ = θ̄ − θ_local, all-gathered, robustly aggregated, same bits on every holder"
    ax.text(-1.5, -1.75, sync, fontsize=8.5, color="#333333")


def swarm_panel(ax):
    """Right: the DHT's records, the peers' P2P traffic, keepers and the monitoring chain."""
    ax.set_xlim(0, 10.4)
    ax.set_ylim(-0.2, 10.2)
    ax.axis("off")
    ax.set_title("Around the peers: small signed records in the DHT,\nbulk bytes peer to peer",
                 fontsize=11, loc="left")  # fmt: skip
    box(ax, 2.9, 5.6, 4.3, 4.2,
        "DHT  (dht/: Kademlia over libp2p)\n\n• run manifest, signed; sha256 = run id\n"
        "• claims: path, progress, digests\n   (heartbeat 5 s, gone after 30 s)\n"
        "• probes · artifacts · router versions\n• keepers' stash records",
        align="left", size=8.5)  # fmt: skip
    box(ax, 0.0, 7.0, 2.4, 2.2, "bootstrap node\n\n--keep_state:\nkeeper of the\nlast copies", size=8.5)
    box(ax, 0.0, 0.2, 6.0, 3.9, "", fc="#fbfbfb")
    ax.text(0.2, 3.75, "peers  (pathswarm peer, one per volunteer)", fontsize=8.5, va="center")
    spots = {"A": (1.0, 2.6), "B": (4.9, 2.6), "C": (1.0, 1.0), "D": (4.9, 1.0)}
    for a, b in (("A", "B"), ("C", "D"), ("A", "C"), ("B", "D"), ("A", "D"), ("B", "C")):
        (x1, y1), (x2, y2) = spots[a], spots[b]
        ax.plot([x1, x2], [y1, y2], color="#9a9a9a", lw=1.0, ls="--", zorder=1)
    for peer, (x, y) in spots.items():
        ax.add_patch(plt.Circle((x, y), 0.36, fc=COLOURS[peer], ec="none", zorder=2))
        ax.text(x, y, peer, ha="center", va="center", color="white", fontsize=10, weight="bold", zorder=3)
    ax.text(2.95, 1.8, "P2P streams:\nrounds (Δ parts, reports),\nmodule states, artifacts",
            ha="center", va="center", fontsize=8, bbox=dict(fc="white", ec="none", pad=1.5))  # fmt: skip
    box(ax, 7.8, 7.0, 2.5, 2.2, "pathswarm\nmonitor\n\nstatus page", size=8.5)
    box(ax, 7.8, 3.9, 2.5, 1.7, "Prometheus\n+ alert rules", size=8.5)
    box(ax, 7.8, 0.8, 2.5, 1.7, "Grafana\ndashboards", size=8.5)
    arrow(ax, (3.2, 4.15), (4.0, 5.55), "claims,\nprobes", both=True, offset=(-0.65, 0))
    arrow(ax, (2.45, 8.1), (2.85, 8.1), both=True)
    arrow(ax, (7.25, 8.1), (7.75, 8.1))
    ax.text(7.5, 9.45, "reads\nclaims", ha="center", va="center", fontsize=7.5)
    arrow(ax, (9.05, 6.95), (9.05, 5.65), "/metrics", offset=(0.0, 0))
    arrow(ax, (6.05, 2.6), (7.75, 4.4), "/metrics", offset=(0.0, -0.05))
    arrow(ax, (9.05, 3.85), (9.05, 2.55))


def schedule_panel(ax, h=48, p=4, tau=11, rounds=2):
    """Bottom: when each fragment of one module is sent, in flight, and applied (t_p = p·H/P)."""
    end = rounds * h + 12
    ax.set_xlim(-9, end + 1)
    ax.set_ylim(-1.35, p + 1.0)
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("inner step", fontsize=9)
    ax.set_xticks(range(0, end + 1, 12))
    ax.tick_params(labelsize=8)
    title = (
        f"One module's P = {p} fragments (H = {h}, τ = {tau}, as in the WAN lab): each fragment's round runs "
        "in the background\nwhile inner steps go on; τ steps later its outer step is applied to θ̄ and mixed "
        "into the local model with α"
    )
    ax.set_title(title, fontsize=10, loc="left")
    ax.add_patch(plt.Rectangle((0, p - 0.05), end, 0.55, fc="#dfe9f3", ec="none"))
    ax.text(end / 2, p + 0.22, "inner steps: AdamW on the path's shard, never waiting for a round",
            ha="center", va="center", fontsize=8.5)  # fmt: skip
    palette = ["#1b6ca8", "#2a9d8f", "#e9a23b", "#d1495b"]
    for f in range(p):
        row = p - 1 - f
        ax.text(-1.5, row + 0.2, f"fragment {f}", ha="right", va="center", fontsize=8.5)
        t_p = f * h // p
        starts = [t_p + k * h for k in range(rounds + 1) if 0 < t_p + k * h <= end - tau]
        for t in starts:
            ax.add_patch(plt.Rectangle((t, row), tau, 0.4, fc=palette[f], alpha=0.35, ec=palette[f]))
            ax.plot([t, t], [row - 0.05, row + 0.45], color=palette[f], lw=1.6)
            ax.plot(t + tau, row + 0.2, marker="D", color=palette[f], ms=5)
    first = h // p  # fragment 1's first round
    row1 = p - 2
    ax.annotate("", xy=(first + tau, row1 - 0.2), xytext=(first, row1 - 0.2),
                arrowprops=dict(arrowstyle="<->", lw=0.9))  # fmt: skip
    ax.text(first + tau / 2, row1 - 0.45, "τ", ha="center", va="center", fontsize=9)
    ax.annotate("", xy=(first + h, row1 + 0.62), xytext=(first, row1 + 0.62),
                arrowprops=dict(arrowstyle="<->", lw=0.9))  # fmt: skip
    ax.text(first + h / 2, row1 + 0.78, "H", ha="center", va="center", fontsize=9)
    sent = "Δ encoded and sent: t ≡ ⌊p·H/P⌋ (mod H)"
    flight = "round in flight: all-gather, reports, aggregation"
    applied = "outer step on θ̄, then θ_local ← α·θ_local + (1−α)·θ̃"
    ax.plot([], [], color="#555555", lw=1.6, label=sent)
    ax.add_patch(plt.Rectangle((0, 0), 0, 0, fc="#999999", alpha=0.35, label=flight))
    ax.plot([], [], marker="D", ls="none", color="#555555", label=applied)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, -0.02), ncol=3, fontsize=8, frameon=False)


def main() -> None:
    fig = plt.figure(figsize=(13, 9.6))
    spec = fig.add_gridspec(2, 2, height_ratios=[1.45, 1], width_ratios=[1, 1.08], hspace=0.28, wspace=0.06,
                            left=0.03, right=0.985, top=0.94, bottom=0.07)  # fmt: skip
    grid_panel(fig.add_subplot(spec[0, 0]))
    swarm_panel(fig.add_subplot(spec[0, 1]))
    schedule_panel(fig.add_subplot(spec[1, :]))
    fig.savefig(OUT, dpi=110, metadata={"Software": None})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
