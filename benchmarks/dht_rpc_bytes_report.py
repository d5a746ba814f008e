"""Where a run's DHT bytes go: the RPC counts of benchmarks/dht_rpc_bytes/ by method and record kind.

Run any benchmark or swarm with the counter, then read its folder with the run's manifest:

    PATHSWARM_DHT_RPC_LOG=/tmp/rpc PYTHONPATH=benchmarks/dht_rpc_bytes \\
        python -m benchmarks.wan --out /tmp/wan --configs streaming_sparse --inner_steps 24
    python -m benchmarks.dht_rpc_bytes_report --logs /tmp/rpc \\
        --manifest_path /tmp/wan/streaming_sparse/manifest.json --seconds 95

Prints a table, largest first: calls, request and reply bytes, and bytes per second of the whole
swarm over `--seconds`. Key ids are named by the run's keys (`dht.keys.run_keys`); "other" is
hivemind's own (bucket refreshes), "-" a ping.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from hivemind.dht.routing import DHTID

from dht.keys import run_keys
from peer.run.record import load_record


def totals(logs: Path, names: dict[str, str]) -> dict[tuple[str, str], list[int]]:
    out: defaultdict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for path in sorted(logs.glob("*.json")):
        for label, counts in json.loads(path.read_text()).items():
            method, key = label.split(":")
            entry = out[method, names.get(key, "-" if key == "-" else "other")]
            for i in range(3):
                entry[i] += counts[i]
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--logs", type=Path, required=True, help="the PATHSWARM_DHT_RPC_LOG folder")
    p.add_argument("--manifest_path", type=Path, required=True, help="the run's signed manifest")
    p.add_argument("--seconds", type=float, required=True, help="how long the counted run took")
    args = p.parse_args()
    record = load_record(args.manifest_path)
    name = json.loads(record.manifest_json)["name"]
    names = {
        DHTID.generate(source=k).to_bytes().hex()[:16]: kind
        for kind, k in run_keys(name, record.run_id).items()
    }
    rows = sorted(totals(args.logs, names).items(), key=lambda kv: -(kv[1][1] + kv[1][2]))
    print("| RPC | key | calls | request kB | reply kB | kB/s (swarm) |\n|---|---|---:|---:|---:|---:|")
    for (method, kind), (calls, sent, replied) in rows:
        rate = (sent + replied) / args.seconds / 1e3
        print(f"| {method} | {kind} | {calls} | {sent / 1e3:.1f} | {replied / 1e3:.1f} | {rate:.2f} |")


if __name__ == "__main__":
    main()
