"""Counts the DHT's RPCs by method and key in every Python process that starts with this folder on
PYTHONPATH and PATHSWARM_DHT_RPC_LOG set to a folder (benchmarks/dht_rpc_bytes_report.py reads it).

hivemind's DHT protocol serves three RPCs (ping, store, find); each process that serves them writes,
every few seconds, `<pid>.json` in that folder: "method:key id prefix" -> [calls, request bytes,
reply bytes] (serialized protobuf sizes, as sent). Only the serving side counts, so each RPC of the
swarm is counted once. Without PATHSWARM_DHT_RPC_LOG nothing is imported or wrapped.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

_FOLDER = os.environ.get("PATHSWARM_DHT_RPC_LOG")

if _FOLDER:
    # the handlers' annotations are strings naming these: hivemind resolves them in our globals
    from hivemind.dht import protocol
    from hivemind.p2p import P2PContext  # noqa: F401
    from hivemind.proto import dht_pb2  # noqa: F401

    _stats: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    _last_write = [0.0]

    def _write() -> None:
        if time.monotonic() - _last_write[0] < 2.0:
            return
        _last_write[0] = time.monotonic()
        path = os.path.join(_FOLDER, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(dict(_stats), f)
        os.replace(path + ".tmp", path)

    def _wrap(name: str) -> None:
        served = getattr(protocol.DHTProtocol, name)

        async def counted(self, request, context):
            reply = await served(self, request, context)
            keys = [bytes(k).hex()[:16] for k in getattr(request, "keys", [])] or ["-"]
            for key in keys:  # a request for several keys is split between them evenly
                entry = _stats[f"{name}:{key}"]
                entry[0] += 1
                entry[1] += request.ByteSize() // len(keys)
                entry[2] += reply.ByteSize() // len(keys)
            _write()
            return reply

        counted.__annotations__ = dict(served.__annotations__)  # hivemind registers handlers by them
        counted.__name__ = served.__name__
        setattr(protocol.DHTProtocol, name, counted)

    os.makedirs(_FOLDER, exist_ok=True)
    for _name in ("rpc_ping", "rpc_store", "rpc_find"):
        _wrap(_name)
