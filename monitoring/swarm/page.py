"""The status page as one self-contained HTML document: inline CSS, inline SVG charts, a few lines of
inline script for the peer search. Nothing is loaded from elsewhere, so it works offline.

`render_page(status)` takes the same dict that `/api/status` serves (see `monitoring.swarm.status`).
"""

# ruff: noqa: E501 - HTML and SVG markup reads better unwrapped
from __future__ import annotations

from html import escape

COLOURS = {0: "#d9534f", 1: "#f0ad4e"}  # no holder: red; one holder: amber; two or more: green
HEALTHY = "#5cb85c"
#: peer rows drawn on the page (a public run can have thousands); ?peer=ID finds any other one
MAX_PAGE_ROWS = 300
#: leaderboard rows drawn on the page; ?peer=ID shows one's own row wherever it ranks
MAX_LEADERBOARD_ROWS = 50
LINE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")

STYLE = """
body{font-family:sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .2em} h2{font-size:1.1em;margin:1.2em 0 .4em} h3{font-size:1em;margin:.6em 0 .3em}
.sub{color:#666;font-size:.9em} .cards{display:flex;gap:1em;flex-wrap:wrap}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:.5em 1em;min-width:8em}
.card b{display:block;font-size:1.5em} table{border-collapse:collapse;background:#fff}
td,th{border:1px solid #ddd;padding:.25em .6em;font-size:.85em;text-align:left}
td.cell{text-align:center;color:#fff;font-weight:bold;min-width:3.5em} td.off{background:#eee}
.charts{display:flex;gap:1em;flex-wrap:wrap} .chart{background:#fff;border:1px solid #ddd;border-radius:6px}
tr.mine{outline:3px solid #1f77b4} .bad{color:#d9534f;font-weight:bold} code{font-size:.85em}
input{font-size:1em;padding:.3em;width:28em}
"""

SCRIPT = """
function findPeer(){var q=document.getElementById('peer-search').value.trim();var n=0;
document.querySelectorAll('#peers tbody tr').forEach(function(r){var hit=!q||r.dataset.peer.indexOf(q)>=0;
r.style.display=hit?'':'none';r.classList.toggle('mine',!!q&&hit);if(hit)n++;});
document.getElementById('peer-found').textContent=q?(n?n+' peer(s) match':'not in the swarm (yet?)'):'';}
"""


def _colour(holders: int) -> str:
    return COLOURS.get(holders, HEALTHY)


def grid_table(status: dict) -> str:
    modules: list[str] = status["modules"]
    head = "".join(f"<th>{escape(m)}</th>" for m in modules)
    rows = []
    for path in status["paths"]:
        cells = status["grid"].get(str(path), {})
        tds = []
        for m in modules:
            if m in cells:
                # coloured by the confirmed holders (admitted); claims beyond them are shown, not counted
                n, claimed = status["module_holders_confirmed"].get(m, 0), cells[m]
                lag = status["module_round_spread"].get(m, 0)
                title = f"{m}: {n} confirmed holder(s) of {claimed} claimed, fragment lag {lag}"
                text = f"{n}" if claimed == n else f"{n} <small>({claimed} claimed)</small>"
                tds.append(f'<td class="cell" style="background:{_colour(n)}" title="{escape(title)}" '
                           f'data-module="{escape(m)}" data-holders="{n}" data-claimed="{claimed}">{text}</td>')  # fmt: skip
            else:
                tds.append('<td class="off"></td>')
        holders = status["path_holders"].get(str(path), 0)
        rows.append(f'<tr data-path="{path}"><th>path {path} ({holders} peer(s))</th>{"".join(tds)}</tr>')
    return f'<table id="grid"><thead><tr><th></th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def line_chart(
    title: str, series: dict[str, list[tuple[float, float]]], width: int = 360, height: int = 150
) -> str:
    """An SVG line chart of `series` (name -> [(time, value)]) with its min/max on the y axis."""
    points = [p for s in series.values() for p in s]
    pad_l, pad_b, pad_t = 46, 18, 22
    svg = [f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{escape(title)}">',
           f'<text x="8" y="15" font-size="12" font-weight="bold">{escape(title)}</text>']  # fmt: skip
    if not points:
        svg.append(
            f'<text x="{width // 2 - 30}" y="{height // 2}" font-size="12" fill="#888">no data yet</text>'
        )
        return "".join(svg) + "</svg>"
    t0, t1 = min(p[0] for p in points), max(p[0] for p in points)
    lo, hi = min(0.0, min(p[1] for p in points)), max(p[1] for p in points)
    hi = hi if hi > lo else lo + 1.0
    span_t = (t1 - t0) or 1.0

    def xy(t: float, v: float) -> str:
        x = pad_l + (t - t0) / span_t * (width - pad_l - 8)
        y = height - pad_b - (v - lo) / (hi - lo) * (height - pad_b - pad_t)
        return f"{x:.1f},{y:.1f}"

    svg.append(
        f'<line x1="{pad_l}" y1="{height - pad_b}" x2="{width - 8}" y2="{height - pad_b}" stroke="#999"/>'
    )
    svg.append(f'<text x="4" y="{pad_t + 8}" font-size="10">{hi:.3g}</text>')
    svg.append(f'<text x="4" y="{height - pad_b}" font-size="10">{lo:.3g}</text>')
    svg.append(f'<text x="{pad_l}" y="{height - 4}" font-size="10">{span_t / 60:.1f} min</text>')
    for i, (name, pts) in enumerate(sorted(series.items())):
        colour = LINE_COLOURS[i % len(LINE_COLOURS)]
        if len(pts) == 1:
            svg.append(
                f'<circle cx="{xy(*pts[0]).split(",")[0]}" cy="{xy(*pts[0]).split(",")[1]}" r="3" fill="{colour}"/>'
            )
        else:
            svg.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{" ".join(xy(*p) for p in pts)}"/>'
            )
        if len(series) > 1:
            svg.append(
                f'<text x="{width - 70}" y="{pad_t + 12 * i}" font-size="10" fill="{colour}">{escape(name)}</text>'
            )
    return "".join(svg) + "</svg>"


def charts(status: dict) -> str:
    hist = status["history"]
    tps = {"tokens/s": [(h["time"], h["tokens_per_second"]) for h in hist]}
    lag = {"rounds": [(h["time"], h["max_round_spread"]) for h in hist]}
    loss: dict[str, list[tuple[float, float]]] = {}
    for h in hist:
        for path, value in h["loss_by_path"].items():
            loss.setdefault(f"path {path}", []).append((h["time"], value))
    return ('<div class="charts">' + line_chart("swarm tokens/s", tps) + line_chart("largest fragment lag (rounds)", lag)
            + line_chart("loss by path", loss) + "</div>")  # fmt: skip


def _seconds(v) -> str:
    return "—" if v is None else f"{v:.2f} s"


def plan_section(status: dict) -> str:
    """The scheduler's plan: its predicted round time against the swarm's now and the measured one,
    and the moves it asks for (peers follow it only in planned runs that re-plan online)."""
    plan = status.get("plan")
    if not plan:
        return '<p id="plan">no plan yet</p>'
    follows = ("the peers follow it" if plan["mode"] == "planned" and plan["replan_online"]
               else "the peers plan at join only" if plan["mode"] == "planned"
               else f"scheduler mode {plan['mode']}: the peers do not follow it")  # fmt: skip
    ratio = plan.get("predicted_over_measured")
    items = [("round now (cost model)", _seconds(plan["current_round_seconds"])),
             ("round measured (median peer)", _seconds(plan["measured_round_seconds"])),
             ("predicted / measured", "—" if ratio is None else f"{ratio:.2f}"),
             ("round with the plan", _seconds(plan["planned_round_seconds"])),
             ("moves the plan asks for", len(plan["moves"])), ("peers probed", f"{plan['probed']} of {plan['peers']}")]  # fmt: skip
    cards = "".join(f'<div class="card">{escape(k)}<b>{escape(str(v))}</b></div>' for k, v in items)
    moves = "".join(
        f'<tr data-move="{escape(m["peer_id"])}"><td><code>{escape(m["peer_id"])}</code></td>'
        f"<td>{m['path']}</td><td>{m['planned_path']}</td></tr>"
        for m in plan["moves"][:MAX_PAGE_ROWS]
    )
    table = ("<table id=\"plan-moves\"><thead><tr><th>peer id</th><th>path now</th><th>path in the plan</th></tr></thead>"
             f"<tbody>{moves}</tbody></table>") if moves else ""  # fmt: skip
    note = f'<p class="bad">{escape(plan["note"])}</p>' if plan.get("note") else ""
    parts = ""
    if plan["current_round_seconds"] is not None:
        parts = (f" · now: compute {plan['current_compute_seconds']:.2f} s + averaging "
                 f"{plan['current_communication_seconds']:.2f} s")  # fmt: skip
    return (f'<div class="cards" id="plan">{cards}</div>{note}{table}<div class="sub">the peers\' own planner on '
            f"their signed probe records (speeds and links are claims){parts}; {escape(follows)}</div>")  # fmt: skip


def peers_table(status: dict, mine: str = "") -> str:
    """Peers matching `mine` first, then training and fastest ones, at most MAX_PAGE_ROWS."""
    ranked = sorted(status["peers"], key=lambda p: (not (mine and mine in p["peer_id"]),
                                                    p["state"] != "training", -p["tokens_per_second"]))  # fmt: skip
    shown = ranked[:MAX_PAGE_ROWS]
    rows = []
    for p in shown:
        failed = p["sync_outcomes"].get("failed", 0)
        bad = sum(p["bad_parts"].values())
        cls = ' class="mine"' if mine and mine in p["peer_id"] else ""
        loss = "" if p["loss"] is None else f"{p['loss']:.3f}"
        rows.append(
            f'<tr data-peer="{escape(p["peer_id"])}"{cls}><td><code>{escape(p["peer_id"])}</code></td>'
            f"<td>{p['path']}</td><td>{escape(p['state'])}</td>"
            f'<td title="claimed {p["claimed_tokens_per_second"]:.0f}"{" class=bad" if p["implausible"] else ""}>'
            f"{p['tokens_per_second']:.1f}{' (implausible)' if p['implausible'] else ''}</td>"
            f"<td>{p['outer_round']}</td><td>{loss}</td><td>{escape(p['reachability'])}</td>"
            f"<td>{escape(p['software_version'])}</td><td>{p['sync_outcomes'].get('averaged', 0)}</td>"
            f"<td{' class=bad' if failed else ''}>{failed}</td><td{' class=bad' if bad else ''}>{bad}</td></tr>"
        )
    head = "".join(f"<th>{h}</th>" for h in ("peer id", "path", "state", "tokens/s (measured)", "round", "loss",
                                              "reachability", "version", "averaged", "failed", "bad parts"))  # fmt: skip
    note = (
        f'<div class="sub">{len(shown)} of {len(ranked)} peers shown</div>'
        if len(shown) < len(ranked)
        else ""
    )
    return f'{note}<table id="peers"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _contribution_cells(r: dict) -> str:
    confirmed = r["rounds_confirmed"]
    return (f"<td>{r['tokens']:,}</td><td>{r['inner_steps']:,}</td><td>{r['rounds_averaged']}</td>"
            f"<td{' class=bad' if confirmed < r['rounds_averaged'] else ''}>{confirmed}</td>"
            f"<td>{r['modules_held']}</td><td>{r['online_seconds'] / 3600:.2f}</td><td>{'online' if r['online'] else 'left'}</td>")  # fmt: skip


def contribution_section(status: dict, mine: str = "") -> str:
    """The leaderboard of contributions over the run and, for `mine` (?peer=), that volunteer's card."""
    rows = status.get("contributions") or []
    matching = [r for r in rows if mine and mine in r["peer_id"]]
    card = ""
    if mine and matching:
        r = matching[0]
        items = [("rank", f"#{r['rank']} of {len(rows)}"), ("tokens trained", f"{r['tokens']:,}"),
                 ("inner steps", f"{r['inner_steps']:,}"), ("rounds averaged with others", r["rounds_averaged"]),
                 ("of them confirmed by partners", r["rounds_confirmed"]), ("modules held", r["modules_held"]),
                 ("hours online", f"{r['online_seconds'] / 3600:.2f}")]  # fmt: skip
        cards = "".join(f'<div class="card">{escape(k)}<b>{escape(str(v))}</b></div>' for k, v in items)
        card = (f'<h3>Your contribution: <code>{escape(r["peer_id"])}</code></h3>'
                f'<div class="cards" id="my-contribution" data-peer="{escape(r["peer_id"])}">{cards}</div>')  # fmt: skip
    elif mine:
        card = f'<p id="my-contribution">no signed contribution record of a peer matching <code>{escape(mine)}</code> yet</p>'
    shown = rows[:MAX_LEADERBOARD_ROWS] + [r for r in matching if r["rank"] > MAX_LEADERBOARD_ROWS]
    trs = "".join(
        f'<tr data-contribution="{escape(r["peer_id"])}" data-tokens="{r["tokens"]}" data-steps="{r["inner_steps"]}" '
        f'data-rounds="{r["rounds_averaged"]}"{" class=mine" if r in matching else ""}><td>{r["rank"]}</td>'
        f"<td><code>{escape(r['peer_id'])}</code></td>{_contribution_cells(r)}</tr>"
        for r in shown
    )
    head = "".join(f"<th>{h}</th>" for h in ("#", "peer id", "tokens", "inner steps", "rounds averaged (claimed)",
                                              "confirmed by partners", "modules held", "hours online", "now"))  # fmt: skip
    rejected = sum((status.get("contributions_rejected") or {}).values())
    note = f' · <span class="bad">{rejected} record(s) refused: bad signature</span>' if rejected else ""
    return (f'{card}<table id="contribution"><thead><tr>{head}</tr></thead><tbody>{trs}</tbody></table>'
            f'<div class="sub">every number is signed by the peer that claims it; rounds are confirmed by '
            f"the partners' own records{note}</div>")  # fmt: skip


def render_page(status: dict, mine: str = "") -> str:
    """The whole page; `mine` (the ?peer= query) highlights one's own peer without script."""
    if status.get("peers") is None:
        return f"<!doctype html><html><head><meta charset='utf-8'><title>pathswarm</title></head><body><h1>pathswarm monitor</h1><p>{escape(status.get('message', 'waiting for the first poll'))}</p></body></html>"
    cards = [("peers", len(status["peers"])), ("training", status["by_state"].get("training", 0)),
             ("tokens/s (measured)", f"{status['tokens_per_second']:.0f}"), ("orphaned modules", len(status["orphaned"])),
             ("under-replicated", len(status["under_replicated"])), ("uncovered paths", len(status["uncovered_paths"])),
             ("bad parts", sum(status["bad_parts"].values())), ("claims refused", status["claims_refused"])]  # fmt: skip
    cards_html = "".join(
        f'<div class="card" id="card-{escape(k.replace(" ", "-").replace("/", "-"))}">{escape(k)}<b>{v}</b></div>'
        for k, v in cards
    )
    warn = ""
    if status["orphaned"]:
        warn = f'<p class="bad">orphaned (no confirmed training holder): {escape(", ".join(status["orphaned"]))}</p>'
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>pathswarm · {escape(status["run"])}</title>
<meta http-equiv="refresh" content="30"><style>{STYLE}</style></head><body>
<h1>pathswarm run <span id="run">{escape(status["run"])}</span></h1>
<div class="sub">run id <code>{escape(status["run_id"][:16])}</code> · updated {escape(status["updated"])} ·
 every number is what peers claim about themselves · <a href="/api/status">JSON</a></div>
<h2>Swarm</h2><div class="cards">{cards_html}</div>{warn}
<h2>Paths × modules (holders)</h2>{grid_table(status)}
<div class="sub">confirmed holders (the run creator's admission, once anyone has it): red none · amber one (one departure from losing it) · green 2+; "(n claimed)": holders counting those without admission</div>
<h2>Plan</h2>{plan_section(status)}
<h2>Contribution over the run</h2>{contribution_section(status, mine)}
<h2>Over time</h2>{charts(status)}
<h2>Peers</h2><form method="get">
<input id="peer-search" name="peer" placeholder="your peer id (or a part of it)" value="{escape(mine)}" oninput="findPeer()">
<span id="peer-found"></span></form>{peers_table(status, mine)}
<script>{SCRIPT}</script></body></html>"""
