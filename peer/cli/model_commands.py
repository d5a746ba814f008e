"""`pathswarm eval | generate | export`: what to do with a trained grid, from peers' checkpoints.

`register(subparsers)` adds the subcommands to the main parser and returns their handlers. Every
handler takes the signed manifest file and the checkpoint folders of the peers, rebuilds the grid
from their global copies (`peer.offline.grid_checkpoints`) and needs no swarm. Errors a user can fix
are `ConfigError`s with a one-line message.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from collections import Counter
from pathlib import Path

from peer.cli.common import Handler
from peer.errors import ConfigError

logger = logging.getLogger(__name__)


def register(subparsers) -> dict[str, Handler]:
    e = subparsers.add_parser("eval", help="composite perplexity of a grid from peers' checkpoints, vs dense")
    _source_flags(e)
    e.add_argument("--max_docs", type=int, default=None, help="evaluate at most this many held-out documents")
    e.add_argument(
        "--baseline_steps",
        type=int,
        default=None,
        help="train the dense path-size baseline this many steps (default: one path's steps, the "
        "checkpoints' most; 0: skip)",
    )
    e.add_argument(
        "--swarm_baseline_steps",
        type=int,
        default=None,
        help="and the same dense model this many steps (default: the swarm's steps, all paths' steps "
        "together, as many tokens as the swarm trained on; 0: skip)",
    )
    e.add_argument("--batch_size", type=int, default=None, help="baseline batch size (default: the peers')")
    e.add_argument("--json", type=Path, default=None, help="also write the results here")

    g = subparsers.add_parser("generate", help="sample a continuation from the path the prompt routes to")
    _source_flags(g, required=False)
    g.add_argument("--exported", type=Path, default=None, help="a folder written by `pathswarm export`")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--max_new_tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument(
        "--min_new_tokens", type=int, default=0, help="never stop at the end-of-text token before this many"
    )
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top_k", type=int, default=40)
    g.add_argument("--seed", type=int, default=0, help="the sampling's seed")

    x = subparsers.add_parser("export", help="write one path as a standalone model")
    _source_flags(x)
    x.add_argument("--path", required=True, help="path index or one module index per level (e.g. 1,0)")
    x.add_argument("--out", type=Path, required=True)
    x.add_argument(
        "--format",
        choices=("pathswarm", "hf"),
        default="pathswarm",
        help="pathswarm: model.safetensors + config.json for `generate --exported`; hf: a GPT-2 folder "
        "that transformers' AutoModelForCausalLM and AutoTokenizer load (--out must be new or empty)",
    )
    return {"eval": cmd_eval, "generate": cmd_generate, "export": cmd_export}


def _artifact_folders(args: argparse.Namespace) -> list[Path]:
    """Where offline commands look for the run's artifacts (base model, data shards), in order."""
    from peer.swarm.base_model import ARTIFACTS_SUBDIR

    folders = [args.artifacts_dir] if args.artifacts_dir else []
    folders.append(Path(args.manifest_path).parent / ARTIFACTS_SUBDIR)
    return folders + [Path(c) / ARTIFACTS_SUBDIR for c in args.checkpoints or []]


def _source_flags(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--manifest_path", type=Path, required=required, help="the run's signed manifest file")
    p.add_argument(
        "--checkpoints", type=Path, nargs="+", required=required, help="checkpoint folders of the run's peers"
    )
    p.add_argument(
        "--artifacts_dir",
        type=Path,
        default=None,
        help="folder holding the run's base model and data shards, if it has them (default: beside the "
        "manifest, or a checkpoint folder's artifacts/)",
    )
    p.add_argument(
        "--allow_untrained",
        action="store_true",
        help="use a path no checkpoint's peer trained (its modules as other paths left them)",
    )


def load_manifest(path: Path):
    from peer.run.record import load_verified_manifest

    return load_verified_manifest(path)[0]


def _checkpoint_batch_size(ckpts, seq_len: int) -> int | None:
    sizes = [
        round(c.meta["tokens_total"] / c.meta["step"] / seq_len)
        for c in ckpts
        if c.meta.get("tokens_total") and c.meta.get("step")
    ]
    return max(1, round(statistics.median(sizes))) if sizes else None


def cmd_eval(args: argparse.Namespace) -> int:
    from peer.data.batches import encode_document
    from peer.data.sources import eval_documents
    from peer.model.route import route_documents
    from peer.offline.evaluation import evaluate
    from peer.offline.grid_checkpoints import assemble_grid, path_steps, read_checkpoints, refuse_untrained
    from peer.run.rebuild import check_tokenizer, make_route
    from peer.run.router_versions import router_trained_with
    from peer.swarm.base_model import base_on_disk

    if args.max_docs is not None and args.max_docs < 1:
        raise ConfigError("--max_docs must be >= 1")
    manifest = load_manifest(args.manifest_path)
    ckpts = read_checkpoints(manifest, args.checkpoints)
    grid = assemble_grid(manifest, ckpts)
    folders = _artifact_folders(args)
    tok = check_tokenizer(manifest, folders)
    base = base_on_disk(manifest, folders)  # routing uses its features
    # the router the peers trained with last: a re-routed run (`pathswarm run reroute`) is scored alike
    version, router = router_trained_with([c.meta for c in ckpts], folders)
    if version:
        print(f"routing with router version {version}, the latest the checkpoints trained with")
    route = make_route(manifest, base, folders, router=router)
    docs = eval_documents(manifest.dataset, limit=args.max_docs, shard_folders=folders)
    if not docs:
        raise ConfigError("the dataset has no held-out documents (dataset.eval_fraction is 0?)")
    # which paths the held-out documents go to, before the (long) scoring: an untrained one is refused
    routed = route_documents(route, [encode_document(tok, t) for t in docs])
    counts = Counter(routed)
    shares = {p: counts.get(p, 0) / len(docs) for p in range(manifest.model.n_paths)}
    steps_per_path = path_steps(manifest, ckpts)
    refuse_untrained(manifest, steps_per_path, shares, args.allow_untrained, "held-out documents route to")
    result = evaluate(grid, docs, tok, route, context=manifest.seq_len, routed=routed)

    # the dense path-size model at one path's steps and at the swarm's (all paths' steps together)
    one_path = max(int(c.meta["step"]) for c in ckpts)
    steps = {
        ONE_PATH: one_path if args.baseline_steps is None else args.baseline_steps,
        SWARM: sum(steps_per_path.values())
        if args.swarm_baseline_steps is None
        else args.swarm_baseline_steps,
    }
    if min(steps.values()) < 0:
        raise ConfigError("--baseline_steps and --swarm_baseline_steps must be >= 0")
    batch_size = args.batch_size or _checkpoint_batch_size(ckpts, manifest.seq_len) or 8
    dense = _dense_baselines(manifest, base, tok, batch_size, steps, folders, docs, route, routed)

    unit = _unit(tok)
    _print_table(manifest, result, dense, steps_per_path, shares, unit)
    what = "a byte token; each document's end-of-text token counts as one" if unit == "byte" else "token"
    print(f"perplexity is per {unit} ({what}); bits per byte: NLL in bits over the scored text's bytes")
    print(f"composite: perplexity {result.ppl:.3f} per {unit}, {result.bits_per_byte:.3f} bits per byte")
    ratios = {}
    for label, (n, scored) in dense.items():
        ratios[label] = result.ppl / scored.ppl
        print(
            f"composite / dense perplexity: {ratios[label]:.3f} (dense baseline: {n} steps, {label}; "
            f"{scored.ppl:.3f} per {unit}, {scored.bits_per_byte:.3f} bits per byte)"
        )
    balance = max(shares.values()) / min(shares.values()) if min(shares.values()) > 0 else math.inf
    print(f"routing balance: the largest path's share of held-out documents is {balance:.2f}x the smallest's")
    if args.json is not None:
        out = dict(
            run_id=manifest.run_id,
            composite=_with_paths(result.to_dict(), steps_per_path, shares),
            routing_balance=balance if math.isfinite(balance) else None,
            unit=unit,
            dense=dense[ONE_PATH][1].to_dict() if ONE_PATH in dense else None,
            baseline_steps=steps[ONE_PATH],
            ratio=ratios.get(ONE_PATH),
            dense_swarm_steps=dense[SWARM][1].to_dict() if SWARM in dense else None,
            swarm_baseline_steps=steps[SWARM],
            ratio_swarm_steps=ratios.get(SWARM),
            checkpoints=[
                dict(
                    directory=str(c.directory),
                    path=c.meta.get("path"),
                    step=c.meta.get("step"),
                    outer_round=c.meta.get("outer_round"),
                )
                for c in ckpts
            ],
        )
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


#: the two dense baselines: one path's steps, and the swarm's (all paths' steps together)
ONE_PATH, SWARM = "one path's steps", "the swarm's steps"


def _unit(tok) -> str:
    from peer.model.tokenizer import ByteTokenizer

    return "byte" if isinstance(tok, ByteTokenizer) else "token"


def _dense_baselines(
    manifest, base, tok, batch_size, steps: dict[str, int], shard_folders, docs, route, routed
):
    """label -> (steps, result): one dense path-size model trained on the run's training documents to
    the most steps asked, scored on the way at each count (0: not trained). The peers' cosine runs over
    manifest.inner.total_steps; the baseline follows the same one. A warm-started run's paths all
    started from its base: so does the baseline."""
    from peer.data.sources import load_documents, split_of
    from peer.model.base import base_model
    from peer.offline.evaluation import evaluate
    from peer.offline.simulate import DenseTrainer, SimConfig

    wanted = {label: n for label, n in steps.items() if n > 0}
    if not wanted:
        return {}
    train = [t for t in load_documents(manifest.dataset, shard_folders=shard_folders)
             if split_of(t, manifest.dataset) == "train"]  # fmt: skip
    cfg = SimConfig.from_manifest(manifest, batch_size=batch_size)
    most = max(wanted.values())
    print(f"training the dense path-size baseline: {most} steps of batch {batch_size}")
    start = base_model(manifest.model, base) if base is not None else None
    trainer = DenseTrainer(cfg, train, tok, max(manifest.inner.total_steps, most), model=start)
    done, out = 0, {}
    for label, n in sorted(wanted.items(), key=lambda kv: kv[1]):
        model = trainer.train(n - done)
        done = n
        out[label] = (n, evaluate(model, docs, tok, route, context=manifest.seq_len, routed=routed))
    return {label: out[label] for label in wanted}


def _print_table(
    manifest, result, dense, steps_per_path: dict[int, int], shares: dict[int, float], unit: str
):
    """Per path: trained steps, share of the held-out documents, composite and dense perplexity (per
    byte with the byte tokenizer, else per token), the dense model's at each baseline's steps."""
    from peer.model.grid import path_from_index

    headers = [f"dense ppl/{unit} ({n} steps)" for n, _ in dense.values()]
    rows = [("path", "steps", "share", "docs", "tokens", f"dipaco ppl/{unit}", *headers)]
    for p, s in sorted(result.per_path.items()):
        label = f"{p} {','.join(map(str, path_from_index(manifest.model, p)))}"
        dense_ppl = [f"{d.per_path[p].ppl:.3f}" for _, d in dense.values()]
        share = f"{shares[p]:.1%}"
        rows.append(
            (label, str(steps_per_path[p]), share, str(s.docs), str(s.tokens), f"{s.ppl:.3f}", *dense_ppl)
        )
    all_steps, tokens = str(sum(steps_per_path.values())), str(result.tokens)
    dense_all = [f"{d.ppl:.3f}" for _, d in dense.values()]
    rows.append(("all", all_steps, "100%", str(result.docs), tokens, f"{result.ppl:.3f}", *dense_all))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def _with_paths(composite: dict, steps: dict[int, int], shares: dict[int, float]) -> dict:
    """Every path of the grid in the JSON, with its trained steps and share of held-out documents."""
    per_path = composite["per_path"]
    for p in steps:
        entry = per_path.setdefault(str(p), dict(docs=0, tokens=0, ppl=None))
        entry.update(steps=steps[p], share=shares[p])
    composite["per_path"] = dict(sorted(per_path.items(), key=lambda kv: int(kv[0])))
    return composite


def cmd_generate(args: argparse.Namespace) -> int:
    from peer.model.grid import path_from_index
    from peer.offline.grid_checkpoints import assemble_grid, path_steps, read_checkpoints, refuse_untrained
    from peer.offline.inference import exported_tokenizer, generate, load_exported, read_export_config
    from peer.run.rebuild import check_tokenizer, make_route
    from peer.run.router_versions import router_trained_with
    from peer.swarm.base_model import base_on_disk

    sampling = dict(
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.min_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    if args.exported is not None:
        if args.manifest_path is not None or args.checkpoints:
            raise ConfigError("give either --exported or --manifest_path with --checkpoints, not both")
        model = load_exported(args.exported)
        tok = exported_tokenizer(args.exported)
        context = read_export_config(args.exported).get("seq_len")
        out = generate(model, None, tok, args.prompt, context_len=context, **sampling)
    else:
        if args.manifest_path is None or not args.checkpoints:
            raise ConfigError("give --manifest_path and --checkpoints, or --exported")
        manifest = load_manifest(args.manifest_path)
        folders = _artifact_folders(args)
        tok = check_tokenizer(manifest, folders)
        # Route first, so only the chosen path's modules have to be in the checkpoints; with the
        # router the checkpoints trained with last (a re-routed run)
        ids = [tok.bos_id, *tok.encode(args.prompt)]
        ckpts = read_checkpoints(manifest, args.checkpoints)
        router = router_trained_with([c.meta for c in ckpts], folders)[1]
        index = int(make_route(manifest, base_on_disk(manifest, folders), folders, router=router)([ids])[0])
        path = path_from_index(manifest.model, index)
        grid = assemble_grid(manifest, ckpts, paths=[path])
        refuse_untrained(
            manifest, path_steps(manifest, ckpts), {index: 1.0}, args.allow_untrained, "the prompt routes to"
        )
        out = generate(
            grid.path_model(path), None, tok, args.prompt, context_len=manifest.seq_len, **sampling
        )
    print(f"[path {out.path_index} {','.join(map(str, out.path))}]")
    print(args.prompt + out.text)
    # on stderr, so that stdout stays the text: a prompt printed alone is never left unexplained
    print(f"[{out.why()}]", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from peer.model.grid import parse_path, path_index
    from peer.offline.grid_checkpoints import assemble_grid, path_steps, read_checkpoints, refuse_untrained
    from peer.offline.hf_export import check_out_dir, export_hf
    from peer.offline.inference import export_path
    from peer.run.rebuild import check_tokenizer

    if args.format == "hf":
        check_out_dir(args.out)  # before the checkpoints are read: it refuses in a moment
    manifest = load_manifest(args.manifest_path)
    path = parse_path(manifest.model, args.path)
    ckpts = read_checkpoints(manifest, args.checkpoints)
    index = path_index(manifest.model, path)
    grid = assemble_grid(manifest, ckpts, paths=[path])
    refuse_untrained(manifest, path_steps(manifest, ckpts), {index: 1.0}, args.allow_untrained, "exporting")
    if args.format == "hf":
        out = export_hf(grid, path, args.out, manifest, _artifact_folders(args))
        print(
            f"exported path {','.join(map(str, path))} of run {manifest.name} to {out} (Hugging Face GPT-2)"
        )
    else:
        tok = check_tokenizer(manifest, _artifact_folders(args))
        out = export_path(grid, path, args.out, manifest, getattr(tok, "path", None))
        print(f"exported path {','.join(map(str, path))} of run {manifest.name} to {out}")
    return 0
