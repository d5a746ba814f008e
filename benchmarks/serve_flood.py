"""What a flood of state requests costs the holder asked: its training under strangers' downloads.

A real open run: `pathswarm bootstrap` serving the manifest and one admitted `pathswarm peer`, the
holder, training a 1x1 grid on the built-in corpus (benchmarks/local_runs.py) on one torch thread.
After a window of training alone, an asker process (benchmarks/serve_flood_asker.py: `--askers`
fresh keys, each a DHT node of its own with `--requests_at_once` downloads going, started and idle
before the first window, at the machine's lowest CPU priority as in `benchmarks.claims_scale`) asks
the holder for its whole trunk state again and again for a window; then the holder trains alone for
a window as long again.

Three arms: `limited`, the holder with its default serve limits (`dht/serve_limits.py`: 32 MB/s and
8 uploads in all, 16 MB/s and 4 uploads per asker, half of both for peers without standing);
`unlimited`, every limit raised out of reach (what a holder without them uploads); `refused`, the
default limits and requests that name another run, each refused before any other check (what
answering alone costs). Reported per arm:
the holder's tokens/s in the three windows (from its round history), `holder_tokens_ratio` (flood
window over the one before; `_both_ends`: over the mean of before and after), the cores its process
tree used, and what the askers got: megabytes per second over the flood window, whole states,
refusals by reason.

`python -m benchmarks.serve_flood --out DIR` (about 7 minutes) writes DIR/serve_flood.json, .md, .png.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import ExitStack
from pathlib import Path

from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.claims_scale_flood import _attacker_in_background, _cores, _cpu_snapshot, _rates_summary
from benchmarks.goodput import histories, tokens_at
from benchmarks.local_runs import make_manifest, peer_argv
from dht.identity import load_identity, peer_id_of_key
from peer.cli.local_swarm import LocalSwarm
from peer.config import AdmissionConfig
from peer.run.admission import sign_admission
from peer.run.record import save_record, sign_manifest

#: one holder training alone: its run takes one of this machine's two cores (its training thread), which
#: leaves the other to the askers and the holder's daemon; with a second peer training, the askers got
#: only the machine's idle moments (0.1 core: 6-8 MB/s, under even the strangers' share of the limits)
PEERS = ("p0",)
HOLDER = "p0"
#: every serve limit out of reach: the peer uploads whatever it is asked as fast as it can
UNLIMITED = ["--serve_megabytes_per_second", "1e6", "--serve_uploads_at_once", "10000",
             "--serve_megabytes_per_second_per_peer", "1e6", "--serve_uploads_at_once_per_peer", "10000",
             "--serve_stranger_share", "1"]  # fmt: skip
#: arm -> (the holder's serve flags, the askers' extra flags)
ARMS = {"limited": ([], []), "unlimited": (UNLIMITED, []), "refused": ([], ["--other_run"])}


def _run_args(args: argparse.Namespace) -> argparse.Namespace:
    """A run long enough to outlast the windows (its peers are stopped after them); rounds of
    `run_inner_steps` so that the 200 rounds a checkpoint's history keeps cover all three windows."""
    return argparse.Namespace(
        rounds=10_000, inner_steps=args.run_inner_steps, d_model=args.d_model, batch_size=8, builtin_docs=1500
    )


def _wait_for_training(swarm: LocalSwarm, folder: Path, timeout: float) -> None:
    """Until every peer has checkpointed a round (so its history exists)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not all(swarm.alive(n) for n in PEERS):
            break
        if all(any((folder / n).glob("ckpt-*")) for n in PEERS):
            return
        time.sleep(1.0)
    raise RuntimeError(f"the run did not start training; logs in {folder / 'logs'}")


def _wait_for_line(swarm: LocalSwarm, name: str, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in swarm.log_path(name).read_text(errors="replace"):
            return
        if not swarm.alive(name):
            break
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not say {text!r}: {swarm.log_path(name).read_text()[-2000:]}")


def _wait_for_round_after(folder: Path, wall: float, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if all(h[-1]["time"] > wall for h, _ in histories(folder, list(PEERS)).values()):
                return
        except (RuntimeError, KeyError, IndexError, OSError):  # a checkpoint being written
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the peers' checkpoints did not reach past the last window ({folder / 'logs'})")


def measure_arm(args: argparse.Namespace, folder: Path, arm: str) -> dict:
    creator, run_args = RSAPrivateKey(), _run_args(args)
    manifest = make_manifest(run_args, "serveflood", admission=AdmissionConfig(mode="open"))
    record = sign_manifest(manifest, creator)
    folder.mkdir(parents=True, exist_ok=True)
    save_record(record, folder / "manifest.json")
    run, run_id = f"{manifest.name}@{record.run_id[:16]}", record.run_id
    go_file, asked = folder / "go", folder / "askers.json"
    window = args.window_seconds
    with LocalSwarm(folder / "logs") as swarm, ExitStack() as background:
        swarm.start_bootstrap(extra=["--manifest_path", str(folder / "manifest.json")])
        ids = {}
        for name in PEERS:
            key, key_file = load_identity(folder / f"{name}.key")
            ids[name] = peer_id_of_key(key)
            token = sign_admission(creator, run_id, ids[name], "invite")
            extra = ["--identity_path", str(key_file), "--admission", token, "--wait_for_peers", "1",
                     *ARMS[arm][0]]  # fmt: skip
            swarm.start_peer(name, peer_argv(run_args, run, folder / name, *extra))
        _wait_for_training(swarm, folder, args.run_start_timeout_seconds)
        asker = swarm.spawn(
            "asker",
            ["--initial_peers", *swarm.initial_peers, "--manifest_path", str(folder / "manifest.json"),
             "--holder", ids[HOLDER], "--askers", str(args.askers), "--requests_at_once",
             str(args.requests_at_once), "--go_file", str(go_file), "--seconds", str(window),
             "--out", str(asked), *ARMS[arm][1]],
            module="benchmarks.serve_flood_asker",
        )  # fmt: skip
        _wait_for_line(swarm, "asker", "askers ready", 120.0)
        priority = background.enter_context(_attacker_in_background([asker.pid]))
        # cores used in each window: the holder's process tree (its DHT process and p2p daemon are
        # children), the bootstrap's, the askers'
        groups = {"holder": [swarm.procs[HOLDER].pid], "bootstrap": [swarm.procs["bootstrap"].pid],
                  "askers": [asker.pid]}  # fmt: skip
        time.sleep(args.warmup_seconds)
        cpu, walls = [_cpu_snapshot(groups)], [time.time()]
        time.sleep(window)
        go_file.touch()  # the askers start
        cpu.append(_cpu_snapshot(groups))
        walls.append(time.time())
        time.sleep(window)
        cpu.append(_cpu_snapshot(groups))
        walls.append(time.time())
        time.sleep(window)  # the run alone again: its own drift shows in before against after
        walls.append(time.time())
        swarm.wait("asker", 3 * window)
        _wait_for_round_after(folder, walls[-1], 60.0)  # each history reaches past the last window
        alive = all(swarm.alive(n) for n in PEERS)
    found = histories(folder, list(PEERS))
    spans = list(zip(walls, walls[1:], strict=False))

    def rates(names) -> list[float]:
        return [
            sum(tokens_at(found[n][0], b) - tokens_at(found[n][0], a) for n in names) / (b - a)
            for a, b in spans
        ]

    holder = _rates_summary(*rates([HOLDER]))
    got = json.loads(asked.read_text())
    received = sum(n for s, n in got["bytes_by_second"].items() if walls[1] <= int(s) + 0.5 <= walls[2])
    return {
        "arm": arm, "serve_flags": ARMS[arm][0], "asker_flags": ARMS[arm][1], "run": run,
        "peers_alive_after": alive,
        "holder": holder, "holder_tokens_ratio": holder["run_tokens_ratio"],
        "holder_tokens_ratio_both_ends": holder["run_tokens_ratio_both_ends"],
        "askers": got["askers"], "requests_at_once": got["requests_at_once"],
        "state_bytes": got["state_bytes"],
        "askers_megabytes_per_second": round(received / window / 1e6, 2),
        "states_served": sum(got["states_by_second"].values()),
        # answered (a state or a refusal) per second of asking: what the holder's handler was made to do
        "requests_per_second": round(
            (sum(got["states_by_second"].values()) + sum(got["refused"].values())) / window, 1
        ),
        "refused": got["refused"], "failed": got["failed"],
        "cores_before": _cores(cpu[0], cpu[1], groups), "cores_during": _cores(cpu[1], cpu[2], groups),
        "attacker_priority": priority, "window_seconds": window,
        "bytes_by_second": got["bytes_by_second"], "walls": walls,
        "holder_rounds": _round_series(found[HOLDER][0], walls),
    }  # fmt: skip


def _round_series(history: list[dict], walls: list[float]) -> list[list[float]]:
    """[seconds from the first window's start, tokens trained] at each of the holder's round ends
    inside the windows: its tokens/s over time in the figure."""
    return [
        [round(h["time"] - walls[0], 2), h["tokens_total"]]
        for h in history
        if walls[0] <= h["time"] <= walls[-1]
    ]


def write_report(out: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        "| arm | holder tokens/s before / during / after | holder ratio (both ends) | askers got | states "
        "| refused | answers/s | holder's cores before / during | askers' cores during |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for arm, r in result["arms"].items():
        h = r["holder"]
        rows.append(
            f"| {arm} | {h['tokens_per_second_before']:,.0f} / {h['tokens_per_second_during']:,.0f} / "
            f"{h['tokens_per_second_after']:,.0f} "
            f"| {h['run_tokens_ratio']} ({h['run_tokens_ratio_both_ends']}) "
            f"| {r['askers_megabytes_per_second']} MB/s | {r['states_served']} "
            f"| {sum(r['refused'].values())} | {r['requests_per_second']} "
            f"| {r['cores_before']['holder']} / {r['cores_during']['holder']} "
            f"| {r['cores_during']['askers']} |"
        )
        t0 = r["walls"][0]
        xs = sorted(int(s) for s in r["bytes_by_second"])
        top.plot([x - t0 for x in xs], [r["bytes_by_second"][str(x)] / 1e6 for x in xs], label=arm)
        rounds = r.get("holder_rounds", [])
        pairs = list(zip(rounds, rounds[5:], strict=False))  # over 5 rounds: a few seconds
        bottom.plot(
            [b[0] for a, b in pairs],
            [(b[1] - a[1]) / max(1e-9, b[0] - a[0]) / 1e3 for a, b in pairs],
            label=arm,
        )
    for ax in (top, bottom):
        ax.axvspan(result["window_seconds"], 2 * result["window_seconds"], color="0.9")
        ax.legend(title="shaded: the flood window", fontsize=8)
    top.set_ylabel("MB/s uploaded to the askers")
    bottom.set_ylabel("holder's tokens/s (k), over 5 rounds")
    bottom.set_xlabel("seconds from the start of the window before the flood")
    fig.tight_layout()
    fig.savefig(out / "serve_flood.png", dpi=120)
    text = [
        f"# serve_flood ({result['askers']} askers, {result['requests_at_once']} downloads each)",
        "",
        *rows,
        "",
        "Holder: the peer asked, training alone on one torch thread. Ratio: the flood window's tokens/s "
        "over the window before (in brackets, over the mean of before and after).",
    ]
    (out / "serve_flood.md").write_text("\n".join(text) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--askers", type=int, default=4, help="fresh keys asking")
    p.add_argument("--requests_at_once", type=int, default=2, help="downloads each asker keeps going")
    p.add_argument("--window_seconds", type=float, default=45.0, help="before, during and after, each")
    p.add_argument("--warmup_seconds", type=float, default=15.0)
    p.add_argument("--run_inner_steps", type=int, default=100, help="the live run's H")
    p.add_argument("--d_model", type=int, default=64)
    p.add_argument("--run_start_timeout_seconds", type=float, default=240.0)
    p.add_argument(
        "--report_only", action="store_true", help="redraw DIR's report from its JSON and checkpoints"
    )
    args = p.parse_args()
    if args.report_only:
        result = json.loads((args.out / "serve_flood.json").read_text())
        for arm, r in result["arms"].items():  # the series, for outputs written before they were kept
            r.setdefault(
                "holder_rounds", _round_series(histories(args.out / arm, [HOLDER])[HOLDER][0], r["walls"])
            )
        (args.out / "serve_flood.json").write_text(json.dumps(result, indent=1))
        write_report(args.out, result)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"askers": args.askers, "requests_at_once": args.requests_at_once,
              "window_seconds": args.window_seconds, "arms": {}}  # fmt: skip
    for arm in args.arms:
        print(f"{arm}: starting", flush=True)
        result["arms"][arm] = measure_arm(args, args.out / arm, arm)
        r = result["arms"][arm]
        print(
            f"{arm}: holder ratio {r['holder_tokens_ratio']}, askers {r['askers_megabytes_per_second']} MB/s",
            flush=True,
        )
        (args.out / "serve_flood.json").write_text(json.dumps(result, indent=1))
    write_report(args.out, result)
    print((args.out / "serve_flood.md").read_text())


if __name__ == "__main__":
    main()
