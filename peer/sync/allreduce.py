"""hivemind's butterfly all-reduce with three changes pathswarm needs.

1. **Every part from another peer is validated before it touches the sum**: it must decode, have the
   exact shape of the part, be finite, stay under a norm bound, and come with a weight in
   (0, MAX_WEIGHT]. A bad part is counted by reason and its sender is banned from this reducer's
   parts (hivemind's ban: the sender is left out of what this reducer averages).
2. **Every holder ends with the identical average.** hivemind returns to each sender the quantised
   difference between the average and *that sender's* part, while the reducer keeps its exact
   average, so with a lossy codec each holder gets a different result and the holders' global
   copies walk apart round after round. Here the reducer quantises the average once, sends that same
   message to every sender and uses its decoded value itself: all holders apply bit-identical parts.
3. **Nothing fails silently**: a part that could not be averaged (reducer gone, bad reply) is counted
   in `failed_numel`, so the caller knows the round is partial instead of finding out by drift; bytes
   sent and received are counted from the serialized messages.

Counters are shared-memory values because the runner lives in the averager's process while the
trainer reads them in the main process.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner
from hivemind.averaging.partition import BannedException
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

from peer.faults import fault_point

logger = logging.getLogger(__name__)

MAX_WEIGHT = 1e12
BAD_PART_REASONS = ("shape", "dtype", "nonfinite", "norm", "weight")


class PartRejected(ValueError):
    """A part from another peer failed validation; `reason` is one of BAD_PART_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def check_part(part: Any, shape: torch.Size, weight: float, max_norm: float) -> torch.Tensor:
    """The part as float32 if it may be averaged, else PartRejected naming the reason."""
    if not isinstance(part, torch.Tensor) or part.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise PartRejected("dtype", f"got {getattr(part, 'dtype', type(part))}")
    if part.shape != shape:
        raise PartRejected("shape", f"got {tuple(part.shape)}, expected {tuple(shape)}")
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise PartRejected("weight", f"weight {weight!r} outside (0, {MAX_WEIGHT:g}]")
    part = part.float()
    if not torch.isfinite(part).all():
        raise PartRejected("nonfinite", "NaN or inf values")
    if max_norm > 0 and float(part.norm()) > max_norm:
        raise PartRejected("norm", f"L2 norm {float(part.norm()):.3g} exceeds {max_norm:g}")
    return part


class _CountingStub:
    """Counts the bytes of the averaged parts a reducer sends back to us."""

    def __init__(self, stub: Any, counters: dict):
        self._stub, self._counters = stub, counters

    async def rpc_aggregate_part(self, inputs):
        stream = await self._stub.rpc_aggregate_part(inputs)

        async def counted():
            async for msg in stream:
                _add(self._counters["received"], msg.ByteSize())
                yield msg

        return counted()


def _add(counter: Any, n: int) -> None:
    with counter.get_lock():
        counter.value += n


class SymmetricAllReduceRunner(AllReduceRunner):
    """hivemind's butterfly all-reduce, validating parts and giving every holder one average."""

    def __init__(self, *args, counters: dict, max_part_norm: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self._counters = counters
        self._max_part_norm = max_part_norm
        self._codec = self.tensor_part_container.compression
        # part index -> (the one serialized average every sender receives, its decoded value)
        self._averaged: dict[int, tuple[Any, torch.Tensor]] = {}
        self._averaged_lock = asyncio.Lock()

    def _get_peer_stub(self, peer):
        return _CountingStub(super()._get_peer_stub(peer), self._counters)

    async def _quantized_average(self, part_index: int, average: torch.Tensor):
        async with self._averaged_lock:
            if part_index not in self._averaged:
                loop = asyncio.get_event_loop()
                serialized = await loop.run_in_executor(None, lambda: _serialize(self._codec, average))
                self._averaged[part_index] = (serialized, deserialize_torch_tensor(serialized).float())
            return self._averaged[part_index]

    async def _generate_input_for_peer(self, peer_index: int):
        async for msg in super()._generate_input_for_peer(peer_index):
            _add(self._counters["sent"], msg.ByteSize())
            yield msg

    async def _communicate_with_peer(self, peer_id):
        peer_index = self.ordered_peer_ids.index(peer_id)
        container = self.tensor_part_container
        try:
            if peer_id == self.peer_id:
                await self._reduce_own_parts(peer_index)
            else:
                await self._send_and_receive(peer_id, peer_index)
        except BaseException as e:
            if isinstance(e, Exception):
                logger.debug(f"parts for {peer_id} were not averaged: {e!r}")
            before = container.failed_size
            container.register_failed_reducer(peer_index)
            _add(self._counters["failed_numel"], container.failed_size - before)
            raise

    async def _reduce_own_parts(self, peer_index: int) -> None:
        sender_index = self.sender_peer_ids.index(self.peer_id)
        for part_index, part in enumerate(self.parts_for_local_averaging):
            average = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, part, weight=self.weight
            )
            _, decoded = await self._quantized_average(part_index, average)
            self.tensor_part_container.register_processed_part(peer_index, part_index, decoded - part)

    async def _send_and_receive(self, peer_id, peer_index: int) -> None:
        container = self.tensor_part_container
        own_parts = [part for part, _info in container._input_parts_by_peer[peer_index]]
        done_sending = asyncio.Event()
        inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
        stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
        if self.should_delay_results(self.peer_id):
            await done_sending.wait()
        part_index = 0

        def decode(msg):
            if msg.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
            return deserialize_torch_tensor(msg.tensor_part)

        async for averaged in amap_in_executor(
            decode, aiter_with_timeout(stream, self.reducer_timeout), max_prefetch=container.prefetch
        ):
            if part_index >= len(own_parts):
                raise AllreduceException(f"{peer_id} sent more parts than we gave it")
            own = own_parts[part_index]
            averaged = check_part(averaged, own.shape, 1.0, 0.0)
            container.register_processed_part(peer_index, part_index, averaged - own)
            part_index += 1
        if part_index != container.num_parts_by_peer[peer_index]:
            raise AllreduceException(
                f"{peer_id} sent {part_index} of {container.num_parts_by_peer[peer_index]} parts"
            )

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        part_index = 0
        shapes = self.tensor_part_reducer.part_shapes
        try:

            async def counted():
                async for msg in stream:
                    _add(self._counters["received"], msg.ByteSize())
                    fault_point("allreduce.reduce_part")
                    yield msg

            async for part, weight in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight),
                counted(),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if part_index >= len(shapes):
                    raise PartRejected("shape", "more parts than this reducer holds")
                try:
                    part = check_part(part, shapes[part_index], weight, self._max_part_norm)
                except PartRejected as e:
                    _add(self._counters[f"bad_{e.reason}"], 1)
                    logger.warning(f"dropped a part from {self.sender_peer_ids[sender_index]}: {e}")
                    raise
                try:
                    average = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=weight
                    )
                except BannedException:
                    break
                part_index += 1
                serialized, _ = await self._quantized_average(part_index - 1, average)
                reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                _add(self._counters["sent"], reply.ByteSize())
                yield reply
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


def _serialize(codec, tensor: torch.Tensor):
    return codec.compress(tensor, CompressionInfo.from_tensor(tensor))
