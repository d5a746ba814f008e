"""Averaging one module's outer gradient with the module's other holders, through hivemind.

`ModuleAverager` is a hivemind `DecentralizedAverager` (DHT matchmaking + butterfly all-reduce in
its own process) over one flat buffer: a module's outer gradient, or one fragment of it at a time.
Around hivemind it adds:

* `SymmetricAllReduceRunner` (peer/sync/allreduce.py): validated parts, one identical average for every
  holder, explicit counts of failed parts, bytes on the wire;
* an end-to-end check: every member all-gathers a checksum of its input (random-sign projections)
  and the result must agree with their weighted mean, so a partial average is reported, never
  silently applied (hivemind keeps a peer's own values for parts it failed to average, e.g. under
  its 8-bit codecs with numpy >= 2.4);
* drift repair: members also gather a fingerprint of their global copy; a member outside the
  majority downloads the state of a majority member after the round (`download_state`);
* state sharing of the global copy and outer momentum for late joiners.
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
from hivemind.averaging.allreduce import AveragingMode
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression, deserialize_torch_tensor
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import as_aiter, azip
from hivemind.utils.streaming import combine_from_streaming

from peer.codecs.formats import make_codec
from peer.sync.allreduce import BAD_PART_REASONS, SymmetricAllReduceRunner

logger = logging.getLogger(__name__)

N_CHECKSUM_PROJECTIONS = 2


@dataclass
class RoundResult:
    """What one averaging attempt produced. `delta` is the averaged outer gradient, or the peer's
    own when the group did not form or the average failed its checksum."""

    outcome: str  # "averaged" | "alone" | "partial" | "failed"
    delta: torch.Tensor
    group_size: int
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    detail: str = ""
    bad_parts: dict[str, int] = field(default_factory=dict)
    #: peer ids of the group that averaged (empty when this peer went on alone)
    members: list[str] = field(default_factory=list)
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
    """Peers whose pre-round global copy agrees with the largest group of agreeing copies. Ties go
    to the group that has synced the most rounds (the copy that went on while another holder was
    away or joining), then to the smallest peer id: every member computes the same answer."""
    clusters: list[list[tuple[str, list[float], int]]] = []
    for peer, meta in sorted(members.items()):
        fp = meta.get("fingerprint") if isinstance(meta, dict) else None
        if not isinstance(fp, list) or not fp or not all(isinstance(x, (int, float)) for x in fp):
            continue
        rounds = meta.get("module_round", 0)
        rounds = rounds if isinstance(rounds, int) else 0
        for cluster in clusters:
            if fingerprints_match(cluster[0][1], fp):
                cluster.append((peer, fp, rounds))
                break
        else:
            clusters.append([(peer, fp, rounds)])
    if not clusters:
        return []
    best = min(clusters, key=lambda c: (-len(c), -max(r for *_, r in c), min(p for p, *_ in c)))
    return [p for p, *_ in best]


class ModuleAverager(DecentralizedAverager):
    """Averages the outer gradient of one module (or module fragment) among its holders."""

    def __init__(
        self,
        numel: int,
        dht,
        *,
        prefix: str,
        codec: str | CompressionBase = "fp32",
        state_provider: Callable[[], tuple[dict, list[torch.Tensor]]] | None = None,
        checksum_seed: int = 0,
        max_part_norm: float = 0.0,
        state_numel: int | None = None,
        **kwargs,
    ):
        """Averages one flat fp32 buffer of `numel` numbers: a whole module, or its largest fragment
        (fragments of a module sync at different steps, so they take turns in the same buffer)."""
        if isinstance(codec, CompressionBase):  # a hivemind codec given directly (tests, experiments)
            compression, self.codec_error = codec, 1e-2
        else:
            compression, self.codec_error = make_codec(codec)
        self.numel = int(numel)
        # numbers in the shared state (global copy + momentum); bounds what a donor may send us
        self.state_numel = int(state_numel if state_numel is not None else 2 * numel)
        self._state_provider = state_provider
        self._max_part_norm = max_part_norm
        self._counters = {
            name: mp.Value(ctypes.c_int64, 0)
            for name in ("sent", "received", "failed_numel", *(f"bad_{r}" for r in BAD_PART_REASONS))
        }
        generator = torch.Generator().manual_seed(checksum_seed)
        # Random +-1 signs: a partial average changes these projections unless the parts coincide.
        self._signs = (
            torch.randint(0, 2, (N_CHECKSUM_PROJECTIONS, self.numel), generator=generator, dtype=torch.int8)
            .mul_(2)
            .sub_(1)
        )
        # hivemind hands out whole parts to reducers: cut the buffer into ~16 parts so that every
        # member of a group reduces a share (one 512 KiB default part would leave one reducer).
        ratio = compression.estimate_compression_ratio(CompressionInfo.from_tensor(torch.zeros(1)))
        wire_bytes = 4 * self.numel * ratio
        kwargs.setdefault("part_size_bytes", int(min(512 * 1024, max(4096, wire_bytes / 16))))
        # hivemind waits forever for a silent groupmate unless told otherwise
        kwargs.setdefault("sender_timeout", 15.0)
        kwargs.setdefault("reducer_timeout", 30.0)
        super().__init__(
            [torch.zeros(self.numel, dtype=torch.float32)],
            dht,
            prefix=prefix,
            compression=compression,
            state_compression=NoCompression(),
            allow_state_sharing=state_provider is not None,
            **kwargs,
        )

    # --- hivemind hooks -------------------------------------------------------------------------

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        # hivemind's loop, with our runner (validated parts, one identical average, counters)
        group_id = group_info.group_id if group_id is None else group_id
        runner = SymmetricAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            counters=self._counters,
            max_part_norm=self._max_part_norm,
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
        budget = 4 * self.state_numel * 1.05 + (1 << 16)
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
        with self._counters["received"].get_lock():
            self._counters["received"].value += received
        return (metadata, tensors) if metadata is not None else None

    # --- used by the trainer --------------------------------------------------------------------

    def counter(self, name: str) -> int:
        return int(self._counters[name].value)

    @property
    def bytes_sent(self) -> int:
        return self.counter("sent")

    @property
    def bytes_received(self) -> int:
        return self.counter("received")

    def bad_parts(self) -> dict[str, int]:
        return {r: self.counter(f"bad_{r}") for r in BAD_PART_REASONS}

    def checksum(self, flat: torch.Tensor) -> list[float]:
        """Random-sign projections of a flat vector (shorter vectors use the leading signs)."""
        x = flat.detach().reshape(-1).double()
        return [float(x @ self._signs[j, : x.numel()].double()) for j in range(N_CHECKSUM_PROJECTIONS)]

    def fingerprint(self, flat: torch.Tensor) -> list[float]:
        """Checksum projections plus the L1 norm: equal copies agree to ~1e-7 of the norm."""
        return self.checksum(flat) + [float(flat.detach().double().abs().sum())]

    def set_group(
        self, fragment: int, n_fragments: int, subgroup: int | None = None, round_index: int = 0
    ) -> None:
        """Groups form per fragment, and per planned subgroup when a module has many holders: both
        go into hivemind's group key bits, so holders out of phase never average fragment 1 with
        fragment 0, and subgroups of one module never merge. A planned subgroup is one round's: its
        key also carries the round, so a holder a round behind never meets another round's group
        (indices repeat from round to round)."""
        bits = format(fragment, f"0{max(1, (n_fragments - 1).bit_length())}b") if n_fragments > 1 else ""
        if subgroup is not None:
            bits += format(subgroup % 256, "08b") + format(round_index % 16, "04b")
        # Set every round: after each all-reduce hivemind rotates non-empty group bits itself
        # (Moshpit-style), which would scramble fragments and planned subgroups.
        if bits or getattr(self, "_group_bits", ""):
            self.set_group_bits(bits)
        self._group_bits = bits

    def start_round(
        self,
        delta: torch.Tensor,
        weight: float,
        round_index: int,
        timeout: float,
        global_fingerprint: list[float] | None = None,
        module_round: int = 0,
        fragment: int = 0,
    ):
        """Writes this peer's flat outer gradient and starts averaging it in the background. The
        gathered metadata carries a checksum of Δ (to verify the average end to end) and a fingerprint
        of the global copy before the round (so a member whose copy drifted can repair it)."""
        delta = delta.detach().reshape(-1).float()
        if delta.numel() > self.numel:
            raise ValueError(f"outer gradient of {delta.numel()} numbers exceeds the buffer of {self.numel}")
        with self.get_tensors() as (buffer,):
            buffer.zero_()
            buffer[: delta.numel()] = delta
        gather = dict(
            round=round_index,
            fragment=fragment,
            weight=float(weight),
            checksum=self.checksum(delta),
            norm=float(delta.double().norm()),
            fingerprint=list(global_fingerprint or []),
            module_round=int(module_round),
        )
        self._round = dict(
            started=time.monotonic(), n=delta.numel(), fragment=fragment, own=delta.clone(),
            counters={name: self.counter(name) for name in self._counters},
        )  # fmt: skip
        return self.step(weight=float(weight), gather=gather, timeout=timeout, wait=False, allow_retries=True)

    def finish_round(self, control, timeout: float) -> RoundResult:
        """Waits for the background average and checks it: no failed part, same fragment everywhere,
        and the gathered checksums agree with the result."""
        r = self._round
        try:
            gathered = control.result(timeout=timeout)
        except Exception as e:  # hivemind raises a zoo of errors on a failed group
            gathered, error = None, f"{type(e).__name__}: {e}"
        else:
            error = ""
        moved = {name: self.counter(name) - r["counters"][name] for name in self._counters}
        result = dict(
            seconds=time.monotonic() - r["started"],
            bytes_sent=moved["sent"],
            bytes_received=moved["received"],
            bad_parts={k[4:]: v for k, v in moved.items() if k.startswith("bad_") and v},
        )
        own = r["own"]
        if not gathered:
            outcome = "failed" if error else "alone"
            return RoundResult(outcome, own, 1, detail=error or "no other holder joined", **result)
        members = {str(pid): m for pid, m in gathered.items()}
        size = len(members)
        result["members"] = sorted(members)
        if moved["failed_numel"]:
            detail = f"{moved['failed_numel']} of {self.numel} numbers were not averaged (a reducer failed)"
            return RoundResult("partial", own, size, detail=detail, **result)
        if any(not isinstance(m, dict) or m.get("fragment") != r["fragment"] for m in members.values()):
            return RoundResult(
                "failed", own, size, detail="group members synced different fragments", **result
            )
        with self.get_tensors() as (buffer,):
            averaged = buffer[: r["n"]].clone()
        problem = self._check_average(averaged, list(members.values()))
        if problem:
            return RoundResult("partial", own, size, detail=problem, **result)
        majority = majority_of(members)
        repair = {}
        if majority and str(self.peer_id) not in majority:
            repair = {p: int(members[p].get("module_round", 0)) + 1 for p in majority}
        return RoundResult("averaged", averaged, size, repair_from=repair, **result)

    def _check_average(self, averaged: torch.Tensor, members: list[dict]) -> str:
        try:
            weights = [float(m["weight"]) for m in members]
            sums = [[float(x) for x in m["checksum"]] for m in members]
            norms = [float(m["norm"]) for m in members]
        except (KeyError, TypeError, ValueError):
            return "a group member sent malformed checksum metadata"
        total = sum(weights)
        if not total > 0 or not all(len(s) == N_CHECKSUM_PROJECTIONS for s in sums):
            return "group weights or checksums are malformed"
        actual = self.checksum(averaged)
        # Each element carries a codec error of ~eps*|x| on the way in and again on the way back; a
        # random-sign sum of such errors is ~eps*||x||, so a few eps*||x|| is generous.
        tolerance = 6 * self.codec_error * (max(norms) + 1e-12) + 1e-9
        for j in range(N_CHECKSUM_PROJECTIONS):
            expected = sum(w * s[j] for w, s in zip(weights, sums, strict=True)) / total
            if abs(actual[j] - expected) > tolerance:
                return (
                    f"averaged result fails its checksum (projection {j}: {actual[j]:.6g} vs expected "
                    f"{expected:.6g}, tolerance {tolerance:.3g}): some parts were not averaged"
                )
        return ""
