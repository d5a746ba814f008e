"""`pathswarm run reroute`: DiPaCo's discriminative re-routing phase, on a live run.

The run's creator downloads every module's current state from its holders (the confirmed, pieced
transfer a joiner uses, peer/sync/state_fetch.py), scores a sample of training documents with every
path, and fits a linear router that sends each document to the path that predicts it best
(`discriminative_relabel`, balanced; DiPaCo, Douillard et al. 2024, §2.2). It publishes that router
as the run's next version (peer/run/router_versions.py): the file by hash, served from the run folder
and then by every peer that fetched it, and the creator-signed record in the DHT and beside the
manifest. Peers switch at the round the record names. Before publishing it reports what the new
router buys with the models as they are: the held-out loss of the current paths, routed as now and
re-routed, and publishes nothing when that is worse (unless forced). A paused run (its peers
stopped, a bootstrap still up) is scored from its peers' checkpoints (`--checkpoints`); the peers
take the router when they resume.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch
from tqdm import tqdm

from dht.identity import load_identity
from dht.node import LOOPBACK_MADDRS, start_dht
from peer.artifacts.store import ArtifactStore, require_artifact
from peer.artifacts.transfer import ArtifactService
from peer.codecs.formats import make_codec
from peer.config import RunManifest
from peer.data.batches import encode_document
from peer.data.sources import load_documents, split_of
from peer.errors import ConfigError, SwarmError
from peer.model.grid import all_module_ids, path_from_index
from peer.model.route import feature_model, prefix_features
from peer.model.router import Router, discriminative_relabel, share_ratio
from peer.model.transformer import GridModel
from peer.offline.evaluation import score_documents
from peer.offline.grid_checkpoints import assemble_grid, read_checkpoints
from peer.run.admission import AdmissionCheck, run_validator
from peer.run.create import router_artifact
from peer.run.rebuild import check_tokenizer, router_of
from peer.run.record import load_verified_manifest
from peer.run.router_versions import (
    RouterVersion,
    latest_router_on_disk,
    latest_router_version,
    publish_router_record,
    read_router,
    save_router_record,
    sign_router_version,
)
from peer.swarm.base_model import ARTIFACTS_SUBDIR, base_on_disk
from peer.swarm.claims import live_claims
from peer.sync.inbox import Inbox
from peer.sync.module_sync import ModuleSync, StateRejected
from peer.sync.service import SyncService
from peer.sync.standing import Standing
from peer.sync.state_fetch import fetch_module_state

logger = logging.getLogger(__name__)

#: how often the tool re-reads who switched while it serves the router file
POLL_SECONDS = 2.0


@dataclass(frozen=True)
class RerouteOptions:
    """`pathswarm run reroute`'s flags."""

    manifest_path: Path
    identity_path: str | None
    initial_peers: list[str]
    host_maddrs: list[str] = field(default_factory=lambda: list(LOOPBACK_MADDRS))
    #: training documents scored by every path to fit the new router
    docs: int = 1000
    #: held-out documents on which the new routing is compared with the current one
    eval_docs: int = 200
    #: a document is scored on at most its first this many tokens (its path is its prefix's anyway)
    score_tokens: int = 512
    #: the largest path's share of the training documents over the smallest's, at most
    max_share_ratio: float = 3.0
    #: wait until the swarm reaches this outer round before scoring (0: score now)
    at_round: int = 0
    #: publish even when the new router scores the held-out documents worse than the current one
    force: bool = False
    #: score the paths of a paused run from these peers' checkpoints instead of its live holders
    checkpoints: list[Path] = field(default_factory=list)
    #: peers switch this many outer rounds after the swarm's round when the router is published
    switch_after_rounds: int = 2
    #: how long to wait for every module to have a holder
    wait_seconds: float = 60.0
    #: how long to serve the router file at most (the tool stops earlier once every peer switched)
    serve_seconds: float = 600.0


@dataclass
class RerouteResult:
    """What `reroute` published and what it measured before publishing."""

    version: RouterVersion
    documents: int
    changed_documents: int
    balance: float
    held_out: dict[str, float]
    module_rounds: dict[str, list[int]]


def _donors(manifest: RunManifest, dht, run_id: str, wait_seconds: float, seen: dict) -> dict[str, list[str]]:
    """Every module's holders, the most advanced first; waits until each module has one. The claims
    read go into `seen` (their admission tokens give the holders' standing)."""
    deadline = time.monotonic() + wait_seconds
    while True:
        claims = live_claims(dht, manifest.name, run_id, manifest.model.n_paths)
        seen.clear()
        seen.update(claims)
        ranked: dict[str, list[tuple[int, str]]] = {}
        for pid, claim in claims.items():
            if claim.ready:
                for mid in claim.modules:
                    ranked.setdefault(mid, []).append((-sum(claim.module_rounds.get(mid, [0])), pid))
        missing = [mid for mid in all_module_ids(manifest.model) if mid not in ranked]
        if not missing:
            return {mid: [pid for _, pid in sorted(v)] for mid, v in ranked.items()}
        if time.monotonic() > deadline:
            raise SwarmError(
                f"no live peer holds module(s) {', '.join(missing)} of run {manifest.name} "
                f"({len(claims)} peers seen in {wait_seconds:.0f} s); re-routing needs every path's model"
            )
        time.sleep(2.0)


def fetch_grid(manifest: RunManifest, record, dht, key, wait_seconds: float) -> tuple[GridModel, dict]:
    """The grid as its holders have it now: every module's state, confirmed by holders with standing."""
    run_id = record.run_id
    claims: dict = {}
    donors = _donors(manifest, dht, run_id, wait_seconds, claims)
    sync = manifest.sync
    standing = Standing(
        AdmissionCheck.of(record), manifest.admission.mode, lambda p: getattr(claims.get(p), "admission", "")
    )
    inbox = Inbox({}, make_codec(sync.codec), lambda p, m: False, 1, 0.0, standing)  # takes part in no round
    service = SyncService(dht, run_id, inbox, sync.averaging_timeout_seconds + 30, key=key)
    grid = GridModel(manifest.model, seed=manifest.seed)
    rounds: dict[str, list[int]] = {}
    try:
        for mid in tqdm(all_module_ids(manifest.model), desc="module states", unit="module"):
            ms = ModuleSync(manifest.model, mid, grid.grid[mid], manifest.outer, sync.fragments)
            numels = [t.numel() for t in ms.state_tensors()]
            got = fetch_module_state(service, mid, numels, donors[mid], sync)
            if got is None:
                raise SwarmError(
                    f"{mid}: none of its {len(donors[mid])} holder(s) sent a state another confirms"
                )
            try:
                ms.load_state(dict(module=mid, fragment_rounds=list(got.rounds)), got.tensors)
            except StateRejected as e:
                raise SwarmError(f"{mid}: refused the state its holders sent: {e}") from None
            ms.load_local_from_global()
            rounds[mid] = list(got.rounds)
    finally:
        service.shutdown()
    return grid.eval(), rounds


def path_scores(
    grid: GridModel, token_lists: list[list[int]], context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_docs, n_paths) NLL sums and scored token counts of every document under every path."""
    nll, count = [], []
    for p in range(grid.cfg.n_paths):
        s, c = score_documents(grid.path_model(path_from_index(grid.cfg, p)), token_lists, 1, context)
        nll.append(s)
        count.append(c)
    return torch.stack(nll, 1), torch.stack(count, 1)


def held_out_loss(nll: torch.Tensor, count: torch.Tensor, paths: torch.Tensor) -> float:
    """Mean NLL per token when each document is scored by the path in `paths`."""
    rows = torch.arange(len(paths))
    return float(nll[rows, paths].sum() / count[rows, paths].sum().clamp(min=1))


def _documents(
    manifest: RunManifest, folders: list[Path], train: int, held: int
) -> tuple[list[str], list[str]]:
    train_docs: list[str] = []
    eval_docs: list[str] = []
    for text in islice(load_documents(manifest.dataset, shard_folders=folders), 20 * (train + held)):
        bucket = train_docs if split_of(text, manifest.dataset) == "train" else eval_docs
        bucket.append(text)
        if len(train_docs) >= train and len(eval_docs) >= held:
            break
    if len(train_docs) < 4 * manifest.model.n_paths:
        raise ConfigError(
            f"only {len(train_docs)} training documents to fit a router for {manifest.model.n_paths} paths"
        )
    return train_docs[:train], eval_docs[:held]


def _fit(o: RerouteOptions, manifest: RunManifest, folders: list[Path], grid: GridModel, current: Router):
    """The discriminative router: documents labelled by the path that predicts them best, a linear
    router fitted to those labels, balanced only as far as `max_share_ratio` asks (every peer trains
    as many steps whatever its shard's size: an uneven split costs data diversity, not compute).
    Returns it, how many training documents change path, its share ratio, the held-out comparison
    and how many documents were scored."""
    tok = check_tokenizer(manifest, folders)
    extractor = feature_model(manifest.model, manifest.seed, base_on_disk(manifest, folders))
    train, held = _documents(manifest, folders, o.docs, o.eval_docs)
    tokens = [encode_document(tok, d)[: o.score_tokens] for d in train]
    feats = prefix_features(extractor, tokens, current.prefix_tokens)
    nll, count = path_scores(grid, tokens, manifest.seq_len)
    r = o.max_share_ratio
    new = discriminative_relabel(
        current, feats, nll / count.clamp(min=1), seed=manifest.seed, tolerance=(r - 1) / (r + 1)
    )
    changed = int((new.route(feats) != current.route(feats)).sum())
    held_out = {}
    if held:
        held_tokens = [encode_document(tok, d)[: o.score_tokens] for d in held]
        h_feats = prefix_features(extractor, held_tokens, current.prefix_tokens)
        h_nll, h_count = path_scores(grid, held_tokens, manifest.seq_len)
        held_out = dict(
            routed_as_now=held_out_loss(h_nll, h_count, current.route(h_feats)),
            rerouted=held_out_loss(h_nll, h_count, new.route(h_feats)),
            best_path_per_document=held_out_loss(h_nll, h_count, (h_nll / h_count.clamp(min=1)).argmin(1)),
            documents=len(held),
        )
    return new, changed, share_ratio(new, feats), held_out, len(train)


def _checkpoint_rounds(checkpoints) -> dict[str, list[int]]:
    """Each module's fragment rounds in the most advanced checkpoint that holds it."""
    out: dict[str, list[int]] = {}
    for c in sorted(checkpoints, key=lambda c: c.rank):
        out.update({m: list(r) for m, r in (c.meta.get("fragment_rounds") or {}).items()})
    return out


def _wait_for_round(dht, manifest: RunManifest, run_id: str, at_round: int) -> None:
    """Waits until the swarm's round (the most advanced claim's) reaches `at_round`."""
    said = -1
    while True:
        claims = live_claims(dht, manifest.name, run_id, manifest.model.n_paths)
        now = max((c.outer_round for c in claims.values()), default=0)
        if now >= at_round:
            return
        if now != said:
            said = now
            print(
                f"waiting for round {at_round}: the swarm is at round {now} ({len(claims)} peers)", flush=True
            )
        time.sleep(1.0)


def reroute(o: RerouteOptions) -> RerouteResult:
    manifest, record = load_verified_manifest(o.manifest_path)
    key, identity_file = load_identity(o.identity_path)
    if key.get_public_key().to_bytes() != record.creator_public_key:
        raise ConfigError(
            f"--identity_path is not the key that created run {manifest.name}: only its creator can "
            "publish a router version (peers refuse any other signature)"
        )
    folder = Path(o.manifest_path).parent
    store = ArtifactStore(folder / ARTIFACTS_SUBDIR)
    folders = [store.root]
    dht, _ = start_dht(
        initial_peers=o.initial_peers,
        host_maddrs=o.host_maddrs,
        identity_path=identity_file,
        run_name=manifest.name,
        run_id=record.run_id,
    )
    artifacts: ArtifactService | None = None
    try:
        dht.add_validators([run_validator(record, manifest.name)])
        # the router now in use: the latest version (in the DHT or written here before), else the manifest's
        previous = [
            v
            for v in (
                latest_router_version(dht, manifest.name, record),
                latest_router_on_disk(folder, record),
            )
            if v
        ]
        current_version = max((v[0] for v in previous), key=lambda v: v.router_version, default=None)
        if current_version is None:
            current: Router = router_of(manifest, folders)
        else:
            current = read_router(
                require_artifact(current_version.router_file, folders, "the current router")
            )
        if o.checkpoints:  # a paused run: the paths as its peers' checkpoints hold them
            checkpoints = read_checkpoints(manifest, o.checkpoints)
            grid, rounds = assemble_grid(manifest, checkpoints), _checkpoint_rounds(checkpoints)
            # every peer of the paused run takes it as it resumes: the least advanced one too
            paused_round = min(int(c.meta.get("outer_round", 0)) for c in checkpoints)
        else:
            if o.at_round:
                _wait_for_round(dht, manifest, record.run_id, o.at_round)
            grid, rounds = fetch_grid(manifest, record, dht, key, o.wait_seconds)
            paused_round = 0
        logger.info(f"scoring documents with the {manifest.model.n_paths} paths as of module rounds {rounds}")
        new, changed, balance, held_out, scored = _fit(o, manifest, folders, grid, current)
        h = held_out
        if h and h["rerouted"] > h["routed_as_now"] and not o.force:
            raise SwarmError(
                f"re-routing would raise the current paths' held-out loss from {h['routed_as_now']:.4f} "
                f"to {h['rerouted']:.4f} ({h['documents']} documents): not published "
                "(--force publishes it anyway)"
            )
        ref = router_artifact(json.loads(new.to_json()), store)
        claims = live_claims(dht, manifest.name, record.run_id, manifest.model.n_paths)
        swarm_round = (
            paused_round if o.checkpoints else max((c.outer_round for c in claims.values()), default=0)
        )
        number = (current_version.router_version if current_version else 0) + 1
        version = RouterVersion(
            run_id=record.run_id,
            router_version=number,
            switch_round=swarm_round + o.switch_after_rounds,
            router_file=ref,
            created_at=time.time(),
        )
        signed = sign_router_version(version, key)
        path = save_router_record(signed, folder)
        result = RerouteResult(version, scored, changed, balance, held_out, rounds)
        _report(result, path)
        artifacts = ArtifactService(dht, store)
        artifacts.offer(ref)
        artifacts.publish(dht, key, manifest.name, record.run_id)
        _serve_until_switched(dht, key, manifest, record, signed, artifacts, o.serve_seconds)
        return result
    finally:
        if artifacts is not None:
            artifacts.shutdown()
        dht.shutdown()


def _report(r: RerouteResult, path: Path) -> None:
    v = r.version
    print(
        f"router version {v.router_version}: {r.changed_documents} of {r.documents} training documents "
        f"change path; largest path's share / smallest's {r.balance:.2f}x; written to {path}"
    )
    h = r.held_out
    if h:
        print(
            f"held-out loss of the current paths ({h['documents']} documents): routed as now "
            f"{h['routed_as_now']:.4f}, re-routed {h['rerouted']:.4f}, best path per document "
            f"{h['best_path_per_document']:.4f}"
        )
    print(f"peers switch at round {v.switch_round}")


def _serve_until_switched(
    dht, key, manifest: RunManifest, record, signed, artifacts: ArtifactService, serve_seconds: float
) -> None:
    """Publishes the record and serves the router file until every live peer re-published the
    record (they do once they switched) or `serve_seconds` pass."""
    deadline, published_at, said = time.monotonic() + serve_seconds, 0.0, -1
    while time.monotonic() < deadline:
        if time.monotonic() - published_at > 60 and publish_router_record(dht, key, manifest.name, signed):
            published_at = time.monotonic()
        artifacts.publish(dht, key, manifest.name, record.run_id)  # renewed every REPUBLISH_SECONDS
        found = latest_router_version(dht, manifest.name, record)
        peers = len(live_claims(dht, manifest.name, record.run_id, manifest.model.n_paths))
        switched = found[2] - 1 if found and found[0].router_version == signed.router_version else 0
        if switched != said:
            said = switched
            print(
                f"{switched} of {peers} peer(s) switched to router version {signed.router_version}",
                flush=True,
            )
        if peers and switched >= peers:
            return
        time.sleep(POLL_SECONDS)
    print(
        f"stopped serving after {serve_seconds:.0f} s; the peers that switched serve the router from now on"
    )
