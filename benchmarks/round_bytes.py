"""What one sync round costs each member on the wire, by frame kind, in process.

`n` members, each a real DHT node with its own `SyncService` and `RoundRunner` on loopback, run
rounds of one fragment of `numel` values in `codec`; every frame a member writes is counted by its
kind (the wire module's `write`, wrapped for the run). It is the protocol's own share of a round:
the part (PAYLOAD) against the headers, reports and echoes around it, without the DHT and TCP/IP
that the WAN lab's veth counters add (docs/benchmarks/wan.md).

    python -m benchmarks.round_bytes --members 4 --numel 810000 --codec sparse2bit --rounds 3
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from dht.node import start_dht
from peer.codecs.formats import make_codec
from peer.sync import wire
from peer.sync.aggregate import AggregatorConfig
from peer.sync.inbox import Inbox
from peer.sync.rounds import RoundRunner, RoundSettings
from peer.sync.service import SyncService
from peer.sync.standing import Standing
from peer.sync.wire import Kind

RUN_ID = "cd" * 32
MODULE = "l0m0"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=4)
    p.add_argument("--numel", type=int, default=810_000, help="values of the fragment")
    p.add_argument("--codec", default="sparse2bit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="also write the table as JSON here")
    args = p.parse_args(argv)
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    write = wire.write

    async def counted(writer, *frames: bytes) -> None:
        for f in frames:
            counts[Kind(f[0]).name] += 1
            sizes[Kind(f[0]).name] += len(f)
        await write(writer, *frames)

    wire.write = counted  # the service calls wire.write for every frame it sends
    nodes, services = [], []
    try:
        runners = []
        for _ in range(args.members):
            initial = [str(m) for m in nodes[0].get_visible_maddrs()] if nodes else []
            dht, key = start_dht(initial_peers=initial)
            nodes.append(dht)
            codec = make_codec(args.codec)
            holder = lambda peer, module: True  # noqa: E731 (every member holds the module)
            inbox = Inbox({MODULE: [args.numel]}, codec, holder, 32, 0.0, Standing(None, "open"))
            service = SyncService(dht, RUN_ID, inbox, stream_timeout_seconds=30, key=key)
            services.append(service)
            settings = RoundSettings(30.0, 5.0, AggregatorConfig(method="mean"))
            runners.append(RoundRunner(service, codec, settings))
        ids = [s.peer_id for s in services]
        rows = []
        for r in range(args.rounds):
            counts.clear()
            sizes.clear()
            gens = [torch.Generator().manual_seed(i + 100 * r) for i in range(len(ids))]
            deltas = [torch.randn(args.numel, generator=g) * 1e-3 for g in gens]
            key = (MODULE, 0, r)
            futures = [run.start(key, d, 1.0, ids, "0" * 64) for run, d in zip(runners, deltas, strict=True)]
            results = [f.result(timeout=120) for f in futures]
            row = {
                "round": r,
                "outcomes": [x.outcome for x in results],
                "bytes_sent_per_member": sum(x.bytes_sent for x in results) / len(results),
                "by_kind_per_member": {k: sizes[k] / args.members for k in sorted(sizes)},
                "frames_by_kind": dict(sorted(counts.items())),
            }
            rows.append(row)
            kinds = ", ".join(f"{k} {v / 1e3:.1f} kB" for k, v in row["by_kind_per_member"].items())
            per_member = row["bytes_sent_per_member"] / 1e3
            print(f"round {r}: {row['outcomes']}; the round's tally per member {per_member:.1f} kB ({kinds})")
    finally:
        wire.write = write
        for s in services:
            s.shutdown()
        for dht in nodes:
            dht.shutdown()
    if args.out:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rows}
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
