"""What watching a run costs the monitor: `python -m benchmarks.monitor_cost --out DIR`.

Two measurements, side by side in one run:

* **pipeline** (100, 1,000, 10,000 simulated peers): fully populated `ClaimRecord`s of a 2x8 grid (64
  paths, 4 fragments per module) as the DHT would hand them over (dicts): parse them, keep one per
  peer under `MAX_CLAIMS_PER_SHARD` per claim shard, build the view, publish it, render `/metrics`,
  the status JSON and the page. Everything a poll does except the network.
* **dht** (100, 1,000 and 10,000 peers by default): the same claims stored in a real local hivemind
  DHT, each signed by its own 2048-bit RSA key (as every peer's is), and read by the monitor's real
  `SwarmPoller.poll()` from a second, client-mode node: DHT reads per poll and the poll's wall time.
  Generating 10,000 keys takes 10+ minutes on two cores; give smaller `--dht_sizes` for a quick run.

Writes DIR/monitor_cost.json, DIR/monitor_cost.md and DIR/monitor_cost.png.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from multiprocessing import Pool
from pathlib import Path

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from prometheus_client import generate_latest

from dht.identity import peer_id_of_key
from dht.keys import MAX_CLAIM_TTL_SECONDS, MAX_CLAIMS_PER_SHARD, claim_shard, claim_shards, claims_key
from dht.schema import ClaimRecord, ManifestRecord
from dht.validators import RecordSchemaValidator
from monitoring.swarm.exporter import SwarmCollector, make_registry
from monitoring.swarm.page import render_page
from monitoring.swarm.poller import SwarmPoller
from monitoring.swarm.status import status_dict
from monitoring.swarm.view import build_view, select_claims
from peer.config import RunManifest
from peer.model.grid import ModelConfig, all_paths, path_module_ids
from peer.run.record import sign_manifest

GRID = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64, n_levels=2, modules_per_level=8)
RUN = "monitorcost"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.monitor_cost", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sizes", default="100,1000,10000", help="simulated peers for the pipeline")
    p.add_argument(
        "--dht_sizes",
        default="100,1000,2000,3000,4096,6000,10000",
        help="claims stored in a real DHT, in steps",
    )
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args(argv)


def fake_peer_id(rng: random.Random) -> str:
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    return "Qm" + "".join(rng.choice(alphabet) for _ in range(44))


def claim_for(peer_id: str, i: int, rng: random.Random) -> ClaimRecord:
    paths = all_paths(GRID)
    path = i % len(paths)
    modules = path_module_ids(GRID, paths[path])
    rounds = rng.randint(100, 110)
    return ClaimRecord(
        peer_id=peer_id, path=path, modules=modules, step=rounds * 50, outer_round=rounds,
        tokens_total=rounds * 50 * 2048, tokens_per_second=rng.uniform(500, 5000), ready=i % 10 != 0,
        digests={m: f"{rng.getrandbits(256):064x}" for m in modules},
        module_rounds={m: [rounds - rng.randint(0, 2) for _ in range(4)] for m in modules},
        software_version="0.1.0", reachability=rng.choice(["direct", "relay"]), loss=rng.uniform(2, 4),
        sync_outcomes={"averaged": rounds * 3, "alone": 2, "failed": rng.randint(0, 3)},
        bad_parts={"norm": rng.randint(0, 1)}, bytes_sent=rounds * 10**6, bytes_received=rounds * 10**6,
    )  # fmt: skip


def manifest() -> tuple[RunManifest, ManifestRecord]:
    m = RunManifest(name=RUN, model=GRID, seq_len=32)
    return m, sign_manifest(m, RSAPrivateKey())  # the poller checks admissions against its creator key


def time_pipeline(n: int, repeats: int) -> dict:
    rng = random.Random(n)
    dicts = [claim_for(fake_peer_id(rng), i, rng).model_dump() for i in range(n)]
    value_bytes = sum(len(MSGPackSerializer.dumps(d)) for d in dicts)
    m, record = manifest()
    best: dict[str, float] = {}
    for _ in range(repeats):
        t = {"start": time.perf_counter()}
        records = [(ClaimRecord.model_validate(d), 1e12) for d in dicts]
        t["parse"] = time.perf_counter()
        view = build_view(RUN, record.run_id, GRID, select_claims(records))
        t["view"] = time.perf_counter()
        collector = SwarmCollector(100)
        collector.publish(view, 0.0, 2)
        metrics = generate_latest(make_registry(collector))
        t["metrics"] = time.perf_counter()
        page = render_page(status_dict(view, []))
        t["page"] = time.perf_counter()
        stages = list(t)
        for a, b in zip(stages, stages[1:], strict=False):
            best[b] = min(best.get(b, 1e9), t[b] - t[a])
    return {
        "peers": n, "claims_in_view": len(view.peers), "capped": view.claims_capped,
        "claim_value_bytes": value_bytes, "metrics_bytes": len(metrics), "page_bytes": len(page),
        "metrics_series": sum(1 for ln in metrics.decode().splitlines() if ln and not ln.startswith("#")),
        "seconds": {k: round(v, 5) for k, v in best.items()}, "total_seconds": round(sum(best.values()), 5),
    }  # fmt: skip


class ManyOwners(RecordValidatorBase):
    """Signs each claim with its own owner's key (a stand-in for N peers' DHT nodes in one process)."""

    def __init__(self, keys: list[RSAPrivateKey]):
        self.by_owner = {k.get_public_key().to_bytes(): RSASignatureValidator(k) for k in keys}
        self.check = RSASignatureValidator(keys[0])

    def validate(self, record: DHTRecord) -> bool:
        return self.check.validate(record)

    def sign_value(self, record: DHTRecord) -> bytes:
        # the record's subkey is serialized: find the owner's public key inside it, as hivemind does
        owners = RSASignatureValidator._PUBLIC_KEY_RE.findall(record.subkey or b"")
        signer = self.by_owner.get(owners[0]) if owners else None
        return signer.sign_value(record) if signer is not None else record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return self.check.strip_value(record)

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def _key(_: int) -> RSAPrivateKey:
    return RSAPrivateKey()  # pickled back to the parent (RSAPrivateKey has __getstate__)


def time_dht(sizes: list[int], repeats: int) -> dict[int, dict]:
    """One writer node holds the claims of max(sizes) peers, stored in steps; after each step the
    monitor's real poller reads them from a client-mode node `repeats` times."""
    started = time.perf_counter()
    with Pool(2) as pool:
        keys = pool.map(_key, range(max(sizes)))
    keygen = time.perf_counter() - started
    m, record = manifest()
    schema = RecordSchemaValidator(RUN, record.run_id)
    loopback = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, start=True)
    writer = hivemind.DHT(record_validators=[ManyOwners(keys), schema], **loopback)
    reader = None
    out: dict[int, dict] = {}
    try:
        reader = hivemind.DHT(
            initial_peers=[str(a) for a in writer.get_visible_maddrs()], client_mode=True,
            record_validators=[RSASignatureValidator(RSAPrivateKey()), schema], **loopback,
        )  # fmt: skip
        rng, done, ok = random.Random(0), 0, 0
        for n in sorted(sizes):
            stored = time.perf_counter()
            claims = [(k, claim_for(peer_id_of_key(k), done + i, rng)) for i, k in enumerate(keys[done:n])]
            futures = [
                writer.store(claims_key(RUN, record.run_id, claim_shard(c.path)),
                             subkey=RSASignatureValidator(k).local_public_key, value=c.model_dump(),
                             expiration_time=get_dht_time() + MAX_CLAIM_TTL_SECONDS, return_future=True)
                for k, c in claims
            ]  # fmt: skip
            ok += sum(bool(f.result()) for f in futures)
            store_seconds, done = time.perf_counter() - stored, n
            collector = SwarmCollector(100)
            poller = SwarmPoller(reader, m, record, collector)
            polls, seen = [], []
            for _ in range(repeats):
                t = time.perf_counter()
                view = poller.poll()
                polls.append(time.perf_counter() - t)
                seen.append(view.claims_read)
            out[n] = {
                "peers": n, "stored": ok, "claims_read": seen, "claims_in_view": len(view.peers),
                "keygen_seconds_all": round(keygen, 1), "store_seconds_step": round(store_seconds, 2),
                "dht_reads_per_poll": collector.stats.dht_reads // repeats,
                "poll_seconds": round(min(polls), 4), "poll_seconds_all": [round(p, 4) for p in polls],
            }  # fmt: skip
            print(f"dht: {out[n]}", flush=True)
        return out
    finally:
        if reader is not None:
            reader.shutdown()
        writer.shutdown()


def table(result: dict) -> str:
    lines = ["Pipeline (no network): simulated claims handed to the monitor as the DHT would.", "",
             "| peers | claims in view | capped | parse s | view s | /metrics s | page s | pipeline s "
             "| claim bytes per read |",
             "|---:|---:|:-:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in result["pipeline"]:
        s = row["seconds"]
        lines.append(f"| {row['peers']:,} | {row['claims_in_view']:,} | {'yes' if row['capped'] else 'no'} "
                     f"| {s['parse']:.4f} | {s['view']:.4f} | {s['metrics']:.4f} | {s['page']:.4f} "
                     f"| {row['total_seconds']:.4f} | {row['claim_value_bytes']:,} |")  # fmt: skip
    lines += ["", "Real DHT: claims signed by one RSA key each, read by the monitor (best poll).", "",
              "| claims stored | DHT reads per poll | claims the monitor read | peers in its view | poll s |",
              "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for n, d in sorted(result["dht"].items(), key=lambda kv: int(kv[0])):
        read = "/".join(str(x) for x in d["claims_read"])
        lines.append(
            f"| {int(n):,} | {d['dht_reads_per_poll']} | {read} | {d['claims_in_view']:,} "
            f"| {d['poll_seconds']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    sizes = [r["peers"] for r in result["pipeline"]]
    ax.loglog(
        sizes, [r["total_seconds"] for r in result["pipeline"]], "o-", label="pipeline (parse, view, render)"
    )
    # only polls that read every stored claim: past the DHT's message limit the read fails and the
    # reader is left with its last good copy, whose timing would say nothing about the size
    dht = sorted(
        (int(k), v["poll_seconds"]) for k, v in result["dht"].items() if min(v["claims_read"]) == int(k)
    )
    if dht:
        ax.loglog(*zip(*dht, strict=True), "s-", label="real poll (DHT get + pipeline), all claims read")
        failed = [int(k) for k, v in result["dht"].items() if min(v["claims_read"]) < int(k)]
        if failed:
            ax.axvspan(
                min(failed), max(failed), color="red", alpha=0.1, label="DHT read of the claims key fails"
            )
    kept = MAX_CLAIMS_PER_SHARD * len(claim_shards(GRID.n_paths))
    ax.axvline(kept, color="grey", ls="--", label=f"MAX_CLAIMS_PER_SHARD x shards = {kept}")
    ax.set_xlabel("peers with a live claim")
    ax.set_ylabel("seconds per poll")
    ax.set_title("pathswarm monitor: cost of one poll")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    pipeline = [time_pipeline(int(n), args.repeats) for n in args.sizes.split(",")]
    dht = time_dht([int(x) for x in args.dht_sizes.split(",") if x], args.repeats) if args.dht_sizes else {}
    result: dict = {"pipeline": pipeline, "dht": {str(k): v for k, v in dht.items()},
                    "max_claims_per_shard": MAX_CLAIMS_PER_SHARD}  # fmt: skip
    (args.out / "monitor_cost.json").write_text(json.dumps(result, indent=1))
    md = table(result)
    (args.out / "monitor_cost.md").write_text(md)
    plot(result, args.out / "monitor_cost.png")
    print(md)


if __name__ == "__main__":
    main()
