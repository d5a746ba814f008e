"""A training peer built on stock `hivemind.Optimizer` (local updates), the baseline of benchmarks/wan.py.

It trains exactly what a pathswarm peer on path 0 of the run trains: the run's model from the run
seed, the run's data shard and batch shape, the same inner AdamW with its cosine schedule and
clipping. Instead of pathswarm's outer sync it hands the parameters to `hivemind.Optimizer` with
`use_local_updates=True`: every step is a local AdamW step, and once the swarm has processed
`target_batch_size` samples (peers × batch × H, about H steps each) the peers average their
parameters in fp32 (hivemind's delayed state averaging with the delta rule; the next local step
waits for the round). Configured as hivemind's guide says for this setting: `matchmaking_time` 5 s
("3-5s for small local runs": four peers on one bridge), `averaging_timeout` about twice a whole
averaging step, state averaged every epoch. Two changes to stock hivemind: an epoch ends on samples
only, not also on its wall-clock ETA (see `_ready_by_samples`), and after the last step the peers
average once more if the swarm's epochs (which end a few steps past each H: progress reaches the
DHT late) came to fewer than DiLoCo's steps / H syncs, so both end on the same number of syncs and
peer 0's model is an average, like DiLoCo's global copy (`final_average`).

Each averaging round's matchmaking and all-reduce are timed in the averager process
(`_timed`, around `Matchmaking.look_for_group` and `_aggregate_with_group`) and land in the
history entry of the epoch they average, as `matchmaking_seconds`, `allreduce_seconds`,
`sync_seconds` and `group_size`. Its checkpoints hold the peer's parameters as `local/...` and a
history in the same format as a pathswarm peer's, so the benchmark reads both the same way.

    python -m benchmarks.wan.hivemind_peer --manifest_path M --initial_peers ... --host_maddrs ...
        --index 0 --peers 4 --max_steps 200 --batch_size 8 --checkpoint_dir D
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads steal shared cores

import hivemind
import torch
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

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
DONE_KEY = "wan_hivemind_done"


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

#: where the averager process appends one JSON line per timed phase; set by `main` before the
#: optimizer forks its averager process, which inherits it
PHASES_FILE: Path | None = None


def _epoch_of(gather_bytes: bytes) -> int:
    """The epoch a state-averaging round is for: TrainingStateAverager gathers its local_epoch
    (already incremented for the new epoch) inside the averager's [bandwidth, mode, data] triple."""
    return int(MSGPackSerializer.loads(MSGPackSerializer.loads(gather_bytes)[2]))


def _record(phase: str, epoch_of, group_size_of, start: float) -> None:
    """Appends one timed phase to PHASES_FILE; a failure here is logged, never raised into hivemind."""
    try:
        line = dict(phase=phase, epoch=epoch_of(), start=start, end=time.time(), group_size=group_size_of())
        with PHASES_FILE.open("a") as f:
            f.write(json.dumps(line) + "\n")
    except Exception as e:
        logger.warning(f"could not record {phase}: {e!r}")


def _timed(phase: str, epoch_of, group_size_of):
    """Wraps an async method of the averager process to append {phase, epoch, start, end, group_size}
    to PHASES_FILE, also when the phase fails (a retried matchmaking counts towards its round)."""

    def wrap(method):
        @functools.wraps(method)
        async def timed(self, arg, *args, **kwargs):
            start, result = time.time(), None
            try:
                result = await method(self, arg, *args, **kwargs)
                return result
            finally:
                if PHASES_FILE is not None:
                    _record(phase, lambda: epoch_of(self, arg), lambda: group_size_of(result), start)

        return timed

    return wrap


# matchmaking: from the round's start until its group is assembled (nothing of the payload has moved)
Matchmaking.look_for_group = _timed(
    "matchmaking",
    lambda self, step: _epoch_of(step.data_for_gather),
    lambda group: len(group.peer_ids) if group is not None else 0,
)(Matchmaking.look_for_group)
# all-reduce: the payload (butterfly all-reduce of the parameters in fp32)
DecentralizedAverager._aggregate_with_group = _timed(
    "allreduce",
    lambda self, group: _epoch_of(group.gathered[group.peer_ids.index(self._p2p.peer_id)]),
    lambda gathered: len(gathered) if gathered is not None else 0,
)(DecentralizedAverager._aggregate_with_group)


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
    # hivemind's guide: "3-5s for small local runs, 10-15s for training over the internet or with many
    # peers"; and "averaging_timeout: around 2x the actual time it takes to run all-reduce"
    p.add_argument("--matchmaking_time", type=float, default=5.0)
    p.add_argument("--averaging_timeout", type=float, default=30.0)
    p.add_argument("--wait_timeout", type=float, default=300.0)
    return p.parse_args(argv)


def tx_bytes() -> int:
    """Bytes this network namespace has sent on eth0 (the lab's veth); 0 outside a lab."""
    try:
        return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())
    except OSError:
        return 0


def barrier(
    dht: hivemind.DHT, key: str, index: int, value, n: int, timeout: float, stop
) -> dict[int, object]:
    """Waits until `n` peers stored a value under `key` (or the timeout passes); returns them by peer
    index. At the start it plays pathswarm's --wait_for_peers: everyone starts training together."""
    deadline = time.monotonic() + timeout
    values: dict[int, object] = {}
    while not stop.is_set():
        dht.store(key, subkey=index, value=value, expiration_time=get_dht_time() + 60)
        found = dht.get(key, latest=True)
        if found is not None and isinstance(found.value, dict):
            values = {int(k): v.value for k, v in found.value.items()}
        if len(values) >= n or time.monotonic() > deadline:
            logger.info(f"{key}: {len(values)} of {n} peers")
            break
        time.sleep(0.5)
    return values


def make_optimizer(args: argparse.Namespace, m, run_id: str, dht, model: PathModel) -> hivemind.Optimizer:
    betas = (m.inner.beta1, m.inner.beta2)
    return hivemind.Optimizer(
        dht=dht,
        run_id=f"wan_{run_id[:12]}",
        target_batch_size=args.peers * args.batch_size * m.sync.inner_steps,
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


def final_average(args: argparse.Namespace, m, run_id: str, dht, opt, stop) -> None:
    """DiLoCo makes steps / H syncs, the last right after the last step, and is scored by that average.
    hivemind's epochs end a few steps past each H (progress reaches the DHT late), so its swarm can
    reach the last step one average short; then every peer averages once more. All peers post their
    epoch first and decide on the same values, so they all join that round or none does."""
    opt.state_averager.step(wait_for_delayed_updates=True)  # the round in flight lands first
    key = f"{DONE_KEY}_{run_id[:12]}"
    epochs = barrier(dht, key, args.index, opt.local_epoch, args.peers, args.averaging_timeout, stop)
    if stop.is_set() or max([opt.local_epoch, *epochs.values()]) >= args.max_steps // m.sync.inner_steps:
        return
    logger.info(f"epoch {opt.local_epoch} after the last step: one more average")
    opt.state_averager.step(
        increment_epoch=True,
        averaging_round=True,
        delay_averaging=False,
        averaging_opts=dict(timeout=args.averaging_timeout),
    )


def sync_timings(path: Path) -> dict[int, dict]:
    """Each averaging round's phases as timed in the averager process, by the epoch they average:
    matchmaking (all attempts), all-reduce, the whole sync from its start to its end, group size."""
    rounds: dict[int, dict] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        phase = json.loads(line)
        r = rounds.setdefault(phase["epoch"], dict(matchmaking=0.0, allreduce=0.0, start=phase["start"],
                                                   end=phase["end"], group_size=0))  # fmt: skip
        r[phase["phase"]] += phase["end"] - phase["start"]
        r["start"], r["end"] = min(r["start"], phase["start"]), max(r["end"], phase["end"])
        if phase["phase"] == "matchmaking":
            r["group_size"] = phase["group_size"]
    return {
        epoch: dict(
            matchmaking_seconds=r["matchmaking"],
            allreduce_seconds=r["allreduce"],
            sync_seconds=[r["end"] - r["start"]],
            group_size=r["group_size"],
        )
        for epoch, r in rounds.items()
    }


def attach_timings(history: list[dict], timings: dict[int, dict]) -> None:
    """Puts each round's timings into the first entry of its epoch (the entry written when the epoch
    began is the one whose sync this is)."""
    seen: set[int] = set()
    for entry in history:
        if entry["round"] in timings and entry["round"] not in seen:
            entry.update(timings[entry["round"]])
            seen.add(entry["round"])


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
    barrier(dht, f"{READY_KEY}_{run_id[:12]}", args.index, True, args.peers, args.wait_timeout, stop)
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
    final_average(args, m, run_id, dht, opt, stop)
    final = history_entry(step, opt.local_epoch, losses, tokens_total, tx_bytes() - tx_round, started)
    history.append({**final, "final": True})
    if PHASES_FILE is not None:
        attach_timings(history, sync_timings(PHASES_FILE))
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
    global PHASES_FILE
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    PHASES_FILE = args.checkpoint_dir / "averaging_phases.jsonl"
    PHASES_FILE.unlink(missing_ok=True)
    stop = threading.Event()
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
        # only now: the DHT and averager processes hivemind forked above must keep SIGTERM's default,
        # or its shutdown's "terminating it the hard way" would only set this flag in them and a
        # child stuck on a dead pipe would hold the peer's exit until the driver kills the group
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        train(args, m, record.run_id, dht, opt, model, stop)
    finally:
        if opt is not None:
            opt.shutdown()
        dht.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
