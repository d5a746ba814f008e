"""What pathswarm costs a volunteer: `python -m benchmarks.overhead --out DIR`.

The same path model (path 0 of a 4x4 grid), data pipeline, batch and inner optimizer, trained for the
same steps, side by side in one run:

* **plain**: a bare PyTorch loop in a process of its own (`PathBatches` -> `inner_step`), nothing else;
* **peer**: one `pathswarm peer` alone in a new swarm: its DHT process and p2pd daemon, heartbeat,
  metrics server, checkpoints, the sync layer and an outer step every H inner steps.

Throughput is measured from step 2H on (after start-up, data loading and the first outer round) to the
last step, from the peer's own log lines ("round R step S") and the plain loop's clock at the same
steps. Memory: the peak RSS of every process of the peer's tree, sampled every 0.2 s with psutil,
named by role (main, DHT process, p2pd), against the plain loop's peak. CPU: the seconds every process
of each side used in all, so the difference is what the framework spends outside the inner loop.

Writes DIR/overhead.json, DIR/overhead.md and DIR/overhead.png.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import psutil
from hivemind.utils.crypto import RSAPrivateKey

from peer.config import InnerOptimizerConfig, SyncConfig
from peer.data.sources import DatasetSpec
from peer.model.grid import ModelConfig
from peer.run.create import build_manifest
from peer.run.record import save_record, sign_manifest

RUN = "overhead"
REPO = Path(__file__).resolve().parent.parent
#: the peer's round lines: "2026-11-23 22:30:13,810 INFO peer.training.peer: round 5 step 250 loss …"
ROUND_LINE = re.compile(r"^(\S+ \S+) INFO peer\.training\.peer: round \d+ step (\d+) loss", re.M)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=1500, help="inner steps each side trains")
    p.add_argument("--inner_steps", type=int, default=50, help="H: inner steps per outer round")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--torch_threads", type=int, default=1)
    p.add_argument("--grid", default="4x4")
    p.add_argument("--plain_worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_run(args: argparse.Namespace, folder: Path) -> Path:
    levels, k = (int(x) for x in args.grid.split("x"))
    router_docs = max(400, 8 * k**levels)  # the router wants several documents per path
    manifest = build_manifest(
        RUN,
        ModelConfig(n_levels=levels, modules_per_level=k, max_seq_len=max(64, args.seq_len + 1)),
        DatasetSpec(kind="builtin", builtin_docs=3 * router_docs),
        seq_len=args.seq_len,
        inner=InnerOptimizerConfig(total_steps=args.steps),
        sync=SyncConfig(inner_steps=args.inner_steps),
        router_docs=router_docs,
    )
    path = folder / "manifest.json"
    save_record(sign_manifest(manifest, RSAPrivateKey()), path)
    return path


# --- the plain loop (run in a process of its own) -------------------------------------------------


def plain_worker(args: argparse.Namespace) -> None:
    """Trains path 0 with nothing but PyTorch and the shared data pipeline; prints one JSON line."""
    import torch

    from peer.data.batches import PathBatches
    from peer.data.sources import load_documents
    from peer.model.grid import path_from_index
    from peer.model.transformer import PathModel
    from peer.run.rebuild import check_tokenizer, make_route
    from peer.run.record import load_verified_manifest
    from peer.training.inner import inner_step, make_inner_optimizer

    torch.set_num_threads(args.torch_threads)
    m, _ = load_verified_manifest(args.plain_worker)
    started = time.perf_counter()
    model = PathModel(m.model, path_from_index(m.model, 0), seed=m.seed)
    optimizer = make_inner_optimizer(model, m.inner)
    batches = PathBatches(load_documents(m.dataset), make_route(m), 0, check_tokenizer(m), m.seq_len,
                          args.batch_size, eval_fraction=m.dataset.eval_fraction)  # fmt: skip
    marks = {}
    for step in range(args.steps):
        inner_step(model, optimizer, next(batches), m.inner, step)
        if (step + 1) % args.inner_steps == 0:
            marks[step + 1] = time.perf_counter()
    me = psutil.Process()
    cpu = me.cpu_times()
    rss_peak = _peak_rss_self()
    print(json.dumps(dict(marks=marks, wall_seconds=time.perf_counter() - started,
                          cpu_seconds=cpu.user + cpu.system, rss_peak_bytes=rss_peak)))  # fmt: skip


def _peak_rss_self() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def run_plain(args: argparse.Namespace, manifest: Path) -> dict:
    command = [sys.executable, "-m", "benchmarks.overhead", "--out", str(args.out), "--plain_worker",
               str(manifest), "--steps", str(args.steps), "--inner_steps", str(args.inner_steps),
               "--batch_size", str(args.batch_size), "--torch_threads", str(args.torch_threads)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"the plain loop failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the peer -------------------------------------------------------------------------------------


def _role(proc: psutil.Process, root: int) -> str:
    try:
        if proc.pid == root:
            return "peer main process"
        name = proc.name()
    except psutil.Error:
        return "gone"
    return "p2pd daemon" if "p2pd" in name else "peer child process (hivemind DHT)"


def run_peer(args: argparse.Namespace, manifest: Path, folder: Path) -> dict:
    log = folder / "peer.log"
    command = [sys.executable, "-m", "peer", "peer", "--new_swarm", "--manifest_path", str(manifest),
               "--run", RUN, "--path", "0", "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
               "--checkpoint_dir", str(folder / "ckpt"), "--max_steps", str(args.steps),
               "--batch_size", str(args.batch_size), "--torch_threads", str(args.torch_threads),
               "--metrics_port", "0"]  # fmt: skip
    peaks: dict[int, tuple[str, int]] = {}
    # USS: the memory only this process holds; the forked DHT process shares the main process's pages
    # (torch included) until either writes them, which RSS counts twice
    uss_peaks: dict[int, tuple[str, int]] = {}
    cpu: dict[int, float] = {}
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    root = psutil.Process(proc.pid)
    try:
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in tree:
                try:
                    mem, times = p.memory_full_info(), p.cpu_times()
                except psutil.Error:
                    continue
                role = _role(p, proc.pid)
                peaks[p.pid] = (role, max(mem.rss, peaks.get(p.pid, (role, 0))[1]))
                uss_peaks[p.pid] = (role, max(mem.uss, uss_peaks.get(p.pid, (role, 0))[1]))
                cpu[p.pid] = times.user + times.system
            time.sleep(0.2)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    if code != 0:
        raise SystemExit(f"the peer exited {code}:\n{text[-3000:]}")
    marks = {int(step): _timestamp(ts) for ts, step in ROUND_LINE.findall(text)}
    by_role: dict[str, int] = {}
    for role, rss in peaks.values():
        by_role[role] = by_role.get(role, 0) + rss
    uss_by_role: dict[str, int] = {}
    for role, uss in uss_peaks.values():
        uss_by_role[role] = uss_by_role.get(role, 0) + uss
    return dict(marks=marks, rss_peak_bytes_by_role=by_role, rss_peak_bytes=sum(by_role.values()),
                uss_peak_bytes_by_role=uss_by_role, cpu_seconds=sum(cpu.values()),
                processes=len(peaks))  # fmt: skip


def _timestamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


# --- the comparison -------------------------------------------------------------------------------


def tokens_per_second(marks: dict, first: int, last: int, tokens_per_step: int) -> float:
    marks = {int(k): float(v) for k, v in marks.items()}
    if first not in marks or last not in marks:
        raise SystemExit(f"steps {first} and {last} not both measured (have {sorted(marks)})")
    return (last - first) * tokens_per_step / (marks[last] - marks[first])


def compare(args: argparse.Namespace, plain: dict, peer: dict) -> dict:
    first, last = 2 * args.inner_steps, args.steps - args.steps % args.inner_steps
    tokens = args.batch_size * args.seq_len
    plain_tps = tokens_per_second(plain["marks"], first, last, tokens)
    peer_tps = tokens_per_second(peer["marks"], first, last, tokens)
    return dict(
        grid=args.grid, steps=args.steps, inner_steps=args.inner_steps, batch_size=args.batch_size,
        seq_len=args.seq_len, torch_threads=args.torch_threads, measured_steps=[first, last],
        plain_tokens_per_second=plain_tps, peer_tokens_per_second=peer_tps,
        tokens_per_second_ratio=peer_tps / plain_tps,
        plain_rss_bytes=plain["rss_peak_bytes"], rss_bytes=peer["rss_peak_bytes_by_role"],
        uss_bytes=peer["uss_peak_bytes_by_role"],
        peer_rss_bytes_total=peer["rss_peak_bytes"],
        rss_over_plain_bytes=peer["rss_peak_bytes"] - plain["rss_peak_bytes"],
        plain_cpu_seconds=plain["cpu_seconds"], peer_cpu_seconds=peer["cpu_seconds"],
        cpu_seconds_outside_training=peer["cpu_seconds"] - plain["cpu_seconds"],
        peer_processes=peer["processes"],
    )  # fmt: skip


def table(r: dict) -> str:
    mib = 2**20
    lines = [
        f"path 0 of a {r['grid']} grid, {r['steps']} steps (H = {r['inner_steps']}), batch "
        f"{r['batch_size']} x {r['seq_len']} tokens, {r['torch_threads']} torch thread(s); throughput "
        f"over steps {r['measured_steps'][0]}–{r['measured_steps'][1]}",
        "",
        "| | plain PyTorch loop | pathswarm peer alone | ratio |",
        "|---|---:|---:|---:|",
        f"| tokens/s | {r['plain_tokens_per_second']:,.0f} | {r['peer_tokens_per_second']:,.0f} "
        f"| **{r['tokens_per_second_ratio']:.3f}** |",
        f"| peak RSS, all processes (MiB) | {r['plain_rss_bytes'] / mib:,.0f} | "
        f"{r['peer_rss_bytes_total'] / mib:,.0f} | {r['peer_rss_bytes_total'] / r['plain_rss_bytes']:.2f} |",
        f"| CPU seconds, all processes | {r['plain_cpu_seconds']:.1f} | {r['peer_cpu_seconds']:.1f} "
        f"| {r['peer_cpu_seconds'] / r['plain_cpu_seconds']:.2f} |",
        "",
        "| peer process | peak RSS (MiB) | peak USS, its own pages (MiB) |",
        "|---|---:|---:|",
    ]
    lines += [
        f"| {role} | {b / mib:,.0f} | {r['uss_bytes'].get(role, 0) / mib:,.0f} |"
        for role, b in sorted(r["rss_bytes"].items())
    ]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.bar(["plain loop", "pathswarm peer"], [r["plain_tokens_per_second"], r["peer_tokens_per_second"]],
          color=["#888", "#3a7"])  # fmt: skip
    a.set_ylabel("tokens/s")
    a.set_title(f"throughput: ratio {r['tokens_per_second_ratio']:.3f}")
    roles = sorted(r["rss_bytes"])
    bottom = 0.0
    for role, color in zip(roles, ["#3a7", "#7c5", "#bd8", "#dea"], strict=False):
        value = r["rss_bytes"][role] / 2**20
        b.bar(["pathswarm peer"], [value], bottom=bottom, label=role, color=color)
        bottom += value
    b.bar(["plain loop"], [r["plain_rss_bytes"] / 2**20], color="#888")
    b.set_ylabel("peak RSS (MiB)")
    b.set_title("memory by process")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plain_worker is not None:
        plain_worker(args)
        return
    if args.steps < 3 * args.inner_steps:
        raise SystemExit("--steps must be at least 3 x --inner_steps (throughput is measured from step 2H)")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    manifest = make_run(args, args.out)
    print(f"plain loop: {args.steps} steps …", flush=True)
    plain = run_plain(args, manifest)
    print(f"pathswarm peer: {args.steps} steps …", flush=True)
    peer = run_peer(args, manifest, args.out)
    result = compare(args, plain, peer)
    result["wall_seconds"] = time.monotonic() - started
    (args.out / "overhead.json").write_text(json.dumps(result, indent=1))
    md = table(result)
    (args.out / "overhead.md").write_text(md)
    plot(result, args.out / "overhead.png")
    print(md)


if __name__ == "__main__":
    main()
