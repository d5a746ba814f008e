"""One hostile peer among four: `python -m benchmarks.byzantine --out DIR`.

Four real peer processes (and a bootstrap node) on loopback train one path of a 1x1 grid together,
so all four hold every module and average every round. In each attacked run the fourth peer is
`benchmarks.byzantine_peer`, which forges what it offers: its outer gradient ×1000 (`scaled_x1000`),
×−10 (`sign_flip`), Gaussian noise of 10× its norm (`random`), or its reversed outer gradient with a
claimed token count 10⁶ times its own (`huge_weight`). Every attack runs twice: with the run's robust
aggregator (`centered_clip`, the default) and with the plain token-weighted mean (`--plain` runs,
DiLoCo's rule). The all-honest run uses the robust aggregator too, so the ratio isolates the attack.

The score is the eval loss of an honest peer's global copy on held-out documents of the built-in
corpus. Target: every robust run within 5% of the all-honest one. Writes DIR/byzantine.json,
DIR/byzantine.png and DIR/byzantine.md, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.byzantine_peer import ATTACKS, ENV_VAR  # noqa: E402
from benchmarks.local_runs import (  # noqa: E402
    add_run_args,
    final_eval_loss,
    make_manifest,
    peer_argv,
    write_run,
)
from peer.cli.local_swarm import LocalSwarm  # noqa: E402

RUN = "byzantine"
TOLERANCE = 1.05
PEERS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.byzantine", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    add_run_args(p)
    p.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated subset of the attacks")
    return p.parse_args(argv)


def run_swarm(args: argparse.Namespace, folder: Path, aggregator: str, attack: str | None) -> dict:
    """One training run of four peers (the last one hostile if `attack`); the honest p0's result."""
    manifest = make_manifest(args, RUN, aggregator=aggregator)
    run = write_run(manifest, folder)
    started = time.monotonic()
    with LocalSwarm(folder / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(folder / "manifest.json")])
        for i in range(PEERS):
            hostile = attack is not None and i == PEERS - 1
            swarm.start_peer(
                f"p{i}",
                peer_argv(args, run, folder / f"p{i}", "--wait_for_peers", str(PEERS)),
                env={ENV_VAR: attack} if hostile else None,
                module="benchmarks.byzantine_peer" if hostile else "peer",
            )
        for i in range(PEERS):
            code = swarm.wait(f"p{i}", timeout=args.run_timeout_seconds)
            if code != 0 and i < PEERS - 1:
                raise RuntimeError(f"honest peer p{i} exited {code}: {swarm.log_path(f'p{i}')}")
    loss, meta = final_eval_loss(args, manifest, folder / "p0")
    outcomes = [o for entry in meta.get("history", []) for o in entry["outcomes"].values()]
    return {
        "eval_loss": loss,
        "outer_round": meta["outer_round"],
        "rounds_averaged_by_4": sum(o == "averaged/4" for o in outcomes),
        "rounds": len(outcomes),
        "seconds": round(time.monotonic() - started, 1),
    }


def write_outputs(out: Path, report: dict) -> str:
    honest = report["honest"]["eval_loss"]
    rows = [
        "| attack | robust eval loss | ratio | plain eval loss | ratio | robust within 5% |",
        "|---|---|---|---|---|---|",
        f"| none (all honest) | {honest:.4f} | 1.000 | – | – | – |",
    ]
    for name, a in report["attacks"].items():
        r, p = a["robust_eval_loss"], a["plain_eval_loss"]
        ok = "yes" if r <= TOLERANCE * honest else "**no**"
        rows.append(f"| {name} | {r:.4f} | {r / honest:.3f} | {p:.4f} | {p / honest:.3f} | {ok} |")
    table = "\n".join(rows)
    (out / "byzantine.md").write_text(
        f"# One hostile peer of four\n\n{table}\n\nCommand: `{report['command']}`\n"
    )
    (out / "byzantine.json").write_text(json.dumps(report, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["attacks"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(names))
    robust = [report["attacks"][n]["robust_eval_loss"] for n in names]
    plain = [report["attacks"][n]["plain_eval_loss"] for n in names]
    ax.bar([x - 0.2 for x in xs], robust, 0.4, label="robust (centered_clip)")
    ax.bar([x + 0.2 for x in xs], plain, 0.4, label="plain mean")
    ax.axhline(honest, color="k", lw=1, label="all honest")
    ax.axhline(TOLERANCE * honest, color="k", lw=1, ls="--", label="+5%")
    ax.set_xticks(list(xs), names)
    ax.set_yscale("log")
    ax.set_ylabel("eval loss (nats/token, log scale)")
    ax.set_title("One hostile peer of four")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "byzantine.png", dpi=120)
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = set(attacks) - set(ATTACKS)
    if unknown:
        raise SystemExit(f"--attacks: unknown {sorted(unknown)}; choose from {', '.join(ATTACKS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "command": "python -m benchmarks.byzantine "
        + " ".join(argv if argv is not None else os.sys.argv[1:]),
        "peers": PEERS,
        "rounds": args.rounds,
        "inner_steps": args.inner_steps,
        "attacks": {},
    }
    print("all honest (robust aggregator) ...", flush=True)
    report["honest"] = run_swarm(args, args.out / "runs" / "honest", "centered_clip", None)
    print(f"  eval loss {report['honest']['eval_loss']:.4f} ({report['honest']['seconds']} s)", flush=True)
    for attack in attacks:
        entry = {}
        for label, aggregator in (("robust", "centered_clip"), ("plain", "mean")):
            print(f"{attack}, {label} ...", flush=True)
            result = run_swarm(args, args.out / "runs" / f"{attack}-{label}", aggregator, attack)
            entry[f"{label}_eval_loss"] = result["eval_loss"]
            entry[f"{label}_run"] = result
            print(f"  eval loss {result['eval_loss']:.4f} ({result['seconds']} s)", flush=True)
        report["attacks"][attack] = entry
    print(write_outputs(args.out, report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
