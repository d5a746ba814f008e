"""Averaging one module's outer gradient with the module's other holders, through hivemind.

`ModuleAverager` is a hivemind `DecentralizedAverager` (matchmaking + butterfly all-reduce in its own
process) over a module's outer-gradient buffers. It adds what pathswarm needs around hivemind:

* byte counters of what actually went over the wire (read back by the main process for metrics);
* state sharing of the module's global copy and outer momentum, so late joiners can download it;
* `average_outer_gradient`, which also all-gathers a checksum of every member's input (weighted
  random-sign projections) and checks the result against it. hivemind's reducer silently keeps a
  peer's own values for parts it failed to receive (e.g. its 8-bit codecs under numpy >= 2.4); the
  checksum turns such a partial average into a detected failure instead of silent drift.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.compression import (
    CompressionBase,
    Float16Compression,
    NoCompression,
    deserialize_torch_tensor,
)
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import as_aiter, azip
from hivemind.utils.streaming import combine_from_streaming

from peer.faults import fault_point

logger = logging.getLogger(__name__)

CODECS: dict[str, tuple[Callable[[], CompressionBase], float]] = {
    # codec name -> (hivemind compression, relative rounding error of one element)
    "fp32": (NoCompression, 1e-6),
    "fp16": (Float16Compression, 1e-3),
}
N_CHECKSUM_PROJECTIONS = 2


@dataclass
class RoundResult:
    """What one averaging attempt produced. `delta` is the averaged outer gradient, or the peer's
    own when the group did not form or the average failed its checksum."""

    outcome: str  # "averaged" | "alone" | "partial" | "failed"
    delta: list[torch.Tensor]
    group_size: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    detail: str = ""
    #: set when this peer's global copy disagreed with the group's majority before the round: after
    #: applying the round, download the module's state from one of these peers; the value is the
    #: module round the donor's state has once it applied this round too
    repair_from: dict[str, int] = field(default_factory=dict)


def fingerprints_match(a: Sequence[float], b: Sequence[float], rel: float = 1e-5) -> bool:
    if len(a) != len(b) or not a:
        return False
    tolerance = rel * max(abs(a[-1]), abs(b[-1])) + 1e-9
    return all(abs(x - y) <= tolerance for x, y in zip(a, b, strict=True))


def majority_of(members: dict[str, dict]) -> list[str]:
    """Peers whose pre-round global copy agrees with the largest group of agreeing copies; ties go
    to the group holding the smallest peer id, so every member computes the same answer."""
    clusters: list[list[tuple[str, list[float]]]] = []
    for peer, meta in sorted(members.items()):
        fp = meta.get("fingerprint") if isinstance(meta, dict) else None
        if not isinstance(fp, list) or not fp or not all(isinstance(x, (int, float)) for x in fp):
            continue
        for cluster in clusters:
            if fingerprints_match(cluster[0][1], fp):
                cluster.append((peer, fp))
                break
        else:
            clusters.append([(peer, fp)])
    if not clusters:
        return []
    best = min(clusters, key=lambda c: (-len(c), min(p for p, _ in c)))
    return [p for p, _ in best]


class _CountingStub:
    """Wraps a peer stub so the averaged parts a reducer returns are counted as received bytes."""

    def __init__(self, stub: Any, counter: Any):
        self._stub, self._counter = stub, counter

    async def rpc_aggregate_part(self, inputs):
        stream = await self._stub.rpc_aggregate_part(inputs)

        async def counted():
            async for msg in stream:
                with self._counter.get_lock():
                    self._counter.value += msg.ByteSize()
                yield msg

        return counted()


class CountingAllReduceRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce, counting the serialized bytes it sends and receives."""

    def __init__(self, *args, sent_counter: Any, received_counter: Any, **kwargs):
        super().__init__(*args, **kwargs)
        self._sent, self._received = sent_counter, received_counter

    def _add(self, counter: Any, n: int) -> None:
        with counter.get_lock():
            counter.value += n

    def _get_peer_stub(self, peer):
        return _CountingStub(super()._get_peer_stub(peer), self._received)

    async def _generate_input_for_peer(self, peer_index: int):
        async for msg in super()._generate_input_for_peer(peer_index):
            self._add(self._sent, msg.ByteSize())
            yield msg

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        async def counted():
            async for msg in stream:
                self._add(self._received, msg.ByteSize())
                fault_point("allreduce.reduce_part")
                yield msg

        async for reply in super()._accumulate_parts_streaming(counted(), sender_index):
            self._add(self._sent, reply.ByteSize())
            yield reply


class ModuleAverager(DecentralizedAverager):
    """Averages the outer gradient of one module (or module fragment) among its holders."""

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        dht,
        *,
        prefix: str,
        codec: str | CompressionBase = "fp32",
        state_provider: Callable[[], tuple[dict, list[torch.Tensor]]] | None = None,
        checksum_seed: int = 0,
        **kwargs,
    ):
        if isinstance(codec, CompressionBase):  # a hivemind codec given directly (tests, experiments)
            compression, self.codec_error = codec, 1e-2
        elif codec in CODECS:
            factory, self.codec_error = CODECS[codec]
            compression = factory()
        else:
            raise ValueError(f"unknown codec {codec!r}; choose one of {sorted(CODECS)}")
        buffers = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
        self.shapes = [tuple(s) for s in shapes]
        self._state_provider = state_provider
        self._bytes_sent = mp.Value(ctypes.c_int64, 0)
        self._bytes_received = mp.Value(ctypes.c_int64, 0)
        generator = torch.Generator().manual_seed(checksum_seed)
        # Random +-1 signs: a partial average changes these projections unless the parts coincide.
        self._signs = [
            torch.randint(
                0,
                2,
                (N_CHECKSUM_PROJECTIONS, int(torch.Size(s).numel())),
                generator=generator,
                dtype=torch.int8,
            )
            .mul_(2)
            .sub_(1)
            for s in shapes
        ]
        super().__init__(
            buffers,
            dht,
            prefix=prefix,
            compression=compression,
            state_compression=NoCompression(),
            allow_state_sharing=state_provider is not None,
            **kwargs,
        )

    # --- hivemind hooks -------------------------------------------------------------------------

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        # Same as hivemind's, but with a runner that counts bytes on the wire.
        group_id = group_info.group_id if group_id is None else group_id
        runner = CountingAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            sent_counter=self._bytes_sent,
            received_counter=self._bytes_received,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()
        else:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")

    def get_current_state(self):
        """Runs in the host process when another peer downloads this module's state."""
        metadata, tensors = self._state_provider()
        return metadata, [t.detach().cpu().float().contiguous() for t in tensors], None

    def set_target_group_size(self, size: int) -> None:
        """Lets a group start as soon as every current holder joined, instead of waiting out the
        whole matchmaking window (hivemind fixes the target at construction)."""
        future = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size, future=future)))
        future.result(timeout=30)

    async def _set_target_group_size(self, size: int, future: MPFuture) -> None:
        self._matchmaking.target_group_size = size
        self._matchmaking.potential_leaders.target_group_size = size
        future.set_result(None)

    def download_state(
        self, peers: Sequence[str], timeout: float
    ) -> tuple[str, Any, list[torch.Tensor]] | None:
        """Downloads this module's state from the first of `peers` (base58 ids) that answers with a
        state of the expected size; returns (peer, metadata, tensors) or None. The caller validates
        shapes and values. hivemind's own `load_state_from_peers` picks donors by priority; repairing a
        drifted copy needs a donor from the group's majority instead."""
        future = MPFuture()
        self._outer_pipe.send(
            ("_download_state", [], dict(peers=list(peers), timeout=timeout, future=future))
        )
        return future.result(timeout=timeout * max(1, len(peers)) + 10)

    async def _download_state(self, peers: list[str], timeout: float, future: MPFuture) -> None:
        budget = 2 * sum(4 * int(torch.Size(s).numel()) for s in self.shapes) * 1.05 + (1 << 16)
        try:
            for peer in peers:
                try:
                    result = await asyncio.wait_for(
                        self._download_from(PeerID.from_base58(peer), budget), timeout
                    )
                except Exception as e:
                    logger.warning(f"state download from {peer} failed: {type(e).__name__}: {e}")
                    continue
                if result is not None:
                    future.set_result((peer, *result))
                    return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_from(self, peer: PeerID, budget: float):
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, parts, tensors, received = None, [], [], 0
        async for message in stream:
            received += message.ByteSize()
            if received > budget:
                raise ValueError(f"sent more than the {budget:.0f} bytes this module's state can take")
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        with self._bytes_received.get_lock():
            self._bytes_received.value += received
        return (metadata, tensors) if metadata is not None else None

    # --- used by the trainer --------------------------------------------------------------------

    @property
    def bytes_sent(self) -> int:
        return int(self._bytes_sent.value)

    @property
    def bytes_received(self) -> int:
        return int(self._bytes_received.value)

    def checksum(self, tensors: Sequence[torch.Tensor]) -> list[float]:
        out = [0.0] * N_CHECKSUM_PROJECTIONS
        for t, signs in zip(tensors, self._signs, strict=True):
            flat = t.detach().reshape(-1).double()
            for j in range(N_CHECKSUM_PROJECTIONS):
                out[j] += float(flat @ signs[j].double())
        return out

    def fingerprint(self, tensors: Sequence[torch.Tensor]) -> list[float]:
        """Checksum projections plus the L1 norm: equal copies agree to ~1e-7 of the norm."""
        return self.checksum(tensors) + [float(sum(t.detach().double().abs().sum() for t in tensors))]

    def start_round(
        self,
        delta: Sequence[torch.Tensor],
        weight: float,
        round_index: int,
        timeout: float,
        global_fingerprint: list[float] | None = None,
        module_round: int = 0,
    ):
        """Writes this peer's outer gradient and starts averaging in the background. The gathered
        metadata carries a checksum of Δ (to verify the average) and a fingerprint of the global copy
        before the round (so members whose copy drifted can repair it from the majority)."""
        with self.get_tensors() as buffers:
            for buf, d in zip(buffers, delta, strict=True):
                buf.copy_(d)
        norm = float(torch.sqrt(sum((d.double() ** 2).sum() for d in delta)))
        gather = dict(
            round=round_index,
            weight=float(weight),
            checksum=self.checksum(delta),
            norm=norm,
            fingerprint=list(global_fingerprint or []),
            module_round=int(module_round),
        )
        self._round_started = time.monotonic()
        self._sent0, self._received0 = self.bytes_sent, self.bytes_received
        return self.step(weight=float(weight), gather=gather, timeout=timeout, wait=False, allow_retries=True)

    def finish_round(self, control, delta: Sequence[torch.Tensor], timeout: float) -> RoundResult:
        """Waits for the background average and checks it against the gathered checksums."""
        own = [d.detach().clone() for d in delta]
        try:
            gathered = control.result(timeout=timeout)
        except Exception as e:  # hivemind raises a zoo of errors on a failed group
            gathered, error = None, f"{type(e).__name__}: {e}"
        else:
            error = ""
        seconds = time.monotonic() - self._round_started
        sent, received = self.bytes_sent - self._sent0, self.bytes_received - self._received0
        if not gathered:
            outcome = "failed" if error else "alone"
            return RoundResult(outcome, own, 1, seconds, sent, received, error or "no other holder joined")
        with self.get_tensors() as buffers:
            averaged = [b.detach().clone() for b in buffers]
        members = list(gathered.values())
        problem = self._check_average(averaged, members)
        if problem:
            return RoundResult("partial", own, len(members), seconds, sent, received, problem)
        majority = majority_of({str(pid): m for pid, m in gathered.items()})
        repair = {}
        if majority and str(self.peer_id) not in majority:
            by_peer = {str(pid): m for pid, m in gathered.items()}
            repair = {p: int(by_peer[p].get("module_round", 0)) + 1 for p in majority}
        return RoundResult("averaged", averaged, len(members), seconds, sent, received, repair_from=repair)

    def _check_average(self, averaged: list[torch.Tensor], members: list[dict]) -> str:
        try:
            weights = [float(m["weight"]) for m in members]
            sums = [[float(x) for x in m["checksum"]] for m in members]
            norms = [float(m["norm"]) for m in members]
        except (KeyError, TypeError, ValueError):
            return "a group member sent malformed checksum metadata"
        total = sum(weights)
        if not total > 0:
            return "group weights do not sum to a positive number"
        actual = self.checksum(averaged)
        scale = max(norms) + 1e-12
        for j in range(N_CHECKSUM_PROJECTIONS):
            expected = sum(w * s[j] for w, s in zip(weights, sums, strict=True)) / total
            # codec error per element ~ eps*|x|; a random-sign sum of n such errors ~ eps*||x||.
            tolerance = 20 * self.codec_error * scale + 1e-9
            if abs(actual[j] - expected) > tolerance:
                return (
                    f"averaged result fails its checksum (projection {j}: {actual[j]:.6g} vs expected "
                    f"{expected:.6g}, tolerance {tolerance:.3g}): some parts were not averaged"
                )
        return ""
