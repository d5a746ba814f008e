"""Measuring what the scheduler needs: compute, memory, and links to a sample of other peers.

Compute is a short timed forward/backward of the path model (later the training loop's own
tokens/s); memory is free accelerator memory (or free RAM on a CPU). Links are measured over
hivemind's P2P with a handler of our own (`pathswarm_probe`): the minimum round trip of a few tiny
calls is the latency, and a download of PROBE_BYTES the bandwidth. At most `max_links` peers are
probed per cycle, chosen by a hash of (our id, cycle), so the work per peer stays bounded however
large the swarm. Results go into the DHT as a signed `ProbeRecord`.

`--probe_file` replaces the measurements by given values (tests and benchmarks inject link
profiles with it); such a record says so in `injected`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import hivemind
import psutil
import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import ValidationError

from dht.keys import PROBE_TTL_SECONDS, probes_key
from dht.p2p_handler import P2PHandler
from dht.records import read_records, store_record
from dht.schema import ProbeRecord
from peer.errors import ConfigError
from peer.model.transformer import PathModel
from peer.seeding import stable_seed

logger = logging.getLogger(__name__)

HANDLER = "pathswarm_probe"
PROBE_BYTES = 1 << 20
MAX_PROBE_BYTES = 4 << 20  # a request for more is answered with nothing


def measure_tokens_per_second(
    model: PathModel, batch_size: int, seq_len: int, device, steps: int = 3
) -> float:
    """Timed forward/backward passes on random tokens (no optimizer state is touched)."""
    tokens = torch.randint(0, model.cfg.vocab_size, (batch_size, seq_len + 1), device=device)
    model.zero_grad(set_to_none=True)
    model.loss(tokens).backward()  # warm-up
    started = time.perf_counter()
    for _ in range(steps):
        model.loss(tokens).backward()
    elapsed = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return steps * batch_size * seq_len / max(elapsed, 1e-9)


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


class ProbeService:
    """Serves and runs link probes over a P2P replica, on an event loop in a background thread."""

    def __init__(self, dht: hivemind.DHT):
        # a replica of its own: the sync service shuts the DHT's cached replica down first, and a
        # cleanup on it then waited out its 5 s timeout on every peer's exit
        self._handler = P2PHandler(dht, HANDLER, self._serve, "probes")
        self._p2p = self._handler.p2p

    def _call(self, coro, timeout: float):
        return self._handler.call(coro, timeout)

    @staticmethod
    async def _serve(request: runtime_pb2.Tensor, context: P2PContext) -> runtime_pb2.Tensor:
        size = int(request.size[0]) if request.size else 0
        return runtime_pb2.Tensor(buffer=b"\0" * size if 0 <= size <= MAX_PROBE_BYTES else b"")

    async def _measure(self, peer: PeerID, timeout: float) -> tuple[float, float]:
        rtts = []
        for _ in range(3):
            started = time.perf_counter()
            await asyncio.wait_for(
                self._p2p.call_protobuf_handler(
                    peer, HANDLER, runtime_pb2.Tensor(size=[1]), runtime_pb2.Tensor
                ),
                timeout,
            )
            rtts.append(time.perf_counter() - started)
        latency = min(rtts)
        started = time.perf_counter()
        reply = await asyncio.wait_for(
            self._p2p.call_protobuf_handler(
                peer, HANDLER, runtime_pb2.Tensor(size=[PROBE_BYTES]), runtime_pb2.Tensor
            ),
            timeout,
        )
        transfer = max(time.perf_counter() - started - latency, 1e-6)
        if len(reply.buffer) != PROBE_BYTES:
            raise ValueError(f"probe reply of {len(reply.buffer)} bytes, asked for {PROBE_BYTES}")
        # one round trip is latency; the rest moved PROBE_BYTES
        return latency / 2, PROBE_BYTES / transfer

    def measure_links(self, peers: list[str], timeout: float = 10.0) -> dict[str, tuple[float, float]]:
        links = {}
        for peer in peers:
            try:
                links[peer] = self._call(self._measure(PeerID.from_base58(peer), timeout), timeout * 5)
            except Exception as e:
                # a peer that left is still in the claim view until its claim expires: not news
                logger.debug(f"link probe to {peer} failed: {type(e).__name__}: {e}")
        return links

    def shutdown(self) -> None:
        self._handler.shutdown()


def sample_peers(candidates: list[str], me: str, cycle: int, max_links: int) -> list[str]:
    others = sorted(p for p in set(candidates) if p != me)
    return sorted(others, key=lambda p: stable_seed(me, cycle, p))[:max_links]


def load_probe_file(path: Path, me: str) -> ProbeRecord | None:
    """Injected measurements for this peer from a JSON file: {"tokens_per_second": {peer: x},
    "memory_bytes": {peer: x}, "links": {peer: {other: [latency_s, bandwidth_Bps]}}}."""
    try:
        data = json.loads(Path(path).read_text())
        links = {k: [float(a), float(b)] for k, (a, b) in data.get("links", {}).get(me, {}).items()}
        return ProbeRecord(
            peer_id=me,
            tokens_per_second=float(data.get("tokens_per_second", {}).get(me, 1.0)),
            memory_bytes=int(data.get("memory_bytes", {}).get(me, 1 << 34)),
            links=links,
            injected=True,
        )
    except (OSError, ValueError, TypeError, ValidationError) as e:
        raise ConfigError(f"cannot read probe file {path}: {str(e).splitlines()[0]}") from e


def publish_probe(
    dht: hivemind.DHT, key: RSAPrivateKey, run_name: str, run_id: str, record: ProbeRecord
) -> bool:
    return store_record(dht, probes_key(run_name, run_id), key, record, PROBE_TTL_SECONDS)


def live_probes(dht: hivemind.DHT, run_name: str, run_id: str) -> dict[str, ProbeRecord]:
    return {r.peer_id: r for r, _ in read_records(dht, probes_key(run_name, run_id), ProbeRecord)}
