"""How a peer stores its records, over real DHT nodes: on the nodes nearest the key, without carrying
the key's other records back. hivemind's store finds those nodes with finds of the key itself, each
answered with every record under it: a heartbeat's claim store took its whole shard from every node
it asked (the WAN lab's DHT bytes, counted per RPC: benchmarks/dht_rpc_bytes_report.py)."""

from __future__ import annotations

from functools import partial

import pytest
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils import get_dht_time

from dht import records
from dht.identity import peer_id_of_key
from dht.keys import claims_key
from dht.node import owner_subkey
from dht.schema import ClaimRecord
from peer.swarm.claims import live_claims, publish_claim

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]

RUN, RUN_ID = "storing", "c7" * 32


def claim(peer_id: str, outer_round: int = 0) -> ClaimRecord:
    return ClaimRecord(peer_id=peer_id, path=0, modules=["trunk", "l0m0", "l1m0"], outer_round=outer_round)


async def _records_carried_while_storing(store, key: str, subkey: bytes, value: dict, _dht, node) -> tuple:
    """Runs in the DHT process: `store` (a coroutine function of the node) with the node's finds
    counted: how many records their replies carried back."""
    carried = []
    find = node.protocol.call_find

    async def counted(peer, keys):
        reply = await find(peer, keys)
        for value_found, _ in (reply or {}).values():
            if value_found is not None and isinstance(value_found.value, DictionaryDHTValue):
                carried.append(len(value_found.value))
        return reply

    node.protocol.call_find = counted
    try:
        ok = await store(key, subkey, value, get_dht_time() + 30, _dht, node)
    finally:
        node.protocol.call_find = find
    return ok, sum(carried)


async def _hivemind_store(key, subkey, value, expiration, _dht, node):
    return await node.store(key, value, expiration, subkey=subkey, beam_size=records.SEARCH_BEAM_SIZE)


@pytest.mark.parametrize("store", ["ours", "hivemind's"])
def test_a_claim_store_reaches_the_nodes_nearest_its_shard_and_carries_none_of_the_shards_claims_back(
    dht_factory, store
):
    nodes = [dht_factory(run_name=RUN, run_id=RUN_ID) for _ in range(6)]
    for dht, key in nodes:  # six claims in the shard, one per node
        assert publish_claim(dht, key, RUN, RUN_ID, claim(peer_id_of_key(key)))
    (dht, key), (reader, _) = nodes[0], nodes[-1]
    how = records._store_near if store == "ours" else _hivemind_store
    renewed = claim(peer_id_of_key(key), outer_round=7).model_dump()
    shard = claims_key(RUN, RUN_ID, 0)
    ok, carried = dht.run_coroutine(
        partial(_records_carried_while_storing, how, shard, owner_subkey(key), renewed)
    )
    assert ok
    seen = live_claims(reader, RUN, RUN_ID, 1)
    assert len(seen) == 6 and seen[peer_id_of_key(key)].outer_round == 7  # the nearest nodes took it
    if store == "ours":
        assert carried == 0, carried
    else:  # what the store cost before: the shard's claims, from each node its finds asked
        assert carried >= 6, carried
