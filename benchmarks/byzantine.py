"""Hostile peers in a real training run: `python -m benchmarks.byzantine --out DIR [--suite S]`.

Every run is a real swarm on loopback: the creator's bootstrap node (the run's authority and a
keeper), four honest peers admitted by the creator (the fourth joins a third of the way in, so every
run has a join and its state download), and the attackers of `benchmarks.byzantine_peer`, all on one
path of a 1x1 grid, so that every peer holds every module and averages every round.

* `delta` suite: today's four attacks (×1000, sign flip, noise, huge weight) by one admitted peer,
  with the run's robust aggregator (`centered_clip`) and with the plain mean;
* `inbound` suite: attacks that stay inside the caps (`alie`, `ipm`, `drift`), each under
  CenteredClip, the coordinate median, the trimmed mean and the plain mean; `collusion`: the same
  arms against `colluding_pair`, two admitted colluders;
* `protocol` suite: fresh keys (no admission, on probation in an open run) attacking agreement,
  catch-up, repair, joins and keepers (`report_veto`, `stale_takeover`, `sybil_repair`,
  `keeper_poison`), and `two_holder`: a fresh key beside a lone honest holder, against that holder
  alone.

The score of a run is the worst eval loss (held-out documents of the built-in corpus) of the honest
peers' final global copies, and, beside it, that of the state the keeper kept. Target: every robust
run within 5% of the all-honest run's (`robust_eval_loss / honest.eval_loss ≤ 1.05`). The all-honest
run uses the robust aggregator, at the start and again at the end of the benchmark. Writes
DIR/byzantine.json, DIR/byzantine.png and DIR/byzantine.md, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.byzantine_peer import (  # noqa: E402
    ATTACKERS,
    COLLUDERS_VAR,
    DELTA_ATTACKS,
    ENV_VAR,
    INBOUND_ATTACKS,
    PROTOCOL_ATTACKS,
)
from benchmarks.local_runs import add_run_args, final_eval_loss, kept_eval_loss, make_manifest  # noqa: E402
from dht.identity import load_identity  # noqa: E402
from peer.cli.local_swarm import LocalSwarm  # noqa: E402
from peer.config import AdmissionConfig  # noqa: E402
from peer.run.admission import sign_admission  # noqa: E402
from peer.run.record import save_record, sign_manifest  # noqa: E402

RUN = "byzantine"
TOLERANCE = 1.05
HONEST = 4
FOUR_ARMS = ("centered_clip", "median", "trimmed_mean", "mean")
ARMS = {"delta": ("centered_clip", "mean"), "inbound": FOUR_ARMS, "collusion": FOUR_ARMS}
#: every suite fits the 15 minutes a benchmark may take on 2 cores; all of them at once would not
SUITES = {
    "delta": DELTA_ATTACKS,
    "inbound": tuple(a for a in INBOUND_ATTACKS if a != "colluding_pair"),
    "collusion": ("colluding_pair",),
    "protocol": PROTOCOL_ATTACKS,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.byzantine", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    add_run_args(p)
    p.add_argument("--suite", default="all", choices=["all", *SUITES], help="which attacks (default: all)")
    p.add_argument("--attacks", default="", help="comma-separated subset of the suite's attacks")
    return p.parse_args(argv)


def _identity(folder: Path, name: str):
    key, path = load_identity(folder / f"{name}.id")
    return key, path


def _wait_round(swarm: LocalSwarm, name: str, at: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if f"round {at} step" in swarm.log_path(name).read_text():
            return
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not reach round {at} in {timeout:.0f} s")


def run_swarm(
    args: argparse.Namespace, folder: Path, aggregator: str, attack: str | None, honest: int = HONEST
):
    """One training run (honest peers, then the attackers of `attack`); the honest peers' result."""
    folder.mkdir(parents=True, exist_ok=True)
    creator, creator_file = _identity(folder, "creator")
    manifest = make_manifest(args, RUN, aggregator=aggregator, admission=AdmissionConfig(mode="open"))
    record = sign_manifest(manifest, creator)
    save_record(record, folder / "manifest.json")
    run = f"{RUN}@{record.run_id[:16]}"
    inside = attack in DELTA_ATTACKS + INBOUND_ATTACKS  # admitted colluders; the others are fresh keys
    attackers = ATTACKERS.get(attack, 1) if attack else 0
    late = honest - 1 if honest > 1 else None
    started = time.monotonic()
    with LocalSwarm(folder / "logs") as swarm:
        bootstrap = ["--manifest_path", str(folder / "manifest.json"), "--identity_path", str(creator_file),
                     "--keep_state", str(folder / "keep"), "--keep_every_seconds", "5"]  # fmt: skip
        swarm.start_bootstrap(extra=bootstrap)
        first = [f"p{i}" for i in range(honest) if i != late] + [f"a{i}" for i in range(attackers)]

        def start(name: str, *extra: str) -> None:
            key, path = _identity(folder, name)
            hostile = name.startswith("a")
            argv = ["--identity_path", str(path), *extra]
            if not hostile or inside:
                argv += ["--admission", sign_admission(creator, record.run_id, str(_peer_id(key)), "invite")]
            env = {ENV_VAR: attack, COLLUDERS_VAR: str(attackers)} if hostile else None
            module = "benchmarks.byzantine_peer" if hostile else "peer"
            swarm.start_peer(name, _peer_argv(args, run, folder / name, *argv), env=env, module=module)

        for name in first:
            start(name, "--wait_for_peers", str(len(first)), "--max_rounds", str(args.rounds))
        if late is not None:
            joined_at = max(1, args.rounds // 3)
            _wait_round(swarm, "p0", joined_at, args.run_timeout_seconds)
            start(f"p{late}", "--max_rounds", str(args.rounds - joined_at))
        for i in range(honest):
            code = swarm.wait(f"p{i}", timeout=args.run_timeout_seconds)
            if code != 0:
                raise RuntimeError(f"honest peer p{i} exited {code}: {swarm.log_path(f'p{i}')}")
    losses, outcomes = {}, []
    for i in range(honest):
        losses[f"p{i}"], meta = final_eval_loss(args, manifest, folder / f"p{i}")
        outcomes += [o for entry in meta.get("history", []) for o in entry["outcomes"].values()]
    return {
        "eval_loss": max(losses.values()),
        "eval_loss_by_peer": losses,
        "kept_eval_loss": kept_eval_loss(args, manifest, folder / "keep"),
        "rounds_averaged": sum(o.startswith("averaged") for o in outcomes),
        "rounds": len(outcomes),
        "seconds": round(time.monotonic() - started, 1),
    }


def _peer_id(key) -> str:
    from dht.identity import peer_id_of_key

    return peer_id_of_key(key)


def _peer_argv(args: argparse.Namespace, run: str, checkpoint_dir: Path, *extra: str) -> list[str]:
    return ["--run", run, "--checkpoint_dir", str(checkpoint_dir), "--torch_threads", "1",
            "--batch_size", str(args.batch_size), "--heartbeat_seconds", "1", *extra]  # fmt: skip


def _plan(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(attack, arm label, aggregator) of every attacked run."""
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    wanted = {a for a in args.attacks.split(",") if a}
    unknown = wanted - {a for s in suites for a in SUITES[s]}
    if unknown:
        raise SystemExit(f"--attacks: {sorted(unknown)} not in the {args.suite} suite")
    plan = []
    for suite in suites:
        for attack in SUITES[suite]:
            if wanted and attack not in wanted:
                continue
            for aggregator in ARMS.get(suite, ("centered_clip",)):
                plan.append((attack, aggregator))
    return plan


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = _plan(args)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "command": "python -m benchmarks.byzantine " + " ".join(argv if argv is not None else sys.argv[1:]),
        "honest_peers": HONEST, "rounds": args.rounds, "inner_steps": args.inner_steps, "attacks": {},
    }  # fmt: skip
    started = time.monotonic()

    def honest_run(label: str, peers: int = HONEST) -> dict:
        print(f"all honest ({label}) ...", flush=True)
        result = run_swarm(args, args.out / "runs" / label, "centered_clip", None, honest=peers)
        print(f"  eval loss {result['eval_loss']:.4f} ({result['seconds']} s)", flush=True)
        return result

    report["honest_start"] = honest_run("honest-start")
    if any(a == "two_holder" for a, _ in plan):
        report["honest_alone"] = honest_run("honest-alone", peers=1)
    for attack, aggregator in plan:
        print(f"{attack}, {aggregator} ...", flush=True)
        peers = 1 if attack == "two_holder" else HONEST
        result = run_swarm(
            args, args.out / "runs" / f"{attack}-{aggregator}", aggregator, attack, honest=peers
        )
        report["attacks"].setdefault(attack, {})[aggregator] = result
        print(f"  eval loss {result['eval_loss']:.4f}, kept {result['kept_eval_loss']:.4f} "
              f"({result['seconds']} s)", flush=True)  # fmt: skip
    report["honest_end"] = honest_run("honest-end")
    report["honest"] = {
        "eval_loss": (report["honest_start"]["eval_loss"] + report["honest_end"]["eval_loss"]) / 2
    }
    report["seconds"] = round(time.monotonic() - started, 1)
    print(write_outputs(args.out, report))
    return 0


def _baseline(report: dict, attack: str) -> float:
    return report["honest_alone"]["eval_loss"] if attack == "two_holder" else report["honest"]["eval_loss"]


def write_outputs(out: Path, report: dict) -> str:
    rows = [
        "| attack | aggregator | eval loss (worst honest peer) | ratio | keeper's copy | within 5% |",
        "|---|---|---:|---:|---:|---|",
    ]
    start, end = report["honest_start"]["eval_loss"], report["honest_end"]["eval_loss"]
    rows.append(
        f"| none (all honest, start / end) | centered_clip | {start:.4f} / {end:.4f} | 1.000 | – | – |"
    )
    for attack, arms in report["attacks"].items():
        base = _baseline(report, attack)
        for aggregator, r in arms.items():
            ratio = r["eval_loss"] / base
            r["ratio"] = ratio
            robust = aggregator != "mean"
            verdict = ("yes" if ratio <= TOLERANCE else "**no**") if robust else "(plain mean)"
            kept = r["kept_eval_loss"]
            rows.append(f"| {attack} | {aggregator} | {r['eval_loss']:.4f} | {ratio:.3f} | "
                        f"{kept:.4f} | {verdict} |")  # fmt: skip
        robust_losses = [r["eval_loss"] for a, r in arms.items() if a != "mean"]
        arms_summary = {"robust_eval_loss": max(robust_losses), "honest_eval_loss": base}
        report["attacks"][attack] = {**arms, **arms_summary}
    table = "\n".join(rows)
    (out / "byzantine.md").write_text(
        f"# Hostile peers in a real run\n\n{table}\n\nCommand: `{report['command']}`\n"
    )
    (out / "byzantine.json").write_text(json.dumps(report, indent=2))
    _plot(out, report)
    return table


def _plot(out: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, colors = [], [], []
    for attack, arms in report["attacks"].items():
        for aggregator, r in arms.items():
            if isinstance(r, dict):
                labels.append(f"{attack}\n{aggregator}")
                values.append(min(r["ratio"], 100.0))
                colors.append("tab:gray" if aggregator == "mean" else "tab:blue")
    fig, ax = plt.subplots(figsize=(max(7, 0.45 * len(labels)), 4))
    ax.bar(range(len(labels)), values, color=colors)
    ax.axhline(1.0, color="k", lw=1)
    ax.axhline(TOLERANCE, color="k", lw=1, ls="--", label="+5% (the target)")
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("eval loss / honest run's (log; capped at 100)")
    ax.set_title("Hostile peers in a real run: robust arms (blue), plain mean (gray)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "byzantine.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
