"""A training peer built on stock `hivemind.Optimizer` (local updates), the baseline of benchmarks/wan.py.

It trains exactly what a pathswarm peer on path 0 of the run trains: the run's model from the run
seed, the run's data shard and batch shape, the same inner AdamW with its cosine schedule and
clipping. Instead of pathswarm's outer sync it hands the parameters to `hivemind.Optimizer` with
`use_local_updates=True`: every step is a local AdamW step, and once the swarm has processed
`target_batch_size` samples (peers × batch × H, about H steps each) the peers average their
parameters in fp32 in the background (hivemind's delayed state averaging). One change to stock
hivemind: an epoch ends on samples only, not also on its wall-clock ETA (see `_ready_by_samples`).
Its checkpoints hold the peer's parameters as `local/...` and a history in the same format as a
pathswarm peer's, so the benchmark reads both the same way.

    python -m benchmarks.wan.hivemind_peer --manifest_path M --initial_peers ... --host_maddrs ...
        --index 0 --peers 4 --max_steps 200 --batch_size 8 --checkpoint_dir D
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads steal shared cores

import hivemind
import torch
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time

from peer.checkpoint import save_checkpoint
from peer.data.batches import PathBatches
from peer.data.sources import load_documents
from peer.model.transformer import PathModel
from peer.run.rebuild import check_tokenizer, make_route
from peer.run.record import load_verified_manifest
from peer.seeding import stable_seed
from peer.training.inner import inner_step, tokens_in  # the pathswarm peer's step: both train alike

logger = logging.getLogger("hivemind_peer")
READY_KEY = "wan_hivemind_ready"


def _ready_by_samples(self: ProgressTracker) -> bool:
    return (
        self.global_epoch > self.local_progress.epoch
        or self.global_progress.samples_accumulated >= self.target_batch_size
    )


# hivemind also ends an epoch once its wall-clock ETA has passed. Its averaging blocks the next local
# step (local updates wait for the delayed round), and on a slow link a round outlasts the ETA of
# the next epoch, so from the second epoch on every step would start another full average. An epoch
# here is exactly target_batch_size samples, as the comparison with H inner steps needs.
ProgressTracker.ready_to_update_epoch = property(_ready_by_samples)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.wan.hivemind_peer", description=__doc__.splitlines()[0]
    )
    p.add_argument("--manifest_path", type=Path, required=True)
    p.add_argument("--initial_peers", nargs="*", default=[])
    p.add_argument("--host_maddrs", nargs="*", default=["/ip4/127.0.0.1/tcp/0"])
    p.add_argument("--index", type=int, required=True, help="this peer's number (seeds its data order)")
    p.add_argument("--peers", type=int, required=True, help="peers in the swarm (target batch and start)")
    p.add_argument("--max_steps", type=int, required=True)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--checkpoint_dir", type=Path, required=True)
    p.add_argument("--torch_threads", type=int, default=1)
    p.add_argument("--matchmaking_time", type=float, default=5.0)
    p.add_argument("--averaging_timeout", type=float, default=60.0)
    p.add_argument("--wait_timeout", type=float, default=300.0)
    return p.parse_args(argv)


def tx_bytes() -> int:
    """Bytes this network namespace has sent on eth0 (the lab's veth); 0 outside a lab."""
    try:
        return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())
    except OSError:
        return 0


def wait_for_peers(dht: hivemind.DHT, key: str, index: int, n: int, timeout: float, stop) -> None:
    """A start barrier like pathswarm's --wait_for_peers: everyone starts training together."""
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        dht.store(key, subkey=index, value=True, expiration_time=get_dht_time() + 60)
        found = dht.get(key, latest=True)
        ready = len(found.value) if found is not None and isinstance(found.value, dict) else 0
        if ready >= n or time.monotonic() > deadline:
            logger.info(f"{ready} of {n} peers ready: starting")
            return
        time.sleep(0.5)


def make_optimizer(args: argparse.Namespace, m, run_id: str, dht, model: PathModel) -> hivemind.Optimizer:
    betas = (m.inner.beta1, m.inner.beta2)
    return hivemind.Optimizer(
        dht=dht,
        run_id=f"wan_{run_id[:12]}",
        target_batch_size=args.peers * args.batch_size * m.inner_steps,
        batch_size_per_step=args.batch_size,
        params=model.parameters(),
        optimizer=lambda params: torch.optim.AdamW(
            params, lr=m.inner.lr, betas=betas, weight_decay=m.inner.weight_decay
        ),
        use_local_updates=True,
        matchmaking_time=args.matchmaking_time,
        averaging_timeout=args.averaging_timeout,
        verbose=True,
    )


def history_entry(step: int, epoch: int, losses: list[float], tokens: int, tx: int, started: float) -> dict:
    return dict(
        round=epoch,
        step=step,
        loss=sum(losses) / max(1, len(losses)),
        bytes_sent=None,  # hivemind does not report payload bytes
        wire_bytes_sent=tx,
        peak_sync_bytes=None,
        tokens_total=tokens,
        time=time.time(),
        train_seconds=time.monotonic() - started,
    )


def train(args: argparse.Namespace, m, run_id: str, dht, opt, model: PathModel, stop) -> None:
    batches = PathBatches(
        load_documents(m.dataset),
        make_route(m),
        0,
        check_tokenizer(m),
        m.seq_len,
        args.batch_size,
        seed=stable_seed("hivemind-peer", args.index),
        eval_fraction=m.dataset.eval_fraction,
    )
    wait_for_peers(dht, f"{READY_KEY}_{run_id[:12]}", args.index, args.peers, args.wait_timeout, stop)
    history: list[dict] = []
    step = tokens_total = 0
    losses: list[float] = []
    started = time.monotonic()
    tx_round, epoch = tx_bytes(), opt.local_epoch
    while step < args.max_steps and not stop.is_set():
        batch = next(batches)
        # the schedule sets the wrapped torch optimizer's lr: hivemind's param_groups are copies
        lr_groups = opt.state_averager.optimizer.param_groups
        losses.append(inner_step(model, opt, batch, m.inner, step, lr_groups=lr_groups))
        step += 1
        tokens_total += tokens_in(batch)
        if opt.local_epoch != epoch:  # the swarm finished an epoch: an averaging round began
            epoch, tx_now = opt.local_epoch, tx_bytes()
            history.append(history_entry(step, epoch, losses, tokens_total, tx_now - tx_round, started))
            tx_round, losses = tx_now, []
            logger.info(f"epoch {epoch} step {step} loss {history[-1]['loss']:.4f}")
    # the round in flight lands in the parameters before they are saved
    opt.state_averager.step(wait_for_delayed_updates=True)
    final = history_entry(step, opt.local_epoch, losses, tokens_total, tx_bytes() - tx_round, started)
    history.append({**final, "final": True})
    tensors = {f"local/{n}": p.detach() for n, p in model.named_parameters()}
    meta = dict(step=step, run_id=run_id, run=m.name, path=[0] * m.model.n_levels,
                outer_round=opt.local_epoch, tokens_total=tokens_total, history=history)  # fmt: skip
    save_checkpoint(args.checkpoint_dir, tensors, meta, keep=1)
    logger.info(f"done: {step} steps, epoch {opt.local_epoch}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.torch_threads)
    m, record = load_verified_manifest(args.manifest_path)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # a plain hivemind DHT: hivemind.Optimizer signs its progress records with the process-wide key,
    # which pathswarm's start_dht (a key of its own) would not vouch for, so no peer would see another
    dht = hivemind.DHT(
        initial_peers=args.initial_peers or None,
        host_maddrs=args.host_maddrs,
        nat_port_map=False,
        start=True,
    )
    opt = None
    try:
        model = PathModel(m.model, (0,) * m.model.n_levels, seed=m.seed)
        opt = make_optimizer(args, m, record.run_id, dht, model)
        train(args, m, record.run_id, dht, opt, model, stop)
    finally:
        if opt is not None:
            opt.shutdown()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
