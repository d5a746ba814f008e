"""`pathswarm demo`: a whole run on this machine, from manifest to summary.

Creates a run on the built-in offline corpus (tiny 2x2 grid), starts a bootstrap node and N peers as
separate processes on loopback, shows their outer rounds in a progress bar, and summarises what
their final checkpoints say: losses, bytes on the wire, and how far apart the holders of each
module ended (they should be equal up to codec error).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from itertools import combinations
from pathlib import Path
from typing import TYPE_CHECKING

from peer.cli.common import Handler, setup_logging
from peer.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from peer.config import RunManifest

logger = logging.getLogger(__name__)
RUN_NAME = "demo"


def register(subparsers) -> dict[str, Handler]:
    p = subparsers.add_parser("demo", help="a local swarm on loopback: bootstrap + N peers on a 2x2 grid")
    p.add_argument("--peers", type=int, default=4, help="peer processes besides the bootstrap node")
    p.add_argument("--rounds", type=int, default=4, help="outer rounds each peer trains")
    p.add_argument("--inner_steps", type=int, default=40, help="inner steps per outer round (H)")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per inner step")
    p.add_argument("--out", type=Path, default=None, help="write summary.json and peer logs here")
    p.add_argument("--timeout_seconds", type=float, default=600, help="give up on the demo after this long")
    return {"demo": cmd_demo}


def cmd_demo(args: argparse.Namespace) -> int:
    setup_logging()
    return run_demo(
        args.peers, args.rounds, args.inner_steps, args.batch_size, args.out, args.timeout_seconds
    )


def demo_manifest(rounds: int, inner_steps: int, seed: int = 0) -> RunManifest:
    from peer.config import InnerOptimizerConfig, SyncConfig
    from peer.data.sources import DatasetSpec
    from peer.model.grid import model_config_from_preset
    from peer.run.create import build_manifest

    model = model_config_from_preset("tiny", n_levels=2, modules_per_level=2)
    return build_manifest(
        RUN_NAME,
        model,
        DatasetSpec(kind="builtin", builtin_docs=2000, seed=seed),
        seed=seed,
        seq_len=64,
        inner=InnerOptimizerConfig(lr=2e-3, warmup_steps=20, total_steps=rounds * inner_steps),
        sync=SyncConfig(inner_steps=inner_steps, codec="fp32", averaging_timeout_seconds=45.0),
        router_docs=600,
    )


def module_divergence(states: list[dict[str, torch.Tensor]]) -> tuple[float, dict[str, float]]:
    """Largest |difference| between two holders' global copies, over every module they share."""
    per_module: dict[str, float] = {}
    for a, b in combinations(states, 2):
        for name in a.keys() & b.keys():
            if "/global/" not in name:
                continue
            module = name.split("/")[0]
            diff = float((a[name].float() - b[name].float()).abs().max())
            per_module[module] = max(per_module.get(module, 0.0), diff)
    return max(per_module.values(), default=0.0), per_module


def run_demo(
    n_peers: int, rounds: int, inner_steps: int, batch_size: int, out: Path | None, timeout_seconds: float
) -> int:
    from hivemind.utils.crypto import RSAPrivateKey

    from dht.node import start_dht
    from peer.cli.local_swarm import LocalSwarm
    from peer.run.options import RunChoices
    from peer.run.record import save_record, sign_manifest
    from peer.run.routing_index import with_run_index
    from peer.swarm.base_model import run_folder_store

    if n_peers < 1 or rounds < 1:
        raise ConfigError("--peers and --rounds must be >= 1")
    started = time.monotonic()
    workdir = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="pathswarm-demo-"))
    # each demo is a new run: its peers would refuse an earlier demo's checkpoints (no --resume)
    earlier = sorted(ckpt.parent for ckpt in workdir.glob("peer*/ckpt-*"))
    if earlier:
        raise ConfigError(
            f"--out {workdir} holds an earlier demo's checkpoints ({earlier[0]}): give another --out "
            "(nothing was deleted)"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    manifest_file = workdir / "manifest.json"
    # the corpus routed once here, as `run create` does: the bootstrap serves the index from beside the
    # manifest, and the peers read where each document goes instead of routing it themselves
    covered = RunChoices.model_fields["routing_index_documents"].default
    manifest = with_run_index(demo_manifest(rounds, inner_steps), run_folder_store(manifest_file), covered)
    record = sign_manifest(manifest, RSAPrivateKey())
    save_record(record, manifest_file)
    run = f"{RUN_NAME}@{record.run_id[:16]}"
    print(f"run {run}: {n_peers} peers, 2x2 grid, {rounds} rounds of {inner_steps} steps; logs in {workdir}")

    codes: dict[str, int | None] = {}
    with LocalSwarm(workdir / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(manifest_file)])
        watcher, _ = start_dht(
            initial_peers=swarm.initial_peers, client_mode=True, run_name=RUN_NAME, run_id=record.run_id
        )
        try:
            names = [f"peer{i}" for i in range(n_peers)]
            for name in names:
                swarm.start_peer(
                    name,
                    ["--run", run, "--max_rounds", str(rounds), "--batch_size", str(batch_size),
                     "--checkpoint_dir", str(workdir / name), "--torch_threads", "1",
                     "--heartbeat_seconds", "2", "--wait_for_peers", str(n_peers)],
                )  # fmt: skip
            _show_progress(
                swarm,
                names,
                watcher,
                record.run_id,
                manifest.model.n_paths,
                rounds,
                started + timeout_seconds,
                workdir,
            )
            codes = {n: swarm.procs[n].returncode for n in names}
        finally:
            watcher.shutdown()

    failed = {n: c for n, c in codes.items() if c != 0}
    if failed:
        for n in failed:
            tail = (workdir / "logs" / f"{n}.log").read_text().splitlines()[-5:]
            how = "was stopped after another peer failed" if failed[n] is None else f"exited with {failed[n]}"
            print(f"{n} {how}:\n  " + "\n  ".join(tail))
        return 1
    summary = summarize(workdir, codes, rounds, time.monotonic() - started)
    summary.update(heldout_losses(manifest, [workdir / n for n in codes]))
    _print_table(summary)
    if out is not None:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"summary written to {workdir / 'summary.json'}")
    return 0


def _show_progress(
    swarm, names: list[str], watcher, run_id: str, n_paths: int, rounds: int, deadline: float, workdir: Path
):
    """A progress bar of the peers' outer rounds (read from their claims) until every peer exited, or
    one failed (the others would wait for it)."""
    from tqdm import tqdm

    from peer.swarm.claims import live_claims

    with tqdm(total=len(names) * rounds, desc="outer rounds (all peers)", unit="round") as bar:
        done = 0
        while any(swarm.alive(n) for n in names):
            if any(not swarm.alive(n) and swarm.procs[n].returncode != 0 for n in names):
                return  # stop now and show why
            if time.monotonic() > deadline:
                raise TimeoutError(f"demo did not finish in time (logs in {workdir})")
            claims = live_claims(watcher, RUN_NAME, run_id, n_paths)
            progress = sum(min(c.outer_round, rounds) for c in claims.values())
            if progress > done:
                bar.update(progress - done)
                done = progress
            time.sleep(1.0)
        bar.update(len(names) * rounds - done)


def summarize(workdir: Path, codes: dict[str, int | None], rounds: int, seconds: float) -> dict:
    from peer.checkpoint import load_latest_checkpoint

    peers, states = [], []
    for name in codes:
        loaded = load_latest_checkpoint(workdir / name)
        if loaded is None:
            raise RuntimeError(f"{name} left no checkpoint in {workdir / name}")
        tensors, meta = loaded
        states.append(tensors)
        history = meta.get("history", [])
        peers.append(
            dict(
                name=name,
                peer_id=meta["peer_id"],
                path=meta["path"],
                rounds=meta["outer_round"],
                steps=meta["step"],
                loss_first=history[0]["loss"] if history else None,
                loss_last=history[-1]["loss"] if history else None,
                bytes_sent=sum(h.get("bytes_sent", 0) for h in history),
                outcomes=history[-1]["outcomes"] if history else {},
            )
        )
    divergence, per_module = module_divergence(states)
    losses_first = [p["loss_first"] for p in peers if p["loss_first"] is not None]
    losses_last = [p["loss_last"] for p in peers if p["loss_last"] is not None]
    return dict(
        peers=len(peers),
        grid="2x2",
        rounds_completed=min(p["rounds"] for p in peers),
        rounds_requested=rounds,
        loss_first=sum(losses_first) / max(1, len(losses_first)),
        loss_last=sum(losses_last) / max(1, len(losses_last)),
        module_divergence_max=divergence,
        module_divergence=per_module,
        bytes_sent_total=sum(p["bytes_sent"] for p in peers),
        paths={p["name"]: p["path"] for p in peers},
        seconds=round(seconds, 1),
        per_peer=peers,
    )


def heldout_losses(manifest, checkpoint_dirs: list[Path], max_docs: int = 120) -> dict:
    """Held-out loss (nats per token) of the swarm's global copies against the same grid at its
    seeded initial weights, on the run's own held-out documents routed as eval routes them: what
    the training loss of a round cannot show (a wrong outer step still lowers it within a round)."""
    from peer.data.sources import eval_documents
    from peer.model.transformer import GridModel
    from peer.offline.evaluation import evaluate
    from peer.offline.grid_checkpoints import assemble_grid
    from peer.run.rebuild import check_tokenizer, make_route

    docs = eval_documents(manifest.dataset, limit=max_docs)
    tok, route = check_tokenizer(manifest), make_route(manifest)
    initial = GridModel(manifest.model, seed=manifest.seed).eval()
    out = {}
    for name, grid in (("initial", initial), ("final", assemble_grid(manifest, checkpoint_dirs))):
        result = evaluate(grid, docs, tok, route, context=manifest.seq_len)
        out[f"heldout_loss_{name}"] = result.nll / result.tokens
    out["heldout_docs"] = len(docs)
    return out


def _print_table(s: dict) -> None:
    print()
    print(
        f"{'peer':<8}{'path':<8}{'rounds':>7}{'steps':>7}"
        f"{'loss first':>12}{'loss last':>11}{'bytes sent':>12}"
    )
    for p in s["per_peer"]:
        print(
            f"{p['name']:<8}{str(tuple(p['path'])):<8}{p['rounds']:>7}{p['steps']:>7}"
            f"{p['loss_first']:>12.3f}{p['loss_last']:>11.3f}{p['bytes_sent']:>12}"
        )
    print(
        f"\nmean loss {s['loss_first']:.3f} -> {s['loss_last']:.3f}; module divergence max "
        f"{s['module_divergence_max']:.2e}; {s['bytes_sent_total']} bytes sent; {s['seconds']}s"
    )
    if "heldout_loss_final" in s:
        print(
            f"held-out loss of the swarm's global copies ({s['heldout_docs']} documents): "
            f"{s['heldout_loss_initial']:.3f} at initialization -> {s['heldout_loss_final']:.3f}"
        )
