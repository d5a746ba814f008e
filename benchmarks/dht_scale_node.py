"""One light node of the DHT scale benchmark (benchmarks/dht_scale.py): a real DHT node doing a peer's
DHT work and nothing else.

It starts a pathswarm DHT node (`dht.node.start_dht`: our validators, the pipe fix), then every
`--heartbeat_seconds` publishes its signed claim and reads the run's claim view exactly as a peer's
membership heartbeat does (`peer.swarm.claims.publish_claim`, `ClaimView`). No model, no training.
Each read is written to `--events` as one JSON line (time, ids seen, seconds the read took). Every
RPC the node's DHT process sends (`DHTProtocol.call_find/call_store/call_ping`) is counted inside
that process and written to `--counts` every second. On SIGTERM it publishes a leaving claim, as a
departing peer does, and exits.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import hivemind
from hivemind.dht.protocol import DHTProtocol

from dht import records
from dht.keys import claim_shards
from dht.node import start_dht
from dht.schema import ClaimRecord
from peer.model.grid import ModelConfig, path_from_index, path_module_ids
from peer.swarm.claims import ClaimView, publish_claim

CALLS = ("call_find", "call_store", "call_ping")
_counts: Counter[str] = Counter()


def _count_calls() -> None:
    """Wraps the DHT protocol's outgoing RPCs; the DHT process is forked from this one, so it
    inherits the wrappers."""
    for name in CALLS:
        original = getattr(DHTProtocol, name)

        @functools.wraps(original)
        async def counted(self, *args, __original=original, __name=name, **kwargs):
            _counts[__name] += 1
            return await __original(self, *args, **kwargs)

        setattr(DHTProtocol, name, counted)


def _write_counts_in_the_dht_process(path: Path) -> None:
    """Makes the DHT process (where the RPCs happen) write its counts to `path` every second."""
    run = hivemind.DHT.run

    def run_and_report(self, *args, **kwargs):
        def report() -> None:
            while True:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"t": time.time(), **_counts}))
                os.replace(tmp, path)
                time.sleep(1.0)

        threading.Thread(target=report, daemon=True).start()
        return run(self, *args, **kwargs)

    hivemind.DHT.run = run_and_report


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--initial_peers", nargs="*", default=[])
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--run_name", required=True)
    p.add_argument("--run_id", required=True)
    p.add_argument("--client_mode", action="store_true")
    p.add_argument("--heartbeat_seconds", type=float, default=5.0)
    p.add_argument("--events", type=Path, required=True)
    p.add_argument("--counts", type=Path, required=True)
    p.add_argument("--address_file", type=Path, default=None, help="write this node's maddrs here")
    p.add_argument("--startup_timeout_seconds", type=float, default=30.0)
    p.add_argument(
        "--hivemind_defaults",
        action="store_true",
        help="search beams of hivemind's default width and every record validated in full on arrival "
        "(pathswarm before it remembered validations and narrowed its beams)",
    )
    args = p.parse_args()
    if args.hivemind_defaults:
        records.SEARCH_BEAM_SIZE = None  # store_record and read_records then use hivemind's default
    _count_calls()
    _write_counts_in_the_dht_process(args.counts)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    dht, key = start_dht(
        initial_peers=args.initial_peers,
        client_mode=args.client_mode,
        run_name=args.run_name,
        run_id=args.run_id,
        startup_timeout_seconds=args.startup_timeout_seconds,
        remember_validations=not args.hivemind_defaults,
    )
    if args.address_file is not None:
        args.address_file.write_text(json.dumps([str(m) for m in dht.get_visible_maddrs()]))
    cfg = ModelConfig(n_levels=2, modules_per_level=2)
    path = args.index % cfg.n_paths
    peer_id = str(dht.peer_id)
    claim = ClaimRecord(
        peer_id=peer_id,
        path=path,
        modules=path_module_ids(cfg, path_from_index(cfg, path)),
        client_mode=args.client_mode,
    )
    view = ClaimView(args.run_name, args.run_id, claim_shards(cfg.n_paths))
    with open(args.events, "a") as events:
        events.write(json.dumps({"t": time.time(), "started": peer_id}) + "\n")
        events.flush()
        while not stop.is_set():
            began = time.time()
            stored = publish_claim(dht, key, args.run_name, args.run_id, claim)
            seen = view.update(dht)
            took = time.time() - began
            events.write(
                json.dumps({"t": time.time(), "seen": sorted(seen), "stored": stored, "seconds": took})
            )
            events.write("\n")
            events.flush()
            stop.wait(max(0.0, args.heartbeat_seconds - took))
        publish_claim(dht, key, args.run_name, args.run_id, claim.model_copy(update={"leaving": True}))
        events.write(json.dumps({"t": time.time(), "left": peer_id}) + "\n")
    dht.shutdown()


if __name__ == "__main__":
    main()
