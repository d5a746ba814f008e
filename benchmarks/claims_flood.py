"""Flooding a run's claim shards and measuring what a lookup of one shard really carries.

Shared by `benchmarks.claims_scale` and the flood tests (tests/test_claim_shards.py and others):

* `flooder`: a real hivemind DHT node that signs each record with the key of the owner it is stored
  under (`ManyOwners`), so one process publishes the claims of thousands of keys as their own nodes
  would — the stores, the signature checks and the storage caps on the receiving nodes are real;
* `FloodSwarm`: two storage nodes of a run, a flooder and a reader, shut down together;
* `reply_sizes`: one `rpc_find` of a key to each node the asker knows nearest to it (or to given
  nodes), as hivemind's own lookups send it, with the serialized size of every reply and how many
  records it held.
"""

from __future__ import annotations

from functools import partial

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.proto import dht_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from benchmarks.monitor_cost import ManyOwners
from dht.validators import RecordSchemaValidator

#: the benchmark's own nodes wait longer than hivemind's 3 s for an RPC: on a loaded machine a node
#: that misses 3 s is dropped from the asker's routing table, and lookups then miss its records
LOOPBACK = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, start=True, wait_timeout=15.0)


def flooder(keys: list[RSAPrivateKey], schema: RecordSchemaValidator, peers: list[str], **kw) -> hivemind.DHT:
    """A DHT node that stores records under any of `keys`' owner subkeys, signed by that key."""
    return hivemind.DHT(initial_peers=peers, record_validators=[ManyOwners(keys), schema], **LOOPBACK, **kw)


def storage_node(schema: RecordSchemaValidator, initial_peers: list[str] | None = None, **kw) -> hivemind.DHT:
    """A DHT node that stores and serves the run's records under `schema` (its caps included)."""
    validators = [RSASignatureValidator(RSAPrivateKey()), schema]
    return hivemind.DHT(initial_peers=initial_peers, record_validators=validators, **LOOPBACK, **kw)


class FloodSwarm:
    """Two storage nodes of a run (`schema`), a flooder signing for `keys`, and a reader in client
    mode; all shut down at exit."""

    def __init__(self, schema: RecordSchemaValidator, keys: list[RSAPrivateKey]):
        self.nodes = [storage_node(schema)]
        peers = [str(m) for m in self.nodes[0].get_visible_maddrs()]
        self.nodes.append(storage_node(schema, peers))
        self.flooder = flooder(keys, schema, peers)
        self.reader = storage_node(schema, peers, client_mode=True)
        self.nodes += [self.flooder, self.reader]

    def __enter__(self) -> FloodSwarm:
        return self

    def __exit__(self, *exc) -> None:
        for node in self.nodes:
            node.shutdown()


async def _replies(key: str, timeout: float, peers: list | None, _dht, node) -> list[tuple[int, list[dict]]]:
    key_id = DHTID.generate(source=key)
    protocol = node.protocol
    if peers is None:
        peers = [p for _, p in protocol.routing_table.get_nearest_neighbors(key_id, k=protocol.bucket_size)]
    out = []
    for peer_id in peers:
        request = dht_pb2.FindRequest(keys=[key_id.to_bytes()], peer=protocol.node_info)
        try:
            response = await protocol.get_stub(peer_id).rpc_find(request, timeout=timeout)
        except Exception:  # a node that cannot answer sends no reply to measure
            continue
        result = response.results[0]
        records = []
        if result.type == dht_pb2.FOUND_DICTIONARY:
            for _, item in MSGPackSerializer.loads(result.value).items():
                signed = item.value if isinstance(item.value, bytes) else bytes(item.value)
                records.append(MSGPackSerializer.loads(RSASignatureValidator._SIGNATURE_RE.sub(b"", signed)))
        out.append((response.ByteSize(), records))
    return out


def reply_sizes(
    dht: hivemind.DHT, key: str, peers: list | None = None, timeout: float = 30.0
) -> list[tuple[int, int]]:
    """(bytes, records) of each reply to a lookup of `key` asked of `peers` (hivemind PeerIDs; by
    default the nodes `dht` knows nearest to the key)."""
    return [(size, len(records)) for size, records in reply_records(dht, key, peers, timeout)]


def reply_records(
    dht: hivemind.DHT, key: str, peers: list | None = None, timeout: float = 30.0
) -> list[tuple[int, list[dict]]]:
    """As `reply_sizes`, with the records of each reply decoded (their signatures stripped)."""
    return dht.run_coroutine(partial(_replies, key, timeout, peers))
