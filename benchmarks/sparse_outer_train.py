"""One run of `benchmarks.sparse_outer`: the WAN lab's model and data, `peers` replicas trained in one
process, their fragment rounds encoded, aggregated and applied with the project's own parts.

The replicas' inner loop (`peer.offline.simulate.InnerLoop`), fragment schedule
(`peer.sync.fragments`), codecs (their real payloads: the bytes counted are `len(payload)`), error
feedback (`ModuleSync.corrected_outer_gradient` / `settle_feedback`), robust aggregator
(`peer.sync.aggregate`, centered clip) and outer step (`ModuleSync.apply`): every member of a
fragment round encodes its Δ, the group aggregates the decoded parts, τ steps later every member
applies the result — what `peer.sync.outer` does, minus the wire. Deterministic for a seed (one
thread per run).

Documents: the lab's training split less a *validation* split (a hash of each document with a salt
of this benchmark's own, `VALIDATION_FRACTION` of them), which no run trains on; tuning scores on
it, the reported numbers on the run's eval documents (`peer.data.sources.eval_documents`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import time

VALIDATION_FRACTION = 0.05
_VALIDATION_SALT = b"benchmarks.sparse_outer-validation\0"


def is_validation(text: str) -> bool:
    digest = hashlib.sha256(_VALIDATION_SALT + text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < VALIDATION_FRACTION * 2**64


def lab_flags(args: argparse.Namespace) -> list[str]:
    """The WAN lab's model and schedule flags this benchmark passes on (`benchmarks.wan.driver`)."""
    flags = ("steps", "inner_steps", "fragments", "d_model", "blocks")
    return [x for f in flags for x in (f"--{f}", str(getattr(args, f)))]


def make_run_codec(run: dict):
    """The run's codec; a `density` other than the table's (sparse2bit only) is a variant of its spec
    for tuning, never one a swarm could choose."""
    from peer.codecs.formats import ChunkSparse2BitCodec, make_codec
    from peer.codecs.specs import CODEC_SPECS

    density = run.get("density")
    if density is None:
        return make_codec(run["codec"])
    if run["codec"] != "sparse2bit":
        raise ValueError(f"density is tuned for sparse2bit only, not {run['codec']}")
    spec = CODEC_SPECS["sparse2bit"]
    return ChunkSparse2BitCodec(dataclasses.replace(spec, topk=max(1, round(density * spec.block))))


def train(run: dict, args: argparse.Namespace, seed: int, score_on: str) -> dict:
    """One run at one seed (the replicas' initial weights and batch orders). `score_on`: "eval"
    (the reported documents, with a loss curve every `eval_every` rounds) or "validation" (tuning:
    the held-out training documents, at the end only)."""
    import torch

    from benchmarks.wan import report
    from benchmarks.wan.driver import LabTraining
    from peer.config import OuterOptimizerConfig
    from peer.data.sources import eval_documents
    from peer.sync.fragments import fragments_due

    torch.set_num_threads(1)
    lab = LabTraining.load(*lab_flags(args))
    m = lab.manifest
    train_docs = [d for d in lab.train_docs if not is_validation(d)]
    if score_on == "validation":
        docs = [d for d in lab.train_docs if is_validation(d)][: args.eval_docs]
    else:
        docs = eval_documents(m.dataset, limit=args.eval_docs)
    momentum = run["momentum"]
    outer = OuterOptimizerConfig(lr=run["lr"], momentum=momentum, nesterov=momentum > 0)
    P, tau = run.get("fragments", args.fragments), run.get("tau", args.overlap_steps)
    # MuLoCo's runs: Muon inside; a tuned inner lr replaces the lab's
    inner = m.inner.model_copy(
        update={"muon": bool(run.get("muon")), "lr": run.get("inner_lr") or m.inner.lr}
    )
    loops, syncs = _replicas(lab, train_docs, inner, outer, P, seed, args)
    codec = make_run_codec(run)
    codes = RunCodes(run, codec, args.inner_steps, syncs[0])
    decay = args.error_feedback_decay if run.get("decay") is None else run["decay"]  # a tuned run's own
    pending: list[tuple[int, int, dict]] = []
    # `carry` runs: each member's θ_local of a fragment when its Δ was taken, until the round applies
    sent_locals: dict[tuple[str, int], list] = {}
    sent = 0

    def loss_now() -> float:
        global_copy = {k: v for ms in syncs[0].values() for k, v in ms.named_state().items()}
        return report.eval_loss(m, global_copy, "global", docs)

    started, cpu_started = time.monotonic(), time.process_time()
    curve = [dict(round=0, payload_bytes_per_peer=0, loss=loss_now())] if score_on == "eval" else []
    for clock in range(1, args.steps + 1):
        for loop in loops:
            loop.step()
        for fragment in fragments_due(clock, args.inner_steps, P):
            parts = {mid: [] for mid in syncs[0] if syncs[0][mid].fragment_size(fragment)}
            for mid, decoded in parts.items():
                now, vectors = codes.of(mid, fragment, clock)
                for s in syncs:
                    if run.get("carry"):
                        sent_locals.setdefault((mid, fragment), []).append(
                            s[mid].plan.gather(s[mid].local_params, fragment)
                        )
                    payload, part = _send(s[mid], fragment, now, decay, vectors, codes.vector_codec)
                    sent += len(payload)
                    decoded.append(part)
            pending.append((clock + tau, fragment, parts))
        for item in [p for p in pending if p[0] <= clock]:
            pending.remove(item)
            _finish(syncs, item[1], item[2], run["alpha"], sent_locals)
        rounds_done, rest = divmod(clock, args.inner_steps)
        if score_on == "eval" and not rest and rounds_done % args.eval_every == 0 and clock < args.steps:
            curve.append(dict(round=rounds_done, payload_bytes_per_peer=sent // args.peers, loss=loss_now()))
    for item in pending:
        _finish(syncs, item[1], item[2], run["alpha"], sent_locals)
    loss = loss_now()
    rounds = args.steps // args.inner_steps
    curve.append(dict(round=rounds, payload_bytes_per_peer=sent // args.peers, loss=loss))
    values = sum(ms.fragment_size(f) for ms in syncs[0].values() for f in range(ms.n_fragments))
    return dict(
        loss=loss, scored_on=score_on, curve=curve, payload_bytes_per_peer=sent // args.peers,
        wire_bits_per_value_per_round=8 * sent / args.peers / rounds / values, values=values,
        seconds=time.monotonic() - started, cpu_seconds=time.process_time() - cpu_started,
    )  # fmt: skip


def _replicas(lab, train_docs: list, inner, outer, P: int, seed: int, args: argparse.Namespace):
    """Each replica's inner loop and, per module, its `ModuleSync`: the seed sets the initial weights
    (the same for every replica, as a run's manifest does) and each replica's batch order."""
    from peer.model.transformer import PathModel
    from peer.offline.simulate import InnerLoop, document_batches
    from peer.sync.module_sync import ModuleSync

    m = lab.manifest
    loops = []
    for i in range(args.peers):
        model = PathModel(m.model, (0,) * m.model.n_levels, seed=seed)
        batches = document_batches(train_docs, lab.tokenizer, m.seq_len, lab.args.batch_size, 1000 * seed + i)
        loops.append(InnerLoop(model, batches, inner, total_steps=args.steps))
    syncs = [
        {mid: ModuleSync(m.model, mid, part, outer, n_fragments=P) for mid, part in loop.model.parts.items()}
        for loop in loops
    ]
    return loops, syncs


class RunCodes:
    """Which codec sends a module's fragment at a clock step, as a run's options say. The run's codec,
    but: the trunk (embeddings, head, final norm) in `trunk_codec` (MuLoCo keeps embeddings and norms
    out of its 2-bit code); every part in `warm_codec` for the first `warm_rounds` rounds (a precision
    warm-up for the early, large outer gradients: every member knows the round, so sizes stay exact);
    every 1-D parameter (norm weights and gains, biases: MuLoCo's norms) in `vector_codec`."""

    def __init__(self, run: dict, codec, inner_steps: int, modules: dict):
        from peer.codecs.formats import make_codec

        self.codec = codec
        self.trunk_codec = make_codec(run["trunk_codec"]) if run.get("trunk_codec") else codec
        self.warm_codec = make_codec(run["warm_codec"]) if run.get("warm_codec") else None
        self.warm_steps = run.get("warm_rounds", 0) * inner_steps
        self.vector_codec = make_codec(run["vector_codec"]) if run.get("vector_codec") else None
        # where they lie in each fragment depends on the module alone: found once, not every round
        self._vectors = {
            (mid, f): _vectors(ms, f) if self.vector_codec is not None else None
            for mid, ms in modules.items()
            for f in range(ms.n_fragments)
        }

    def of(self, module: str, fragment: int, clock: int):
        """(the codec of the part, the mask of its 1-D parameters' values for `vector_codec` or None)."""
        from peer.model.grid import TRUNK

        now = self.trunk_codec if module == TRUNK else self.codec
        if self.warm_codec is not None and clock <= self.warm_steps:
            now = self.warm_codec
        return now, self._vectors[module, fragment]


def _vectors(ms, fragment: int):
    """Where a fragment's flat vector holds 1-D parameters' values (a bool mask), or None for nowhere."""
    import torch

    mask = torch.zeros(ms.fragment_size(fragment), dtype=torch.bool)
    for piece in ms.plan.pieces[fragment]:
        if len(ms.plan.shapes[piece.param]) == 1:
            mask[piece.offset : piece.offset + piece.stop - piece.start] = True
    return mask if bool(mask.any()) else None


def _send(ms, fragment: int, codec, decay: float, vectors=None, vector_codec=None):
    """What a member puts on the wire for a fragment round, and what the others decode from it; an
    error feedback codec's unsent rest stays with the sender (as `peer.sync.outer` does). Given a
    mask of `vectors`, those values go in `vector_codec` and the rest in `codec`: two payloads."""
    delta = ms.corrected_outer_gradient(fragment, codec, decay)
    if vectors is None:
        payload = codec.encode(delta)
        decoded = codec.decode(payload, delta.numel()).view_as(delta)
    else:
        decoded = delta.clone()
        payload = b""
        for where, code in ((vectors, vector_codec), (~vectors, codec)):
            part = code.encode(delta[where].contiguous())
            decoded[where] = code.decode(part, int(where.sum())).view(-1)
            payload += part
    if codec.spec.error_feedback:
        ms.settle_feedback(fragment, delta, decoded)
    return payload, decoded.numpy()


def _finish(syncs: list[dict], fragment: int, parts: dict, alpha: float, sent_locals: dict) -> None:
    """The group's aggregate of every module's decoded parts, applied by every member."""
    import torch

    from peer.sync.aggregate import AggregatorConfig, Contribution, aggregate

    for mid, decoded in parts.items():
        mean = aggregate([Contribution(f"p{i}", d, 1.0) for i, d in enumerate(decoded)], AggregatorConfig())
        locals_ = sent_locals.pop((mid, fragment), None) or [None] * len(syncs)
        for s, sent_local in zip(syncs, locals_, strict=True):
            s[mid].apply(fragment, torch.from_numpy(mean), alpha, sent_local=sent_local)
