"""Claims at scale, and a live run under a flood of keys: `python -m benchmarks.claims_scale --out DIR`.

Two halves, both on real hivemind DHT nodes in their own processes:

* **scale** (benchmarks/claims_scale_store.py): `--claims` claims (100,000) over the claim shards of
  a `--grid` run (4x4: 256 paths, 256 shards) in `--storage_nodes` nodes' storage; a peer's reads of
  the shards it needs, the monitor's full poll, the largest reply on the wire;
* **flood** (benchmarks/claims_scale_flood.py): a live two-peer run's tokens/s while `--flood_keys`
  fresh keys (10,000) publish claims into its shard, over the window before: an invite run (`flood`,
  the headline) and an open run, where the keys are newcomers on probation (`flood_open`).

Writes DIR/claims_scale.json, DIR/claims_scale.md and DIR/claims_scale.png. The full run takes about
15 minutes on two cores; `--claims 2000 --flood_keys 200 --flood_window_seconds 20` is a 3-minute
smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from multiprocessing import Pool
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.claims_scale_flood import measure_flood
from benchmarks.claims_scale_store import measure_scale
from dht.keys import MAX_CLAIM_BYTES, MAX_CLAIMS_PER_SHARD, claim_shards
from peer.config import RunManifest
from peer.model.grid import ModelConfig
from peer.run.record import sign_manifest

#: hivemind's limit on one message (p2p daemon's persistent connections)
MESSAGE_LIMIT_BYTES = 4 * 1024 * 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.claims_scale", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--claims", type=int, default=100_000, help="claims stored in the scale half")
    p.add_argument("--grid", default="4x4", help="levels x modules per level of the scale half's run")
    p.add_argument("--storage_nodes", type=int, default=3)
    p.add_argument("--read_repeats", type=int, default=3, help="a peer's reads timed (p95 over them)")
    p.add_argument("--population_ttl_seconds", type=float, default=1800.0)
    p.add_argument("--flood_keys", type=int, default=10_000, help="fresh keys publishing into the live run")
    p.add_argument("--flood_window_seconds", type=float, default=60.0, help="each of before and during")
    p.add_argument("--warmup_seconds", type=float, default=20.0)
    p.add_argument("--heartbeat_seconds", type=float, default=5.0, help="the live run's peers' (the default)")
    p.add_argument("--run_start_timeout_seconds", type=float, default=240.0)
    p.add_argument("--run_inner_steps", type=int, default=10, help="the live run's H (inner steps a round)")
    args = p.parse_args(argv)
    try:
        levels, k = (int(x) for x in args.grid.lower().split("x"))
        args.model = ModelConfig(
            d_model=32, n_heads=2, d_ff=64, max_seq_len=64, n_levels=levels, modules_per_level=k
        )
    except ValueError as e:
        p.error(f"--grid {args.grid!r}: give LxK, e.g. 4x4 ({str(e).splitlines()[0]})")
    if args.claims < 1 or args.flood_keys < 1:
        p.error("--claims and --flood_keys must be at least 1")
    return args


def _key(bits: int) -> RSAPrivateKey:
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    return key  # pickled back to the parent (RSAPrivateKey has __getstate__)


def _flood_rows(f: dict, run: str) -> list[tuple[str, str]]:
    return [
        (f"flood, {run}: fresh keys publishing",
         f"{f['keys']:,} ({f['stores_acknowledged']:,} stores acknowledged)"),
        (f"flood, {run}: run tokens/s before / during / after",
         "{tokens_per_second_before} / {tokens_per_second_during} / {tokens_per_second_after}".format(**f)),
        (f"flood, {run}: run_tokens_ratio (during / before; during / mean of before and after)",
         f"{f['run_tokens_ratio']} ({f['run_tokens_ratio_both_ends']})"),
        (f"flood, {run}: cores used before, run / publishers", "{run} / {flood}".format(**f["cores_before"])),
        (f"flood, {run}: cores used during, run / publishers", "{run} / {flood}".format(**f["cores_during"])
         + f" (of {f['machine_cores']}; publishers at {f.get('attacker_priority', 'equal priority')})"),
        (f"flood, {run}: watcher reads that saw both admitted peers", str(f["honest_seen_during_flood"])),
    ]  # fmt: skip


def table(result: dict) -> str:
    s, f = result["scale"], result["flood"]
    rows = [
        ("claims in the storage nodes", f"{s['claims']:,} distinct (published {s['claims_published']:,}; "
         f"each node {min(s['claims_held_per_node']):,} to {max(s['claims_held_per_node']):,})"),
        ("shards / storage nodes / owner keys", f"{s['shards']} / {s['storage_nodes']} / {s['owner_keys']}"),
        ("a peer's read of its shards, p95", f"{s['read_seconds_p95']} s ({s['read_shards']} shards, "
         f"{s['claims_in_peer_view']:,} claims in view)"),
        (f"a reader of {s['module']} only, p95",
         f"{s['module_read_seconds_p95']} s ({s['module_read_shards']} shards)"),
        ("the monitor's poll", f"{s['monitor_seconds']} s ({s['monitor_claims_read']:,} claims read, "
         f"{s['monitor_dht_reads']} DHT reads)"),
        ("largest reply on the wire", f"{s['message_bytes_max']:,} bytes (limit {MESSAGE_LIMIT_BYTES:,})"),
    ]  # fmt: skip
    rows += _flood_rows(f, "invite run") + _flood_rows(result["flood_open"], "open run")
    lines = ["| measure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]
    return "\n".join(lines) + f"\n\nCommand: `{result['command']}` ({result['seconds']:.0f} s)\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, f = result["scale"], result["flood"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["peer read\n(p95)", f"{s['module']} read\n(p95)", "monitor\npoll"]
    a.bar(names, [s["read_seconds_p95"], s["module_read_seconds_p95"], s["monitor_seconds"]])
    a.set_ylabel("seconds")
    a.set_title(f"{s['claims']:,} claims in {s['shards']} shards")
    o = result["flood_open"]
    windows = ("before", "during", "after")
    xs = [f"{run}\n{w}" for run in ("invite", "open") for w in windows]
    ys = [r[f"tokens_per_second_{w}"] for r in (f, o) for w in windows]
    b.bar(xs, ys, color=["C0", "C1", "C0"] * 2)
    b.set_ylabel("run tokens/s")
    b.set_title(
        f"{f['keys']:,} fresh keys publishing: ratio {f['run_tokens_ratio']} / {o['run_tokens_ratio']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    shards = len(claim_shards(args.model.n_paths))
    owners = math.ceil(args.claims / shards)
    with Pool(2) as pool:
        keys = pool.map(_key, [2048] * owners)
        flood_keys = pool.map(_key, [1024] * args.flood_keys)
    took = time.perf_counter() - started
    print(f"{owners} owner keys and {len(flood_keys)} flood keys in {took:.0f} s", flush=True)
    creator = RSAPrivateKey()
    m = RunManifest(name="claimsscale", model=args.model, seq_len=32)
    scale = measure_scale(args, creator, m, sign_manifest(m, creator), keys)
    print(f"scale: {scale}", flush=True)
    flood = measure_flood(args, args.out / "flood_run", flood_keys, "invite")
    print(f"flood (invite run): {flood}", flush=True)
    flood_open = measure_flood(args, args.out / "flood_open_run", flood_keys, "open")
    print(f"flood (open run): {flood_open}", flush=True)
    command = "python -m benchmarks.claims_scale " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        **{k: scale[k] for k in ("claims", "read_seconds_p95", "monitor_seconds", "message_bytes_max")},
        "flood": flood, "flood_open": flood_open, "scale": scale,
        "max_claims_per_shard": MAX_CLAIMS_PER_SHARD,
        "max_claim_bytes": MAX_CLAIM_BYTES, "message_limit_bytes": MESSAGE_LIMIT_BYTES,
        "command": command, "seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    (args.out / "claims_scale.json").write_text(json.dumps(result, indent=1))
    md = table(result)
    (args.out / "claims_scale.md").write_text(md)
    plot(result, args.out / "claims_scale.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
