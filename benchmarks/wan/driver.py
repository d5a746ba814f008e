"""The WAN lab's run driver: configurations, peers in namespaces, one configuration after another."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads steal shared cores

import torch
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.wan import report
from benchmarks.wan.copies import copy_groups, global_copy_digest
from benchmarks.wan.cpu import PeerCpu
from benchmarks.wan.netlab import Host, NetLab, Sampler, can_limit_threads, can_make_namespaces
from benchmarks.wan.options import (
    CONFIGS,
    NO_SYNC,
    SPARSE_OVERLAP_STEPS,
    STREAMING,
    largest_overlap_steps,
    parse_args,
)
from benchmarks.wan.report import Outcome
from peer.checkpoint import load_latest_checkpoint
from peer.codecs.specs import codec_spec
from peer.config import InnerOptimizerConfig, OuterOptimizerConfig, RunManifest, SyncConfig
from peer.data.sources import DatasetSpec, eval_documents, load_documents, split_of
from peer.model.grid import ModelConfig
from peer.model.tokenizer import Tokenizer, load_tokenizer
from peer.model.transformer import PathModel, count_parameters
from peer.offline.simulate import InnerLoop, document_batches
from peer.run.create import build_manifest
from peer.run.record import save_record, sign_manifest

REPO = Path(__file__).resolve().parents[2]


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


@dataclass
class LabTraining:
    """The lab's model, data and inner optimizer for training in process, without peers or network
    (benchmarks that isolate one part of what the lab measures)."""

    args: argparse.Namespace
    manifest: RunManifest
    tokenizer: Tokenizer
    train_docs: list[str]

    @classmethod
    def load(cls, *lab_flags: str, max_docs: int | None = None) -> LabTraining:
        args = parse_args(["--out", "unused", *lab_flags])
        manifest = base_manifest(args)
        docs = [d for d in load_documents(manifest.dataset) if split_of(d, manifest.dataset) == "train"]
        return cls(args, manifest, load_tokenizer(manifest.tokenizer), docs[:max_docs])

    def replica(self, batch_seed: int, total_steps: int) -> InnerLoop:
        """The lab's path model from its initial weights, with its AdamW and a batch order of its own."""
        m = self.manifest
        model = PathModel(m.model, (0,) * m.model.n_levels, seed=m.seed)
        batches = document_batches(
            self.train_docs, self.tokenizer, m.seq_len, self.args.batch_size, batch_seed
        )
        return InnerLoop(model, batches, m.inner, total_steps=total_steps)


def base_manifest(args: argparse.Namespace) -> RunManifest:
    return build_manifest(
        "wan",
        model_config(args),
        DatasetSpec(kind="builtin", builtin_docs=args.builtin_docs, seed=args.seed),
        seed=args.seed,
        seq_len=args.seq_len,
        inner=InnerOptimizerConfig(lr=args.lr, warmup_steps=args.warmup_steps, total_steps=args.steps),
        sync=SyncConfig(inner_steps=args.inner_steps),
        router_docs=200,  # one path: the router has nothing to decide
    )


def sync_config(name: str, args: argparse.Namespace, tau: int) -> SyncConfig:
    common = dict(inner_steps=args.inner_steps, averaging_timeout_seconds=args.averaging_timeout)
    if name in NO_SYNC:
        return SyncConfig(codec="fp32", fragments=1, overlap_steps=1, mixing_alpha=1.0, **common)
    if name in STREAMING:
        return SyncConfig(
            codec=args.codec if name == "streaming_4bit" else args.sparse_codec,
            fragments=args.fragments,
            overlap_steps=sparse_tau(args) if name == "streaming_sparse" else tau,
            mixing_alpha=args.mixing_alpha if name == "streaming_4bit" else args.sparse_mixing_alpha,
            **common,
        )
    # diloco_fp32; hivemind_optimizer reads only model, data and inner optimizer from its manifest
    return SyncConfig(codec="fp32", fragments=1, overlap_steps=0, **common)


def sparse_tau(args: argparse.Namespace) -> int:
    """τ of streaming_sparse: its own where given, else SPARSE_OVERLAP_STEPS below H/P."""
    if args.sparse_overlap_steps is not None:
        return args.sparse_overlap_steps
    return min(SPARSE_OVERLAP_STEPS, largest_overlap_steps(args))


def outer_config(name: str, args: argparse.Namespace, base: RunManifest) -> OuterOptimizerConfig:
    """DiLoCo's outer step (lr 0.7, Nesterov 0.9) for every run but streaming_sparse's (SparseLoCo's:
    no momentum, error feedback in its place, --sparse_outer_lr)."""
    if name != "streaming_sparse":
        return base.outer
    m = args.sparse_outer_momentum
    return OuterOptimizerConfig(lr=args.sparse_outer_lr, momentum=m, nesterov=m > 0)


def derive_tau(args: argparse.Namespace, runs: dict[str, dict], model_bytes: int) -> tuple[int, dict]:
    """τ such that one fragment's all-reduce finishes within τ steps, with a 2x margin, from measured
    step time (no_sync) and blocking sync time (diloco_fp32), and τ < H/P as Streaming DiLoCo needs."""
    limit = max(1, largest_overlap_steps(args))
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
        if name not in NO_SYNC:
            bootstrap, initial_peers = start_bootstrap(
                lab, hub, manifest_file, workdir / "logs/bootstrap.log"
            )
            procs.append(bootstrap)
        sampler.start()
        env = child_env()
        peer_procs = []
        for i, host in enumerate(hosts):
            ckpt = workdir / f"peer{i}"
            if name == "hivemind_optimizer":
                argv = [sys.executable, "-m", "benchmarks.wan.hivemind_peer",
                        "--manifest_path", str(manifest_file), "--initial_peers", *initial_peers,
                        "--host_maddrs", host.maddr(), "--index", str(i), "--peers", str(len(hosts)),
                        "--max_steps", str(args.steps), "--batch_size", str(args.batch_size),
                        "--checkpoint_dir", str(ckpt), "--torch_threads", "1",
                        "--matchmaking_time", str(args.matchmaking_seconds),
                        "--averaging_timeout", str(args.averaging_timeout)]  # fmt: skip
            else:
                swarm = ["--new_swarm"] if name in NO_SYNC else ["--initial_peers", *initial_peers]
                wait = 1 if name in NO_SYNC else len(hosts)
                argv = [sys.executable, "-m", "peer", "peer",
                        "--run", f"{manifest.name}@{record.run_id[:16]}",
                        "--manifest_path", str(manifest_file), *swarm, "--host_maddrs", host.maddr(),
                        "--path", "0", "--max_steps", str(args.steps), "--batch_size", str(args.batch_size),
                        "--checkpoint_dir", str(ckpt), "--torch_threads", "1",
                        "--wait_for_peers", str(wait),
                        # only the final checkpoint (written on exit) is read: none per round
                        "--checkpoint_every_rounds", "1000000"]  # fmt: skip
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
    histories, finals, tensors0, groups, copies = read_checkpoints(name, workdir, len(hosts))
    return Outcome(name, manifest, histories, finals, tensors0, sampler.samples, commands,
                   time.monotonic() - started, cpu.cpu_seconds(), groups, copies)  # fmt: skip


def read_checkpoints(name: str, workdir: Path, n_peers: int):
    """Each peer's final checkpoint: its round history, its meta, peer 0's tensors, and the peers
    grouped by the global copy they ended with, with one checkpoint's tensors of each group."""
    histories, finals, tensors0, digests, kept = [], [], {}, [], {}
    for i in range(n_peers):
        loaded = load_latest_checkpoint(workdir / f"peer{i}")
        if loaded is None:
            raise RuntimeError(f"{name}: peer{i} left no checkpoint")
        tensors, meta = loaded
        histories.append(meta.get("history", []))
        finals.append({k: v for k, v in meta.items() if k != "history"})
        if i == 0:
            tensors0 = tensors
        digests.append(digest := global_copy_digest(tensors))
        if digest is not None:
            kept.setdefault(digest, tensors)  # one checkpoint of each copy, to evaluate it if they split
    return histories, finals, tensors0, copy_groups(digests), list(kept.values())


# --- measurements ---------------------------------------------------------------------------------


# --- report ---------------------------------------------------------------------------------------


# --- main -----------------------------------------------------------------------------------------


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_configs(args: argparse.Namespace, base: RunManifest, model_bytes: int, started: float):
    """Every chosen configuration, one after another, in one lab; a failed one is reported, not fatal."""
    outcomes: dict[str, Outcome] = {}
    failures: dict[str, str] = {}
    runs: dict[str, dict] = {}
    tau, tau_why = args.overlap_steps or 0, {}
    caps = [None] + [args.cap_mbit] * args.peers
    losses = [0.0] + [args.loss] * args.peers
    with NetLab(args.peers + 1, cap_mbit=caps, loss=losses) as lab:
        for name in [c for c in CONFIGS if c in args.configs]:
            if name in STREAMING and not tau_why:
                tau, tau_why = derive_tau(args, runs, model_bytes)
                print(f"streaming: τ = {tau} ({json.dumps(tau_why)})")
            sync = sync_config(name, args, tau)
            manifest = base.model_copy(
                update=dict(name=f"wan_{name}", sync=sync, outer=outer_config(name, args, base))
            )
            print(f"[{time.monotonic() - started:5.0f}s] {name}: starting", flush=True)
            try:
                outcome = run_config(name, lab, manifest, args, args.out)
                r = report.measure(outcome, args)
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
    return outcomes, runs, failures, tau, tau_why


def evaluate_runs(
    outcomes: dict[str, Outcome], runs: dict[str, dict], docs: list[str], n_params: int, peers: int
) -> None:
    """Eval loss of every run (peer 0's global copy, or its local model where there is none), and the
    tokens/s ratios against no_sync's (the mean of its runs at the start and the end); returns that
    baseline, each end's and their spread."""
    baseline = report.no_sync_baseline(runs)
    base_tps, base_to_end = baseline["tokens_per_second"], baseline["tokens_per_second_to_the_end"]
    for name, o in outcomes.items():
        r = runs[name]
        which = "global" if name in ("diloco_fp32", *STREAMING) else "local"
        r["eval_loss"] = report.eval_loss(o.manifest, o.tensors, which, docs)
        r["eval_weights"] = which
        r["final_copy_groups"] = o.copy_groups
        if len(o.copy_groups) > 1:  # peer 0's copy does not speak for every holder: each one's loss
            r["eval_loss_per_copy"] = [report.eval_loss(o.manifest, t, "global", docs) for t in o.copies]
        if which == "global":
            r["eval_loss_local_model"] = report.eval_loss(o.manifest, o.tensors, "local", docs)
        r["tokens_per_second_ratio"] = r["tokens_per_second"] / base_tps
        r["tokens_per_second_ratio_to_the_end"] = r["tokens_per_second_to_the_end"] / base_to_end
        r["bytes_sent_per_peer_per_round"] = r["wire_bytes_per_round"]
        r["sync"] = o.manifest.sync.model_dump()
        r["outer"] = o.manifest.outer.model_dump()
        if name in ("diloco_fp32", *STREAMING):
            r["gradient_bytes_per_round"], r["control_share"] = report.control_share(
                r, o.manifest.sync, n_params, peers
            )
        # τ each peer ended with (peers raise it when their syncs outlast it: OverlapTuner)
        r["overlap_steps_final"] = [h[-1].get("overlap_steps") if h else None for h in o.histories]
        r["commands"] = [" ".join(c) for c in o.commands]
    return baseline


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok, why = can_make_namespaces(install=True)
    if not ok:
        print(f"benchmarks.wan: skipped: cannot make network namespaces here ({why})")
        return 0
    signal.signal(signal.SIGTERM, _raise_interrupt)  # so the lab is torn down on `kill` too
    if args.compute_cores and not can_limit_threads():
        print("benchmarks.wan: no cgroup v1 cpu controller here: training threads run without a quota")
        args.compute_cores = 0.0
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    base = base_manifest(args)
    n_params = count_parameters(PathModel(base.model, (0,), seed=base.seed))
    model_bytes = 4 * n_params
    print(
        f"model: {n_params / 1e6:.2f}M parameters, {model_bytes / 1e6:.2f} MB fp32; lab of {args.peers} peers"
    )
    outcomes, runs, failures, tau, tau_why = run_configs(args, base, model_bytes, started)
    torch.set_num_threads(os.cpu_count() or 1)  # the peers are gone: evaluation may use every core
    docs = eval_documents(base.dataset, limit=args.max_eval_docs)
    baseline = evaluate_runs(outcomes, runs, docs, n_params, args.peers)
    summary = dict(
        peers=args.peers, cap_mbit=args.cap_mbit, loss=args.loss, steps=args.steps, H=args.inner_steps,
        fragments=args.fragments, overlap_steps=tau, overlap_derivation=tau_why,
        mixing_alpha=args.mixing_alpha, codec=args.codec, compute_cores=args.compute_cores,
        sparse=dict(codec=args.sparse_codec, outer_lr=args.sparse_outer_lr,
                    outer_momentum=args.sparse_outer_momentum, mixing_alpha=args.sparse_mixing_alpha,
                    overlap_steps=sparse_tau(args)),
        no_sync_baseline=baseline,
        comm_priority=args.comm_priority, batch_size=args.batch_size, seq_len=args.seq_len,
        model=base.model.model_dump(), model_parameters=n_params, model_bytes_fp32=model_bytes,
        eval_docs=len(docs),
        params={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        command=" ".join(["python -m benchmarks.wan", *(argv if argv is not None else sys.argv[1:])]),
        runs=runs, failed=failures,
        codec_errors=report.codec_errors(outcomes["streaming_4bit"].tensors) if "streaming_4bit" in outcomes
        else None,
        targets=report.targets_report(runs, args.fragments),
        wall_seconds=time.monotonic() - started,
    )  # fmt: skip
    out = args.out
    (out / "wan.json").write_text(json.dumps(summary, indent=1))
    print(report.write_markdown(out / "wan.md", summary))
    report.write_plot(out / "wan.png", summary, outcomes)
    print(f"wrote {out / 'wan.json'}, {out / 'wan.md'}, {out / 'wan.png'} in {summary['wall_seconds']:.0f}s")
    return 0
