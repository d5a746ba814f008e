"""The scale half of `benchmarks.claims_scale`: a run's claims by the hundred thousand in real DHT
storage, and what reading them costs a peer and the monitor.

Storage nodes are hivemind DHT processes with the run's validator (every cap of a run: claim bytes,
owner key, fields, module ids, shard, `MAX_CLAIMS_PER_SHARD` per shard), two client-mode publishers
store realistic claims (module digests and fragment rounds, 16 path_steps entries, an admission
token) signed by 2048-bit keys, through hivemind's own stores. A key claims one path in each shard,
so `ceil(claims / shards)` keys publish the population (generating 100,000 keys takes hours on two
cores). The population is published once with a lifetime of `--population_ttl_seconds`: a run's
peers renew their own claims every heartbeat, spread over as many machines; one two-core machine
cannot sign 100,000 claims a minute. Every other cap is the run's.

Measured: the distinct claims the storage nodes hold (`claims`, read from their storage; a store
reaches a node only if its RPC does not time out, so each node holds most, not all), a peer's reads
of the shards it needs (`ClaimView.of_run`: every shard, because every path shares the trunk) and of one level
module's shards, the monitor's full poll (`SwarmPoller.poll`), and every reply's size on the wire
(`rpc_find` to each node, per shard).
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from functools import partial

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.claims_flood import LOOPBACK, flooder, reply_sizes, storage_node
from dht.identity import peer_id_of_key
from dht.keys import claim_shard, claim_shards, claims_key
from dht.schema import ClaimRecord, ManifestRecord
from dht.validators import RecordSchemaValidator, RememberedValidation
from monitoring.swarm.exporter import SwarmCollector
from monitoring.swarm.poller import SwarmPoller
from peer.config import RunManifest
from peer.model.grid import TRUNK, ModelConfig, path_from_index, path_module_ids
from peer.run.admission import AdmissionCheck, sign_admission
from peer.swarm.claims import ClaimView, shards_through

#: records per hivemind store call of a publisher: hivemind sends one request per key and node, so
#: at about 2.4 KiB per signed claim a request stays under 2.5 MiB even when a batch is one shard
STORE_BATCH = 1024


def realistic_claim(key: RSAPrivateKey, token: str, cfg: ModelConfig, path: int, rng: random.Random) -> dict:
    """A claim as a peer some hundred rounds into a run publishes it, all optional fields filled."""
    modules = path_module_ids(cfg, path_from_index(cfg, path))
    rounds = rng.randint(100, 110)
    return ClaimRecord(
        peer_id=peer_id_of_key(key), path=path, modules=modules, step=rounds * 50, outer_round=rounds,
        tokens_total=rounds * 50 * 2048, tokens_per_second=rng.uniform(500, 5000),
        digests={m: f"{rng.getrandbits(256):064x}" for m in modules},
        module_rounds={m: [rounds - rng.randint(0, 2) for _ in range(4)] for m in modules},
        software_version="0.9.0", reachability="direct", loss=rng.uniform(2, 4),
        sync_outcomes={"averaged": rounds * 3, "alone": 2}, bad_parts={"norm": 1},
        bytes_sent=rounds * 10**6, bytes_received=rounds * 10**6,
        path_steps={str(rng.randrange(cfg.n_paths)): rng.randint(1, 10**5) for _ in range(16)},
        admission=token,
    ).model_dump()  # fmt: skip


async def store_batch(items: list, _dht, node) -> int:
    keys, subkeys, values, expirations = (list(x) for x in zip(*items, strict=True))
    result = await node.store_many(keys, values, expirations, subkeys=subkeys)
    return sum(bool(ok) for ok in result.values())  # by (key, subkey)


def publish_population(
    publishers: list[hivemind.DHT], owners: list[tuple[RSAPrivateKey, str]], m: RunManifest, run_id: str,
    claims: int, ttl: float,
) -> tuple[int, float]:  # fmt: skip
    """Stores `claims` claims (owner i claims path j*len(owners)+i ... one per shard); (stored, seconds)."""
    rng, shards = random.Random(0), len(claim_shards(m.model.n_paths))
    items, subkeys = [], [RSASignatureValidator(key).local_public_key for key, _ in owners]
    for n in range(claims):
        key, token = owners[n // shards]
        path = (n % shards) + shards * rng.randrange(max(1, m.model.n_paths // shards))
        record = realistic_claim(key, token, m.model, path, rng)
        items.append((claims_key(m.name, run_id, claim_shard(path)), subkeys[n // shards], record, 0.0))
    # a batch holds whole shards: hivemind sends one store request per key and node, so a shard's
    # claims go in one request instead of one request per batch that touches the shard
    items.sort(key=lambda item: item[0])
    started, stored, pending = time.perf_counter(), 0, []
    for i in range(0, len(items), STORE_BATCH):
        expiry = get_dht_time() + ttl
        batch = [(k, s, v, expiry) for k, s, v, _ in items[i : i + STORE_BATCH]]
        publisher = publishers[(i // STORE_BATCH) % len(publishers)]
        pending.append(publisher.run_coroutine(partial(store_batch, batch), return_future=True))
        if len(pending) >= 2 * len(publishers):
            stored += pending.pop(0).result()
    stored += sum(f.result() for f in pending)
    return stored, time.perf_counter() - started


async def _held(keys: list[str], _dht, node) -> set[bytes]:
    """What a storage node holds under `keys`: a short digest of each (key, owner) pair."""
    out = set()
    for key in keys:
        item = node.protocol.storage.get(DHTID.generate(source=key))
        if item is not None and hasattr(item.value, "items"):
            out.update(
                hashlib.blake2b(key.encode() + s, digest_size=8).digest() for s, _ in item.value.items()
            )
    return out


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def measure_scale(args, creator: RSAPrivateKey, m: RunManifest, record: ManifestRecord, keys: list) -> dict:
    """The scale half's numbers (see the module docstring)."""
    run_id, shards = record.run_id, list(claim_shards(m.model.n_paths))
    check = AdmissionCheck.of(record)
    ttl = args.population_ttl_seconds
    schema = RecordSchemaValidator(
        m.name, run_id, max_ttl_seconds=ttl + 60, admitted=check.admitted, max_claim_ttl_seconds=ttl + 60
    )
    owners = [(k, sign_admission(creator, run_id, peer_id_of_key(k), "invite")) for k in keys]
    nodes: list[hivemind.DHT] = []
    try:
        nodes.append(storage_node(schema))
        peers = [str(a) for a in nodes[0].get_visible_maddrs()]
        nodes += [storage_node(schema, peers) for _ in range(args.storage_nodes - 1)]
        publishers = [flooder(keys, schema, peers, client_mode=True) for _ in range(2)]
        nodes += publishers
        stored, store_seconds = publish_population(publishers, owners, m, run_id, args.claims, ttl)
        names = [claims_key(m.name, run_id, s) for s in shards]
        sets = [node.run_coroutine(partial(_held, names)) for node in nodes[: args.storage_nodes]]
        held = [len(s) for s in sets]
        print(
            f"scale: {stored} stores acknowledged in {store_seconds:.0f} s; held per node {held}", flush=True
        )
        # a peer's node: client mode, remembering validations as start_dht's nodes do
        validators = [RememberedValidation([RSASignatureValidator(RSAPrivateKey()), schema])]
        reader = hivemind.DHT(initial_peers=peers, client_mode=True, record_validators=validators, **LOOPBACK)
        nodes.append(reader)
        view = ClaimView.of_run(m, record)
        module = ClaimView(m.name, run_id, shards_through(m.model, ["l0m0"]), check.admitted)
        reads, module_reads, seen = [], [], 0
        view.update(reader)  # a peer reads every heartbeat: its first read (opening connections) untimed
        for _ in range(args.read_repeats):
            t = time.perf_counter()
            seen = len(view.update(reader))
            reads.append(time.perf_counter() - t)
            t = time.perf_counter()
            module.update(reader)
            module_reads.append(time.perf_counter() - t)
        collector = SwarmCollector(100)
        t = time.perf_counter()
        polled = SwarmPoller(reader, m, record, collector).poll()
        monitor_seconds = time.perf_counter() - t
        storers = [node.peer_id for node in nodes[: args.storage_nodes]]
        replies = [size for name in names for size, _ in reply_sizes(reader, name, storers)]
        return {
            "claims": len(set().union(*sets)), "claims_held_per_node": held, "claims_published": args.claims,
            "stores_acknowledged": stored, "publish_seconds": round(store_seconds, 1),
            "owner_keys": len(keys), "shards": len(shards), "storage_nodes": args.storage_nodes,
            "grid": f"{m.model.n_levels}x{m.model.modules_per_level}",
            "read_seconds_p95": round(p95(reads), 3), "read_seconds": [round(r, 3) for r in reads],
            "read_shards": len(view.shards), "claims_in_peer_view": seen,
            "module_read_seconds_p95": round(p95(module_reads), 3),
            "module_read_shards": len(module.shards), "module": "l0m0",
            "monitor_seconds": round(monitor_seconds, 3), "monitor_claims_read": polled.claims_read,
            "monitor_peers_in_view": len(polled.peers), "monitor_dht_reads": collector.stats.dht_reads,
            "message_bytes_max": max(replies, default=0), "replies_measured": len(replies),
            "population_ttl_seconds": ttl,
            "trunk_reads_every_shard": shards_through(m.model, [TRUNK]) == shards,
        }  # fmt: skip
    finally:
        for node in nodes:
            node.shutdown()
