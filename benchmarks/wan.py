"""Streaming DiLoCo on an emulated WAN: `python -m benchmarks.wan --out DIR`.

Four configurations train the same model on the same data with the same inner optimizer, batch and
number of steps, one after the other, each with `--peers` peers in their own network namespaces
whose egress is capped at `--cap_mbit` (benchmarks/netlab.py). The grid is 1×1, so every peer holds
every module: plain data-parallel DiLoCo, comparable with hivemind.Optimizer.

* `no_sync` — the compute ceiling: every peer is its own swarm (`--new_swarm`), so nothing is ever
  on the wire, and α = 1 with τ = 1, so its (own) outer step never touches the local model either:
  plain local AdamW. (Peers of one swarm with α = 1 would still spend CPU, bandwidth and waits on
  averaging; isolation measures compute alone.)
* `diloco_fp32` — blocking per-module DiLoCo: P = 1, τ = 0, fp32 outer gradients.
* `streaming_4bit` — P fragments synced H/P steps apart, overlapped τ steps, α = 0.5, a 4-bit codec.
  Unless `--overlap_steps` is given, τ is derived from the two runs before it: the step time of
  `no_sync` and the blocking sync time of `diloco_fp32` (see `derive_tau`).
* `hivemind_optimizer` — stock `hivemind.Optimizer(use_local_updates=True)` averaging parameters
  in fp32 every peers × batch × H samples (benchmarks/hivemind_peer.py).

Four peers share this box's two cores, so each peer's training thread runs under a CPU quota
(`--compute_cores`, a cgroup): its "accelerator". Its networking (DHT, averagers, p2pd) runs
outside the quota at a higher priority, as the host CPU of a real peer would (`PeerCpu`). CPU
seconds of both are recorded. Defaults (3.2M-parameter model, batch 4×64 tokens, H = 48, P = 4)
make `diloco_fp32` communication-bound at 20 Mbit/s and the whole run take about 15 minutes.

Measured per configuration (means over peers):
* `tokens_per_second_ratio`: per-peer tokens/s over `no_sync`'s, over the window in which all of a
  configuration's peers were training (start-up skew would otherwise flatter the early starters);
* `bytes_sent_per_peer_per_round`: egress on the peer's veth (everything: payload, DHT, TCP/IP
  headers) over that window, divided by the rounds (H inner steps) in it;
* `peak_bytes_per_sync`: the most payload bytes a peer sent for one sync event (peers' checkpoint
  history `peak_sync_bytes`; hivemind reports none, so its value is the largest burst of bytes on
  its veth, the wire-level `peak_wire_burst_bytes` that is also given for every configuration);
* `eval_loss`: mean next-token NLL on held-out documents (split "eval") after the same number of
  steps, of peer 0's global copy (the averaged model), or of its local model where there is no
  global one (`no_sync`, hivemind).

Writes DIR/wan.json, DIR/wan.md, DIR/wan.png and DIR/<config>/ (manifest, logs, checkpoints). Skips
(exit 0) where network namespaces cannot be made.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads steal shared cores

import torch
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.netlab import CPU_CGROUP_ROOT, Host, NetLab, can_limit_threads, can_make_namespaces
from peer.checkpoint import load_latest_checkpoint
from peer.codecs.specs import CODEC_NAMES, codec_spec
from peer.config import InnerOptimizerConfig, RunManifest, SyncConfig
from peer.data.sources import DatasetSpec, eval_documents
from peer.model.grid import ModelConfig
from peer.model.tokenizer import load_tokenizer
from peer.model.transformer import PathModel, count_parameters
from peer.offline.evaluation import evaluate
from peer.run.create import build_manifest
from peer.run.record import save_record, sign_manifest

CONFIGS = ("no_sync", "diloco_fp32", "streaming_4bit", "hivemind_optimizer")
REPO = Path(__file__).resolve().parent.parent
SAMPLE_SECONDS = 0.2
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

TARGETS = dict(
    streaming_tokens_per_second_ratio_min=0.95,
    bytes_per_round_vs_diloco_max=1 / 7,
    peak_bytes_per_sync_vs_diloco_max_times_P=1 / 7,  # i.e. <= 1/(7·P)
    eval_loss_vs_diloco_max=1.01,
    diloco_tokens_per_second_ratio_max=0.8,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wan", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--cap_mbit", type=float, default=20.0, help="egress cap of every peer")
    p.add_argument("--loss", type=float, default=0.0, help="random packet loss of every peer's egress")
    p.add_argument("--steps", type=int, default=192, help="inner steps of every peer")
    p.add_argument("--inner_steps", type=int, default=48, help="H")
    p.add_argument("--fragments", type=int, default=4, help="P of streaming_4bit")
    p.add_argument("--overlap_steps", type=int, default=None, help="τ of streaming_4bit (default: derived)")
    p.add_argument("--mixing_alpha", type=float, default=0.5, help="α of streaming_4bit")
    p.add_argument("--codec", default="nf4", choices=CODEC_NAMES)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--d_model", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4, help="blocks of the one grid module (a multiple of P)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup_steps", type=int, default=30)
    p.add_argument("--matchmaking_seconds", type=float, default=10.0)
    p.add_argument("--averaging_timeout", type=float, default=30.0)
    p.add_argument("--builtin_docs", type=int, default=3000)
    p.add_argument("--max_eval_docs", type=int, default=100)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset to run")
    p.add_argument("--config_timeout", type=float, default=600.0, help="seconds one configuration may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compute_cores", type=float, default=0.25, help="CPU quota of each peer's training thread (0: none)"
    )
    p.add_argument(
        "--comm_priority", type=int, default=5, help="nice levels by which peers' networking outranks compute"
    )
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    if args.blocks % args.fragments:
        p.error(f"--blocks {args.blocks} must be a multiple of --fragments {args.fragments} (whole blocks)")
    if args.steps % args.inner_steps:
        p.error("--steps must be a multiple of --inner_steps (whole rounds, equal steps everywhere)")
    return args


# --- run set-up -----------------------------------------------------------------------------------


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=load_tokenizer("bytes").vocab_size,
        d_model=args.d_model,
        n_heads=max(1, args.d_model // 32),
        d_ff=4 * args.d_model,
        max_seq_len=args.seq_len + 1,
        n_levels=1,
        modules_per_level=1,
        blocks_per_module=args.blocks,
        fragment_layout="strided",
    )


def base_manifest(args: argparse.Namespace) -> RunManifest:
    return build_manifest(
        "wan",
        model_config(args),
        DatasetSpec(kind="builtin", builtin_docs=args.builtin_docs, seed=args.seed),
        seed=args.seed,
        seq_len=args.seq_len,
        inner_steps=args.inner_steps,
        inner=InnerOptimizerConfig(lr=args.lr, warmup_steps=args.warmup_steps, total_steps=args.steps),
        router_docs=200,  # one path: the router has nothing to decide
    )


def sync_config(name: str, args: argparse.Namespace, tau: int) -> SyncConfig:
    common = dict(
        matchmaking_time_seconds=args.matchmaking_seconds, averaging_timeout_seconds=args.averaging_timeout
    )
    if name == "no_sync":
        return SyncConfig(codec="fp32", fragments=1, overlap_steps=1, mixing_alpha=1.0, **common)
    if name == "streaming_4bit":
        return SyncConfig(
            codec=args.codec,
            fragments=args.fragments,
            overlap_steps=tau,
            mixing_alpha=args.mixing_alpha,
            **common,
        )
    # diloco_fp32; hivemind_optimizer reads only model, data and inner optimizer from its manifest
    return SyncConfig(codec="fp32", fragments=1, overlap_steps=0, **common)


def derive_tau(args: argparse.Namespace, runs: dict[str, dict], model_bytes: int) -> tuple[int, dict]:
    """τ such that one fragment's all-reduce finishes within τ steps, with a 2x margin, from measured
    step time (no_sync) and blocking sync time (diloco_fp32), and τ < H/P as Streaming DiLoCo needs."""
    limit = max(1, args.inner_steps // args.fragments - 1)
    why: dict = dict(max_tau=limit)
    if args.overlap_steps is not None:
        return max(0, args.overlap_steps), {**why, "given": True}
    base, full = runs.get("no_sync"), runs.get("diloco_fp32")
    if not base or not full or not base["tokens_per_second"] or not full["tokens_per_second"]:
        tau = min(limit, 4)
        return tau, {**why, "fallback": "no measurements of no_sync and diloco_fp32", "tau": tau}
    tokens_per_step = args.batch_size * args.seq_len
    step = tokens_per_step / base["tokens_per_second"]
    round_full = args.inner_steps * tokens_per_step / full["tokens_per_second"]
    sync_full = max(0.0, round_full - args.inner_steps * step)
    # transfer at the cap; what is left of the blocking sync is matchmaking, latency and stragglers
    transfer_full = full["wire_bytes_per_round"] / (args.cap_mbit * 1e6 / 8)
    latency = max(0.0, sync_full - transfer_full)
    ratio = 4 / codec_spec(args.codec).wire_bytes_per_value
    fragment_sync = latency + transfer_full / (args.fragments * ratio)
    tau = max(1, min(limit, math.ceil(2.0 * fragment_sync / step)))
    why.update(step_seconds=step, sync_seconds_diloco=sync_full, transfer_seconds_diloco=transfer_full,
               latency_seconds=latency, fragment_sync_seconds=fragment_sync, tau=tau)  # fmt: skip
    return tau, why


# --- processes ------------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
    }


def start_bootstrap(lab: NetLab, hub: Host, manifest_file: Path, log: Path, timeout: float = 90.0):
    argv = [sys.executable, "-m", "peer", "bootstrap", "--host_maddrs", hub.maddr(),
            "--manifest_path", str(manifest_file)]  # fmt: skip
    proc = lab.spawn(hub, argv, log, child_env(), cwd=REPO)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("--initial_peers "):
                return proc, line.split()[1:]
        if proc.poll() is not None:
            raise RuntimeError(f"bootstrap exited early: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    raise TimeoutError("bootstrap did not print its address in time")


class Sampler(threading.Thread):
    """Reads every host's veth counters every SAMPLE_SECONDS: (time, [(tx, rx) per host])."""

    def __init__(self, lab: NetLab):
        super().__init__(daemon=True)
        self.lab = lab
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            self.samples.append((time.time(), self.lab.counters()))
            self.stopped.wait(SAMPLE_SECONDS)
        self.samples.append((time.time(), self.lab.counters()))


class PeerCpu(threading.Thread):
    """How a peer's CPU is shared, the same for every configuration, and what it was spent on.

    Four peers share two cores here. Each peer's training thread (its main thread) gets a CPU quota,
    `--compute_cores` (netlab's per-host cgroup): it plays the peer's accelerator, a fixed compute
    budget. Everything else in the peer's process group (DHT and averager processes, p2pd, helper
    threads) runs outside the quota and `--comm_priority` nice levels above the training threads:
    on a real peer the accelerator computes while the CPU talks, whereas here a peer's compute
    would otherwise starve its own networking (RPCs time out, groups split) and every byte of
    communication would be paid for in compute. CPU seconds are recorded per thread."""

    def __init__(self, lab: NetLab, leaders: dict[int, Host], cores: float | None, boost: int):
        super().__init__(daemon=True)
        self.lab, self.hosts, self.cores = lab, leaders, cores
        self.leaders = set(leaders)
        self.train_nice = os.getpriority(os.PRIO_PROCESS, 0)
        self.comm_nice = max(-20, self.train_nice - boost)
        self.stopped = threading.Event()
        self.limited: set[int] = set()
        # CPU seconds last seen per (leader, pid, tid): what compute and communication cost
        self.cpu: dict[tuple[int, int, int], float] = {}
        self.names: dict[int, str] = {}

    def run(self) -> None:
        while True:
            for pid, leader in _group_members(self.leaders):
                for tid in _threads(pid):
                    try:
                        self._place(tid)
                        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                    except OSError:
                        continue  # the thread ended meanwhile
                    self.cpu[(leader, pid, tid)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
                    if pid not in self.names:
                        self.names[pid] = _process_name(pid)
            if self.stopped.wait(0.5):
                return

    def _place(self, tid: int) -> None:
        training = tid in self.leaders
        target = self.train_nice if training else self.comm_nice
        if os.getpriority(os.PRIO_PROCESS, tid) != target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        if not self.cores:
            return
        if training and tid not in self.limited:
            self.lab.limit_thread_cpu(self.hosts[tid], tid, self.cores)
            self.limited.add(tid)
        elif not training and "/psw-" in _cpu_cgroup(tid):
            # threads and processes started by a training thread inherit its cgroup: not theirs
            (CPU_CGROUP_ROOT / "tasks").write_text(str(tid))

    def cpu_seconds(self) -> dict:
        """CPU seconds of the training threads and of everything else (networking), per peer."""
        compute = sum(v for (_, _, tid), v in self.cpu.items() if tid in self.leaders)
        comm = sum(v for (_, _, tid), v in self.cpu.items() if tid not in self.leaders)
        n = max(1, len(self.leaders))
        by_process: dict[str, float] = {}
        for (leader, pid, tid), v in self.cpu.items():
            name = "training thread" if tid in self.leaders else self.names.get(pid, "?")
            name = "peer main process (other threads)" if pid == leader and tid != leader else name
            by_process[name] = by_process.get(name, 0.0) + v / n
        return dict(
            compute_cpu_seconds_per_peer=compute / n,
            comm_cpu_seconds_per_peer=comm / n,
            cpu_seconds_per_peer_by_process=by_process,
        )


def _cpu_cgroup(tid: int) -> str:
    for line in Path(f"/proc/{tid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return ""


def _group_members(groups: set[int]) -> list[tuple[int, int]]:
    """(pid, process group) of every process in one of these groups."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) in groups:  # field 5 of stat: the process group
            out.append((int(entry.name), int(fields[2])))
    return out


def _process_name(pid: int) -> str:
    """ "p2pd", or the Python process's role from its title/command line."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    return comm if "python" not in comm else (cmdline.split()[0] if cmdline else comm)


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


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


def run_config(name: str, lab: NetLab, manifest: RunManifest, args: argparse.Namespace, out: Path) -> Outcome:
    workdir = out / name
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    record = sign_manifest(manifest, RSAPrivateKey())
    manifest_file = workdir / "manifest.json"
    save_record(record, manifest_file)
    hub, hosts = lab.hosts[0], lab.hosts[1:]
    started = time.monotonic()
    sampler = Sampler(lab)
    procs, commands = [], []
    cpu = None
    try:
        initial_peers: list[str] = []
        if name != "no_sync":
            bootstrap, initial_peers = start_bootstrap(
                lab, hub, manifest_file, workdir / "logs/bootstrap.log"
            )
            procs.append(bootstrap)
        sampler.start()
        # only the final checkpoint (written on exit) is read: skip the one per round (no flag for it)
        env = {**child_env(), "PATHSWARM_CHECKPOINT_EVERY_ROUNDS": "1000000"}
        peer_procs = []
        for i, host in enumerate(hosts):
            ckpt = workdir / f"peer{i}"
            if name == "hivemind_optimizer":
                argv = [sys.executable, "-m", "benchmarks.hivemind_peer",
                        "--manifest_path", str(manifest_file), "--initial_peers", *initial_peers,
                        "--host_maddrs", host.maddr(), "--index", str(i), "--peers", str(len(hosts)),
                        "--max_steps", str(args.steps), "--batch_size", str(args.batch_size),
                        "--checkpoint_dir", str(ckpt), "--torch_threads", "1",
                        "--matchmaking_time", str(args.matchmaking_seconds),
                        "--averaging_timeout", str(args.averaging_timeout)]  # fmt: skip
            else:
                swarm = ["--new_swarm"] if name == "no_sync" else ["--initial_peers", *initial_peers]
                wait = 1 if name == "no_sync" else len(hosts)
                argv = [sys.executable, "-m", "peer", "peer",
                        "--run", f"{manifest.name}@{record.run_id[:16]}",
                        "--manifest_path", str(manifest_file), *swarm, "--host_maddrs", host.maddr(),
                        "--path", "0", "--max_steps", str(args.steps), "--batch_size", str(args.batch_size),
                        "--checkpoint_dir", str(ckpt), "--torch_threads", "1",
                        "--wait_for_peers", str(wait)]  # fmt: skip
            commands.append(["ip", "netns", "exec", host.netns, *argv])
            peer_procs.append(lab.spawn(host, argv, workdir / f"logs/peer{i}.log", env, cwd=REPO))
        procs += peer_procs
        cpu = PeerCpu(lab, {p.pid: h for p, h in zip(peer_procs, hosts, strict=True)}, args.compute_cores,
                      args.comm_priority)  # fmt: skip
        cpu.start()
        deadline = started + args.config_timeout
        while any(p.poll() is None for p in peer_procs):
            failed = [i for i, p in enumerate(peer_procs) if p.poll() not in (None, 0)]
            if failed:  # the others would wait for it until the timeout
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{name} did not finish within {args.config_timeout:.0f}s (logs in {workdir})"
                )
            time.sleep(0.5)
        codes = [p.poll() for p in peer_procs]
    finally:
        if cpu is not None:
            cpu.stopped.set()
            cpu.join(timeout=5)
        sampler.stopped.set()
        if sampler.is_alive():
            sampler.join(timeout=5)
        lab.stop(procs, grace_seconds=10)
    failed = [i for i, c in enumerate(codes) if c != 0]
    if failed:
        tail = "\n".join((workdir / f"logs/peer{failed[0]}.log").read_text().splitlines()[-15:])
        raise RuntimeError(f"{name}: peers {failed} exited with {[codes[i] for i in failed]}:\n{tail}")
    # every host's counters over time, for a look at individual syncs (host 0 is the hub)
    wire = dict(
        hosts=[h.netns for h in lab.hosts], samples=[[t, [c[0] for c in cs]] for t, cs in sampler.samples]
    )
    (workdir / "wire.json").write_text(json.dumps(wire))
    histories, finals, tensors0 = [], [], {}
    for i in range(len(hosts)):
        loaded = load_latest_checkpoint(workdir / f"peer{i}")
        if loaded is None:
            raise RuntimeError(f"{name}: peer{i} left no checkpoint")
        tensors, meta = loaded
        histories.append(meta.get("history", []))
        finals.append({k: v for k, v in meta.items() if k != "history"})
        if i == 0:
            tensors0 = tensors
    return Outcome(name, manifest, histories, finals, tensors0, sampler.samples, commands,
                   time.monotonic() - started, cpu.cpu_seconds())  # fmt: skip


# --- measurements ---------------------------------------------------------------------------------


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


def measure(o: Outcome, args: argparse.Namespace) -> dict:
    if any(not h for h in o.histories):
        raise RuntimeError(f"{o.name}: a peer recorded no round")
    t0, t1 = training_window(o.histories)
    if t1 <= t0:
        raise RuntimeError(f"{o.name}: the peers never trained at the same time ({t0:.1f} > {t1:.1f})")
    tps, tps_whole, rounds_in_window = [], [], []
    for h in o.histories:
        start = h[0]["time"] - h[0]["train_seconds"]
        tokens = [(start, 0.0)] + [(e["time"], float(e["tokens_total"])) for e in h]
        steps = [(start, 0.0)] + [(e["time"], float(e["step"])) for e in h]
        tps.append((_interp(tokens, t1) - _interp(tokens, t0)) / (t1 - t0))
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
    return dict(
        tokens_per_second=sum(tps) / n_hosts,
        tokens_per_second_per_peer=tps,
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
        peak_payload_bytes_per_sync=max(peak_payload) if has_payload else None,
        peak_wire_burst_bytes=max(peaks),
        steps=steps_done,
        outcomes_last_round=o.histories[0][-1].get("outcomes"),
        train_loss_last_round=sum(h[-1]["loss"] for h in o.histories) / n_hosts,
        wall_seconds=o.wall_seconds,
        **o.cpu,
    )


def bursts(series: list[tuple[float, int]], t0: float, t1: float, cap_mbit: float) -> list[int]:
    """Bytes of each run of samples sending faster than 10% of the cap (a sync on the wire); the
    DHT's heartbeats stay far below that."""
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
    """Relative L2 error and cosine of each 4-bit codec on an outer-gradient-like vector: the gap
    between a streaming peer's global copy and its local model at the end (same bytes for both)."""
    from hivemind.compression import CompressionInfo

    from peer.codecs.formats import E3M0Codec, NF4Codec

    parts = []
    for key, value in tensors.items():
        if "/global/" in key:
            mid, name = key.split("/global/")
            parts.append((value - tensors[f"local/parts.{mid}.{name}"]).reshape(-1).float())
    delta = torch.cat(parts)
    out = {}
    for name, codec in (("nf4", NF4Codec()), ("e3m0", E3M0Codec())):
        msg = codec.compress(delta, CompressionInfo.from_tensor(delta))
        back = codec.extract(msg)
        out[name] = dict(
            relative_l2_error=float((back - delta).norm() / delta.norm()),
            cosine=float(torch.nn.functional.cosine_similarity(back, delta, dim=0)),
            bytes_per_value=len(msg.buffer) / delta.numel(),
        )
    return out


# --- report ---------------------------------------------------------------------------------------


def targets_report(runs: dict[str, dict], fragments: int) -> dict:
    s, d = runs.get("streaming_4bit"), runs.get("diloco_fp32")
    out: dict = {}
    if d:
        out["diloco_fp32 tokens_per_second_ratio <= 0.8 (communication-bound)"] = _check(
            d["tokens_per_second_ratio"], 0.8, "max"
        )
    if s:
        out["streaming_4bit tokens_per_second_ratio >= 0.95"] = _check(
            s["tokens_per_second_ratio"], 0.95, "min"
        )
    if s and d:
        out["streaming_4bit bytes_sent_per_peer_per_round <= 1/7 of diloco_fp32"] = _check(
            s["bytes_sent_per_peer_per_round"] / d["bytes_sent_per_peer_per_round"], 1 / 7, "max"
        )
        out[f"streaming_4bit peak_bytes_per_sync <= 1/(7*{fragments}) of diloco_fp32"] = _check(
            s["peak_bytes_per_sync"] / d["peak_bytes_per_sync"], 1 / (7 * fragments), "max"
        )
        out["streaming_4bit eval_loss <= 1.01 x diloco_fp32"] = _check(
            s["eval_loss"] / d["eval_loss"], 1.01, "max"
        )
    return out


def _check(value: float, bound: float, kind: str) -> dict:
    met = value <= bound if kind == "max" else value >= bound
    return dict(value=value, bound=bound, met=bool(met))


def write_markdown(path: Path, report: dict) -> str:
    runs = report["runs"]
    lines = [
        f"{report['peers']} peers, egress cap {report['cap_mbit']:g} Mbit/s each, loss {report['loss']:g}, "
        f"{report['steps']} steps, H = {report['H']}, streaming P = {report['fragments']}, "
        f"τ = {report['overlap_steps']}, α = {report['mixing_alpha']}, codec {report['codec']}; "
        f"compute quota {report['compute_cores']:g} core per peer; model "
        f"{report['model_parameters'] / 1e6:.2f}M parameters "
        f"({report['model_bytes_fp32'] / 1e6:.2f} MB fp32)",
        "",
        "| run | tokens/s per peer | tokens/s ratio | bytes sent / peer / round | peak bytes / sync "
        "| wire burst peak | eval loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        peak = f"{r['peak_bytes_per_sync'] / 1e3:,.0f} kB" + ("" if r["peak_is_payload"] else " (wire)")
        lines.append(
            f"| {name} | {r['tokens_per_second']:.0f} | {r['tokens_per_second_ratio']:.3f} "
            f"| {r['bytes_sent_per_peer_per_round'] / 1e3:,.0f} kB | {peak} "
            f"| {r['peak_wire_burst_bytes'] / 1e3:,.0f} kB | {r['eval_loss']:.4f} |"
        )
    for name, error in report.get("failed", {}).items():
        lines.append(f"| {name} | failed: {error.splitlines()[0][:80]} | | | | | |")
    lines += ["", "| target | value | bound | met |", "|---|---:|---:|---|"]
    for name, t in report["targets"].items():
        lines.append(f"| {name} | {t['value']:.4g} | {t['bound']:.4g} | {'yes' if t['met'] else 'NO'} |")
    lines += [
        "",
        "Bytes per round: veth egress (payload, DHT, TCP/IP) while all peers trained, per H inner steps. "
        "Peak bytes per sync: payload bytes of the largest sync event from the peers' histories "
        "(hivemind: the largest burst on its veth). Eval loss: NLL per token on held-out documents of "
        "peer 0's global copy (no_sync and hivemind: its local model) after the same number of steps.",
    ]
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
    metrics = [("tokens_per_second_ratio", "tokens/s ratio"),
               ("bytes_sent_per_peer_per_round", "bytes/round"),
               ("peak_bytes_per_sync", "peak bytes/sync"), ("eval_loss", "eval loss")]  # fmt: skip
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
    axes[2].set(title="relative to diloco_fp32 (log)")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------------


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok, why = can_make_namespaces()
    if not ok:
        print(f"benchmarks.wan: skipped: cannot make network namespaces here ({why})")
        return 0
    signal.signal(signal.SIGTERM, _raise_interrupt)  # so the lab is torn down on `kill` too
    if args.compute_cores and not can_limit_threads():
        print("benchmarks.wan: no cgroup v1 cpu controller here: training threads run without a quota")
        args.compute_cores = 0.0
    started = time.monotonic()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    base = base_manifest(args)
    n_params = count_parameters(PathModel(base.model, (0,), seed=base.seed))
    model_bytes = 4 * n_params
    print(
        f"model: {n_params / 1e6:.2f}M parameters, {model_bytes / 1e6:.2f} MB fp32; lab of {args.peers} peers"
    )

    outcomes: dict[str, Outcome] = {}
    failures: dict[str, str] = {}
    runs: dict[str, dict] = {}
    tau, tau_why = args.overlap_steps or 0, {}
    caps = [None] + [args.cap_mbit] * args.peers
    losses = [0.0] + [args.loss] * args.peers
    with NetLab(args.peers + 1, cap_mbit=caps, loss=losses) as lab:
        for name in [c for c in CONFIGS if c in args.configs]:
            if name == "streaming_4bit":
                tau, tau_why = derive_tau(args, runs, model_bytes)
                print(f"streaming_4bit: τ = {tau} ({json.dumps(tau_why)})")
            sync = sync_config(name, args, tau)
            manifest = base.model_copy(update=dict(name=f"wan_{name}", sync=sync))
            print(f"[{time.monotonic() - started:5.0f}s] {name}: starting", flush=True)
            try:
                outcome = run_config(name, lab, manifest, args, out)
                r = measure(outcome, args)
            except (RuntimeError, TimeoutError) as e:
                # one broken configuration must not cost the others' measurements
                print(f"[{time.monotonic() - started:5.0f}s] {name}: FAILED: {e}", flush=True)
                failures[name] = str(e)
                continue
            outcomes[name], runs[name] = outcome, r
            print(
                f"[{time.monotonic() - started:5.0f}s] {name}: {r['tokens_per_second']:.0f} tokens/s/peer, "
                f"{r['wire_bytes_per_round'] / 1e3:.0f} kB/round on the wire, {r['wall_seconds']:.0f}s",
                flush=True,
            )

    torch.set_num_threads(os.cpu_count() or 1)  # the peers are gone: evaluation may use every core
    docs = eval_documents(base.dataset, limit=args.max_eval_docs)
    base_tps = runs["no_sync"]["tokens_per_second"] if "no_sync" in runs else float("nan")
    for name, o in outcomes.items():
        r = runs[name]
        which = "global" if name in ("diloco_fp32", "streaming_4bit") else "local"
        r["eval_loss"] = eval_loss(o.manifest, o.tensors, which, docs)
        r["eval_weights"] = which
        if which == "global":
            r["eval_loss_local_model"] = eval_loss(o.manifest, o.tensors, "local", docs)
        r["tokens_per_second_ratio"] = r["tokens_per_second"] / base_tps
        r["bytes_sent_per_peer_per_round"] = r["wire_bytes_per_round"]
        r["peak_is_payload"] = r["peak_payload_bytes_per_sync"] is not None
        r["peak_bytes_per_sync"] = (
            r["peak_payload_bytes_per_sync"] if r["peak_is_payload"] else r["peak_wire_burst_bytes"]
        )
        r["sync"] = o.manifest.sync.model_dump()
        r["commands"] = [" ".join(c) for c in o.commands]
    report = dict(
        peers=args.peers,
        cap_mbit=args.cap_mbit,
        loss=args.loss,
        steps=args.steps,
        H=args.inner_steps,
        fragments=args.fragments,
        overlap_steps=tau,
        overlap_derivation=tau_why,
        mixing_alpha=args.mixing_alpha,
        codec=args.codec,
        compute_cores=args.compute_cores,
        comm_priority=args.comm_priority,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        model=base.model.model_dump(),
        model_parameters=n_params,
        model_bytes_fp32=model_bytes,
        eval_docs=len(docs),
        params={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        command=" ".join(["python -m benchmarks.wan", *(argv if argv is not None else sys.argv[1:])]),
        runs=runs,
        failed=failures,
        codec_errors=codec_errors(outcomes["streaming_4bit"].tensors)
        if "streaming_4bit" in outcomes
        else None,
        targets=targets_report(runs, args.fragments),
        wall_seconds=time.monotonic() - started,
    )
    (out / "wan.json").write_text(json.dumps(report, indent=1))
    print(write_markdown(out / "wan.md", report))
    write_plot(out / "wan.png", report, outcomes)
    print(f"wrote {out / 'wan.json'}, {out / 'wan.md'}, {out / 'wan.png'} in {report['wall_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
