"""Join time of a late peer on a capped home line: `python -m benchmarks.join --out DIR` (needs root).

A volunteer's line is asymmetric: every emulated peer here has an uplink of `--up_mbit` (20) and
the joiner a downlink of `--down_mbit` (80), both capped with `tc tbf` in network namespaces
(benchmarks/wan/netlab.py). A single donor can then fill a quarter of the joiner's downlink at most,
which is why a joiner takes pieces of a module's state from every holder at once
(peer/sync/state_fetch.py).

One run: four donors train a ~20M-parameter path (one grid module of `--blocks` blocks of width
`--d_model`, plus the shared trunk) uncapped until each has synced its first round, then their
training threads are throttled to 1% of a core (so no round of theirs overlaps a measurement; they
keep serving) and the caps go on. A joiner then starts with 4 donors alive, is measured and leaves;
two donors leave and a second joiner starts; then one more leaves and a third joiner starts. For each:

* `join_seconds`: from the joiner's process start to its first inner step (its own log line: imports,
  DHT, manifest, probes, claim, the download, the checkpoint of what it downloaded, the first batch);
* `download_seconds`, `payload_megabytes`: the state downloads the joiner logs (θ̄ and momentum of
  every module of its path, 8 bytes per parameter);
* `wire_mbit`: bytes into the joiner's namespace (its veth counters) over the downloads' intervals
  (from its log), per second: payload plus TCP/IP and libp2p framing;
* `of_downlink`: wire rate over the joiner's downlink cap; `of_available`: over what the donors'
  uplinks and the downlink allow together, min(k · up, down).

Writes DIR/join.json, DIR/join.md and DIR/join.png, prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.wan.driver import REPO, child_env, start_bootstrap
from benchmarks.wan.netlab import NetLab, Sampler, can_limit_threads, can_make_namespaces
from peer.config import InnerOptimizerConfig, SyncConfig
from peer.data.sources import DatasetSpec
from peer.model.grid import ModelConfig
from peer.model.tokenizer import load_tokenizer
from peer.model.transformer import PathModel, count_parameters
from peer.run.create import build_manifest
from peer.run.record import save_record, sign_manifest

FIRST_STEP = re.compile(r"first inner step ([\d.]+) s after the peer started")
DOWNLOAD = re.compile(r"(\S+): state of ([\d.]+) MB from (\d+) donor\(s\) in ([\d.]+) s")
#: a training thread's quota once its first round is done: it still holds and serves its modules
IDLE_CORES = 0.01


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.join", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--up_mbit", type=float, default=20.0, help="every peer's uplink")
    p.add_argument("--down_mbit", type=float, default=80.0, help="the joiner's downlink")
    p.add_argument("--donors", default="4,2,1", help="donor counts, measured in this (decreasing) order")
    p.add_argument("--d_model", type=int, default=512)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--inner_steps", type=int, default=8, help="H: the donors' first round ends here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one phase may take")
    args = p.parse_args(argv)
    args.donors = [int(k) for k in args.donors.split(",")]
    if args.donors != sorted(args.donors, reverse=True) or args.donors[-1] < 1:
        p.error("--donors: decreasing counts of at least 1 (donors leave between measurements)")
    return args


def make_manifest(args: argparse.Namespace):
    model = ModelConfig(
        vocab_size=load_tokenizer("bytes").vocab_size,
        d_model=args.d_model,
        n_heads=max(1, args.d_model // 64),
        d_ff=4 * args.d_model,
        max_seq_len=65,
        n_levels=1,
        modules_per_level=1,
        blocks_per_module=args.blocks,
    )
    manifest = build_manifest(
        "join",
        model,
        DatasetSpec(kind="builtin", builtin_docs=400, seed=args.seed),
        seed=args.seed,
        seq_len=64,
        inner=InnerOptimizerConfig(warmup_steps=2, total_steps=10_000),
        sync=SyncConfig(
            inner_steps=args.inner_steps,
            codec="nf4",
            fragments=1,
            overlap_steps=0,
            averaging_timeout_seconds=120.0,
        ),
        router_docs=100,
    )
    with torch.device("meta"):
        n_params = count_parameters(PathModel(model, (0,)))
    return manifest, n_params


def wait_for(log: Path, pattern: re.Pattern, proc, timeout: float, count: int = 1) -> list[re.Match]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        found = list(pattern.finditer(text))
        if len(found) >= count:
            return found
        if proc.poll() is not None:
            raise RuntimeError(f"{log.name}: exited with {proc.returncode}:\n{text[-3000:]}")
        time.sleep(0.5)
    raise TimeoutError(f"{log.name}: no {pattern.pattern!r} within {timeout:.0f}s")


def wire_bytes(samples, host: int, start: float, end: float) -> float:
    """Bytes `host` received in [start, end], interpolated between the 0.2 s counter samples."""

    def at(t: float) -> float:
        for (t0, c0), (t1, c1) in zip(samples, samples[1:], strict=False):
            if t0 <= t <= t1:
                return c0[host][1] + (c1[host][1] - c0[host][1]) * (t - t0) / max(t1 - t0, 1e-9)
        raise ValueError(f"no counter samples around {t}")

    return at(end) - at(start)


def log_time(line: str) -> float:
    """The wall-clock time of a log line (logging writes local time, to the millisecond)."""
    stamp, millis = line[:23].split(",")
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


def run(args: argparse.Namespace) -> dict:
    manifest, n_params = make_manifest(args)
    out = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    record = sign_manifest(manifest, RSAPrivateKey())
    manifest_file = out / "manifest.json"
    save_record(record, manifest_file)
    n_donors = max(args.donors)
    env = child_env()
    results: dict[str, dict] = {}
    # host 0: bootstrap (holds the manifest), 1..n: donors, n+1: the joiners, one after another
    with NetLab(n_donors + 2) as lab:
        hub, donors_hosts, joiner_host = lab.hosts[0], lab.hosts[1 : n_donors + 1], lab.hosts[-1]
        _, initial_peers = start_bootstrap(lab, hub, manifest_file, out / "logs/bootstrap.log")
        common = ["--run", f"{manifest.name}@{record.run_id[:16]}", "--initial_peers", *initial_peers,
                  "--path", "0", "--batch_size", "1", "--torch_threads", "1",
                  "--checkpoint_every_rounds", "1000000"]  # fmt: skip
        donors = []
        for i, host in enumerate(donors_hosts):
            argv = [sys.executable, "-m", "peer", "peer", *common, "--host_maddrs", host.maddr(),
                    "--checkpoint_dir", str(args.work / f"donor{i}"),
                    "--wait_for_peers", str(n_donors)]  # fmt: skip
            donors.append(lab.spawn(host, argv, out / f"logs/donor{i}.log", env, cwd=REPO))
        print(
            f"{n_donors} donors train a {n_params / 1e6:.1f}M-parameter path to their first round", flush=True
        )
        for i, proc in enumerate(donors):
            wait_for(out / f"logs/donor{i}.log", re.compile(r"round 1 step"), proc, args.timeout)
            lab.limit_thread_cpu(donors_hosts[i], proc.pid, IDLE_CORES)
        for host in [*donors_hosts, joiner_host]:
            lab.set_cap(host, args.up_mbit)
        lab.set_ingress_cap(joiner_host, args.down_mbit)
        sampler = Sampler(lab)
        sampler.start()
        alive = n_donors
        try:
            for k in args.donors:
                lab.stop(donors[k:alive], grace_seconds=30)  # leave: their claims say so at once
                alive = k
                time.sleep(3.0)  # the leaving claims reach every node's view
                results[str(k)] = _measure_joiner(lab, joiner_host, common, out, k, args, sampler, env)
                print(f"  {k} donor(s): {_row(k, results[str(k)], args)}", flush=True)
        finally:
            sampler.stopped.set()
            sampler.join(timeout=5)
    return dict(
        parameters_per_path=n_params,
        state_megabytes=8 * n_params / 1e6,
        up_mbit=args.up_mbit,
        down_mbit=args.down_mbit,
        runs=results,
        machine=dict(platform=platform.platform(), cpus=os.cpu_count()),
        command=" ".join(["python -m benchmarks.join", *sys.argv[1:]]),
    )


def _measure_joiner(lab, host, common, out: Path, k: int, args, sampler: Sampler, env) -> dict:
    log = out / f"logs/joiner_{k}donors.log"
    argv = [sys.executable, "-m", "peer", "peer", *common, "--host_maddrs", host.maddr(),
            "--checkpoint_dir", str(args.work / f"joiner_{k}")]  # fmt: skip
    proc = lab.spawn(host, argv, log, env, cwd=REPO)
    try:
        first = wait_for(log, FIRST_STEP, proc, args.timeout)[0]
    finally:
        lab.stop([proc], grace_seconds=30)
    downloads = [(m, log_time(line)) for line in log.read_text().splitlines() if (m := DOWNLOAD.search(line))]
    megabytes = sum(float(m.group(2)) for m, _ in downloads)
    seconds = sum(float(m.group(4)) for m, _ in downloads)
    # the wire over exactly the downloads' intervals (a download's line is logged as it ends)
    received = sum(wire_bytes(sampler.samples, host.index, t - float(m.group(4)), t) for m, t in downloads)
    wire_mbit = 8 * received / seconds / 1e6 if seconds else 0.0
    available = min(k * args.up_mbit, args.down_mbit)
    return dict(
        join_seconds=float(first.group(1)),
        download_seconds=seconds,
        payload_megabytes=megabytes,
        payload_mbit=8 * megabytes / seconds if seconds else 0.0,
        donors_used=[int(m.group(3)) for m, _ in downloads],
        wire_megabytes=received / 1e6,
        wire_mbit=wire_mbit,
        of_downlink=wire_mbit / args.down_mbit,
        of_available=wire_mbit / available,
    )


def _row(k: int, r: dict, args) -> str:
    return (
        f"| {k} | {r['join_seconds']:.1f} | {r['download_seconds']:.1f} | {r['payload_megabytes']:.0f} | "
        f"{r['wire_mbit']:.1f} | {r['of_downlink']:.2f} | {min(k * args.up_mbit, args.down_mbit):.0f} | "
        f"{r['of_available']:.2f} |"
    )


def write_report(result: dict, args, out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    head = (
        f"Joiner of a {result['parameters_per_path'] / 1e6:.1f}M-parameter path "
        f"({result['state_megabytes']:.0f} MB of state), uplinks {args.up_mbit:.0f} Mbit/s, joiner's "
        f"downlink {args.down_mbit:.0f} Mbit/s\n\n"
        "| donors | join s (start to first step) | download s | payload MB | wire Mbit/s | of downlink "
        "| available Mbit/s | of available |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    table = head + "\n".join(_row(int(k), r, args) for k, r in runs.items()) + "\n"
    (out / "join.md").write_text(table)
    ks = [int(k) for k in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar([str(k) for k in ks], [runs[str(k)]["wire_mbit"] for k in ks], color="tab:blue", label="download")
    ax1.plot([str(k) for k in ks], [min(k * args.up_mbit, args.down_mbit) for k in ks], "k--o",
             label="available: min(k·up, down)")  # fmt: skip
    ax1.axhline(args.down_mbit, color="tab:red", lw=1, label=f"joiner's downlink cap ({args.down_mbit:.0f})")
    ax1.axhline(0.8 * args.down_mbit, color="tab:red", lw=1, ls=":", label="80% of the cap")
    ax1.set(xlabel="donors", ylabel="Mbit/s into the joiner", title="download rate")
    ax1.set_ylim(0, 1.5 * args.down_mbit)  # room for the legend above the bars
    ax1.legend(fontsize=8)
    ax2.bar([str(k) for k in ks], [runs[str(k)]["join_seconds"] for k in ks], color="tab:green",
            label="start to first inner step")  # fmt: skip
    ax2.bar([str(k) for k in ks], [runs[str(k)]["download_seconds"] for k in ks], color="tab:orange",
            label="of which downloading")  # fmt: skip
    ax2.set(xlabel="donors", ylabel="seconds", title="join time")
    ax2.set_ylim(0, 1.3 * max(r["join_seconds"] for r in runs.values()))
    ax2.legend(fontsize=8)
    fig.suptitle(head.splitlines()[0], fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "join.png", dpi=120)
    return table


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # the lab's namespaces and processes go on any exit
    ok, why = can_make_namespaces(install=True)
    if not ok or not can_limit_threads():
        print(f"join benchmark skipped: {why or 'no cgroup v1 cpu controller to throttle the donors'}")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # checkpoints (hundreds of MB each) go to a scratch folder that is removed; logs stay in --out
    with tempfile.TemporaryDirectory(prefix="pathswarm-join-") as work:
        args.work = Path(work)
        result = run(args)
    result["wall_seconds"] = time.monotonic() - started
    (args.out / "join.json").write_text(json.dumps(result, indent=2))
    print(write_report(result, args, args.out))
    print(f"wrote {args.out}/join.json, join.md, join.png in {result['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
