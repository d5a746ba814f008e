"""The DiPaCo router: which path of the grid trains on (and later serves) each document.

A document is described by the mean hidden state of a fixed feature model over its first
`prefix_tokens` tokens. Product k-means clusters one slice of that feature vector per grid level,
so documents that share a level's cluster share that level's module, and the path index is the
mixed-radix number of the per-level clusters (most significant level first, as `path_index`).
The slices are taken after a PCA rotation that deals the principal directions out to the levels in
turn: raw-dimension slices each saw too little of the structure (documents of one domain scattered
over three of four paths on the builtin corpus), interleaved PCs give every level a strong share.

Plain k-means puts most documents on a few paths when the data is lumpy (75% on one path in an early
probe, which starved the other paths), so fitting can learn one additive bias per path that evens
out path sizes; the biases are part of the `Router`, so new documents are routed with the same
balance. The router is plain data (JSON with a sha256 fingerprint) that every peer applies alike.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, model_validator

from peer.seeding import stable_seed

ROUTER_VERSION = 1


def _sqdist(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    # Exact differences rather than the |x|^2 - 2xc + |c|^2 expansion of cdist: fewer near-ties
    # that flip between machines. Chunked to bound memory.
    rows = max(1, 2**24 // max(1, c.shape[0] * c.shape[1]))
    return torch.cat([((x[i : i + rows, None, :] - c[None]) ** 2).sum(-1) for i in range(0, len(x), rows)])


class Router(BaseModel):
    """Routing parameters. kmeans: one set of n_paths centroids over all feature dims. product_kmeans:
    per level, modules_per_level centroids over the dims level_dims[level] = [start, end). linear: a
    multinomial logistic regression (weights, n_paths x d). Features are standardized with
    feature_mean/feature_std, then multiplied by `projection` (d x d', empty for none). Scores are
    -squared distance (or logits) plus `bias` (one per path); a document goes to the highest score."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: int = ROUTER_VERSION
    kind: Literal["kmeans", "product_kmeans", "linear"]
    n_levels: int
    modules_per_level: int
    prefix_tokens: int = 32
    feature_mean: list[float]
    feature_std: list[float]
    centroids: list[list[list[float]]] = []
    projection: list[list[float]] = []
    level_dims: list[list[int]] = []
    weights: list[list[float]] = []
    bias: list[float] = []

    @property
    def n_paths(self) -> int:
        return self.modules_per_level**self.n_levels

    @property
    def dim(self) -> int:
        return len(self.feature_mean)

    @model_validator(mode="after")
    def _check_shapes(self) -> Router:
        if self.version != ROUTER_VERSION:
            raise ValueError(
                f"router version {self.version} is not supported (this peer reads {ROUTER_VERSION})"
            )
        if self.n_levels < 1 or self.modules_per_level < 1:
            raise ValueError("router needs n_levels >= 1 and modules_per_level >= 1")
        d, k, p = self.dim, self.modules_per_level, self.n_paths
        if len(self.feature_std) != d or d == 0:
            raise ValueError(f"router feature_mean/feature_std must have the same nonzero length, got {d}")
        if self.projection:
            if (
                len(self.projection) != d
                or len({len(r) for r in self.projection}) != 1
                or not self.projection[0]
            ):
                raise ValueError(f"router projection must be a {d} x d' matrix")
            d = len(self.projection[0])
        if len(self.bias) != p:
            raise ValueError(f"router bias has {len(self.bias)} entries, expected one per path ({p})")
        if self.kind == "kmeans":
            sets, dims = [p], [[0, d]]
        elif self.kind == "product_kmeans":
            sets, dims = [k] * self.n_levels, self.level_dims
            if len(dims) != self.n_levels or any(len(r) != 2 or not 0 <= r[0] < r[1] <= d for r in dims):
                raise ValueError(f"router level_dims must give one [start, end) range of 0..{d} per level")
        else:
            if len(self.weights) != p or any(len(w) != d for w in self.weights):
                raise ValueError(f"linear router weights must be {p} x {d}")
            return self
        if len(self.centroids) != len(sets):
            raise ValueError(
                f"{self.kind} router needs {len(sets)} centroid set(s), got {len(self.centroids)}"
            )
        for cs, n, (lo, hi) in zip(self.centroids, sets, dims, strict=True):
            if len(cs) != n or any(len(c) != hi - lo for c in cs):
                raise ValueError(f"{self.kind} router: a centroid set is not {n} x {hi - lo}")
        return self

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no spaces; floats round-trip exactly."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Router:
        return cls.model_validate_json(text)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def _standardize(self, features: torch.Tensor) -> torch.Tensor:
        if features.dim() != 2 or features.shape[1] != self.dim:
            raise ValueError(f"router expects features of shape (n, {self.dim}), got {tuple(features.shape)}")
        mean = torch.tensor(self.feature_mean, dtype=torch.float64)
        std = torch.tensor(self.feature_std, dtype=torch.float64)
        z = (features.detach().cpu().to(torch.float64) - mean) / std
        return z @ torch.tensor(self.projection, dtype=torch.float64) if self.projection else z

    def base_scores(self, features: torch.Tensor) -> torch.Tensor:
        """(n, n_paths) scores before the balancing bias."""
        z = self._standardize(features)
        if self.kind == "linear":
            return z @ torch.tensor(self.weights, dtype=torch.float64).t()
        if self.kind == "kmeans":
            return -_sqdist(z, torch.tensor(self.centroids[0], dtype=torch.float64))
        # Distances add over levels, so the joint score of path (k0, k1, ...) is a sum of one term
        # per level; broadcasting level l along axis l + 1 makes the flat index the mixed-radix one.
        k, scores = self.modules_per_level, torch.zeros(len(z), *([1] * self.n_levels), dtype=torch.float64)
        for level, ((lo, hi), cs) in enumerate(zip(self.level_dims, self.centroids, strict=True)):
            d = -_sqdist(z[:, lo:hi], torch.tensor(cs, dtype=torch.float64))
            shape = [len(z)] + [1] * self.n_levels
            shape[level + 1] = k
            scores = scores + d.view(shape)
        return scores.reshape(len(z), self.n_paths)

    def route(self, features: torch.Tensor) -> torch.Tensor:
        """(n,) int64 path indices. Large grids are scored in chunks to bound memory."""
        rows = max(1, 2**22 // self.n_paths)
        bias = torch.tensor(self.bias, dtype=torch.float64)
        parts = [
            (self.base_scores(features[i : i + rows]) + bias).argmax(1) for i in range(0, len(features), rows)
        ]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def balance_bias(
    scores: torch.Tensor | list[torch.Tensor],
    tolerance: float = 0.05,
    iters: int = 500,
    init: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-column bias b so that argmax(scores + b) sends about n / k rows to each of the k columns.

    b is the dual of a capacity-constrained assignment, found by a damped ascent: an over-full column
    loses score, an under-full one gains. Given several score matrices (the fit's training documents
    and the run's held-out ones), it balances each of them: the ascent follows their mean excess and
    the bias kept is the one whose worst deviation over all of them is smallest. Returns the bias
    with the smallest worst relative deviation seen (stopping once it is within `tolerance`);
    deterministic for given inputs.
    """
    sets = [scores] if isinstance(scores, torch.Tensor) else [s for s in scores if len(s)]
    k = sets[0].shape[1] if sets else 0
    bias = torch.zeros(k, dtype=torch.float64) if init is None else init.clone().to(torch.float64)
    if not sets or k == 1:
        return bias
    # Step in units of a typical gap between the best and second-best score.
    top2 = torch.cat(sets).topk(2, dim=1).values
    step = float((top2[:, 0] - top2[:, 1]).median().clamp(min=1e-6)) * 2.0
    best, best_dev = bias.clone(), float("inf")
    for _ in range(iters):
        # 1.0 is a perfectly even split
        shares = [
            torch.bincount((s + bias).argmax(1), minlength=k).to(torch.float64) * k / len(s) for s in sets
        ]
        dev = max(float((share - 1).abs().max()) for share in shares)
        if dev < best_dev:
            best, best_dev = bias.clone(), dev
        if dev <= tolerance:
            break
        bias = bias - step * (torch.stack(shares).mean(0) - 1).clamp(-1, 1)
        step *= 0.98
    return best - best.mean()


def share_ratio(router: Router, features: torch.Tensor) -> float:
    """The largest path's share of these documents over the smallest's (inf if a path gets none)."""
    counts = torch.bincount(router.route(features), minlength=router.n_paths)
    return float(counts.max() / counts.min()) if int(counts.min()) > 0 else math.inf


def rebalance(router: Router, sets: list[torch.Tensor], tolerance: float = 0.05) -> Router:
    """The router with biases that balance each of these sets of prefix features at once."""
    scores = [router.base_scores(f) for f in sets if len(f)]
    bias = balance_bias(scores, tolerance, init=torch.tensor(router.bias, dtype=torch.float64))
    return Router.model_validate({**router.model_dump(), "bias": bias.tolist()})


def _kmeans_pp(x: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    centers = [x[int(torch.randint(len(x), (1,), generator=gen))]]
    for _ in range(1, k):
        d = _sqdist(x, torch.stack(centers)).min(1).values
        if float(d.sum()) <= 0:
            idx = int(torch.randint(len(x), (1,), generator=gen))  # every point already a centre
        else:
            idx = int(torch.multinomial(d / d.sum(), 1, generator=gen))
        centers.append(x[idx])
    return torch.stack(centers)


def kmeans(
    x: torch.Tensor, k: int, seed: int, iters: int = 50, balanced: bool = True, tolerance: float = 0.05
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic Lloyd k-means with k-means++ init; returns (centroids, bias). With `balanced`,
    each assignment step uses balancing biases, so centroids settle on a balanced partition."""
    if len(x) < k:
        raise ValueError(f"cannot fit {k} clusters to {len(x)} documents; route more documents")
    gen = torch.Generator().manual_seed(stable_seed("pathswarm-kmeans", seed) % 2**63)
    centroids = _kmeans_pp(x, k, gen)
    bias = torch.zeros(k, dtype=torch.float64)
    assign = None
    for _ in range(iters):
        scores = -_sqdist(x, centroids)
        if balanced:
            bias = balance_bias(scores, tolerance, init=bias)
        new = (scores + bias).argmax(1)
        if assign is not None and torch.equal(new, assign):
            break
        assign = new
        for j in range(k):
            members = x[assign == j]
            # An empty cluster restarts at the point its centroid explains worst, deterministically.
            centroids[j] = members.mean(0) if len(members) else x[int((-scores.max(1).values).argmax())]
    if balanced:
        bias = balance_bias(-_sqdist(x, centroids), tolerance, init=bias)
    return centroids, bias


def _compact(t: torch.Tensor) -> torch.Tensor:
    """Rounds to 6 significant digits, the precision stored in the manifest's JSON, so the router
    is fitted with exactly the numbers every peer will read back."""
    return torch.tensor([float(f"{v:.6g}") for v in t.reshape(-1).tolist()], dtype=torch.float64).reshape(
        t.shape
    )


def fit_router(
    features: torch.Tensor,
    n_levels: int,
    modules_per_level: int,
    kind: Literal["kmeans", "product_kmeans"] = "product_kmeans",
    seed: int = 0,
    balanced: bool = True,
    iters: int = 50,
    prefix_tokens: int = 32,
    tolerance: float = 0.05,
    components_per_level: int = 8,
) -> Router:
    """Fits a router on (n_docs, d) prefix features. `tolerance` is the largest relative deviation
    of a path's share from 1 / n_paths that balancing aims for on these documents. Product k-means
    keeps `components_per_level` principal components per level: the router travels inside the
    signed manifest, a DHT record that must stay small."""
    if features.dim() != 2 or len(features) == 0:
        raise ValueError(f"features must be a non-empty (n_docs, d) matrix, got {tuple(features.shape)}")
    x = features.detach().cpu().to(torch.float64)
    mean, std = _compact(x.mean(0)), _compact(x.std(0, unbiased=False).clamp(min=1e-6))
    z = (x - mean) / std
    n_paths = modules_per_level**n_levels
    common = dict(
        n_levels=n_levels,
        modules_per_level=modules_per_level,
        prefix_tokens=prefix_tokens,
        feature_mean=mean.tolist(),
        feature_std=std.tolist(),
    )
    if kind == "kmeans":
        centroids, bias = kmeans(z, n_paths, seed, iters, balanced, tolerance)
        return Router(kind="kmeans", centroids=[centroids.tolist()], bias=bias.tolist(), **common)
    if kind != "product_kmeans":
        raise ValueError(f"unknown router kind {kind!r}; use 'kmeans' or 'product_kmeans'")
    if z.shape[1] < n_levels:
        raise ValueError(
            f"product k-means needs at least one feature dim per level ({n_levels}), got {z.shape[1]}"
        )
    # Principal directions, strongest first, dealt out round-robin: level l gets PCs l, l + L, ...
    # and the projection's columns are ordered so each level's PCs form one contiguous range.
    eigvals, eigvecs = torch.linalg.eigh(z.t() @ z / len(z))
    pcs = eigvecs[:, eigvals.argsort(descending=True)]
    # eigh's signs are arbitrary; fixing them keeps the stored projection reproducible.
    pcs = pcs * torch.where(pcs.sum(0) < 0, -1.0, 1.0)
    n_components = min(z.shape[1], components_per_level * n_levels)
    order = [i for level in range(n_levels) for i in range(level, n_components, n_levels)]
    projection = _compact(pcs[:, order])
    z = z @ projection
    sizes = [len(range(level, n_components, n_levels)) for level in range(n_levels)]
    starts = [sum(sizes[:level]) for level in range(n_levels)]
    level_dims = [[start, start + size] for start, size in zip(starts, sizes, strict=True)]
    sets = [
        kmeans(z[:, lo:hi], modules_per_level, stable_seed(seed, "level", level), iters, balanced, tolerance)[
            0
        ]
        for level, (lo, hi) in enumerate(level_dims)
    ]
    router = Router(
        kind="product_kmeans",
        centroids=[c.tolist() for c in sets],
        projection=projection.tolist(),
        level_dims=level_dims,
        bias=[0.0] * n_paths,
        **common,
    )
    if not balanced:
        return router
    # Balanced levels can still be correlated (a level-0 cluster mostly meeting one level-1 cluster),
    # so the joint path sizes are balanced too, with one bias per path.
    bias = balance_bias(router.base_scores(features), tolerance)
    return Router.model_validate({**router.model_dump(), "bias": bias.tolist()})


def discriminative_relabel(
    router: Router,
    features: torch.Tensor,
    path_losses: torch.Tensor,
    seed: int = 0,
    steps: int = 300,
    weight_decay: float = 1e-3,
    balanced: bool = True,
    tolerance: float = 0.05,
) -> Router:
    """DiPaCo's discriminative re-routing: label each document with the path of lowest loss
    (path_losses is n_docs x n_paths), fit a multinomial logistic regression on the router's
    standardized features, and balance it with per-path biases. Returns a "linear" Router."""
    n, p = len(features), router.n_paths
    if path_losses.shape != (n, p):
        raise ValueError(f"path_losses must be ({n}, {p}), got {tuple(path_losses.shape)}")
    z = router._standardize(features).to(torch.float64)
    labels = path_losses.to(torch.float64).argmin(1)
    gen = torch.Generator().manual_seed(stable_seed("pathswarm-relabel", seed) % 2**63)
    w = (torch.randn(p, z.shape[1], generator=gen, dtype=torch.float64) * 0.01).requires_grad_()
    b = torch.zeros(p, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(z @ w.t() + b, labels) + weight_decay * (w**2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    w, b = w.detach(), b.detach()
    if balanced:
        b = b + balance_bias(z @ w.t() + b, tolerance)
    # The projection stays: the weights act on the same (projected) features the router scores.
    update = {"kind": "linear", "weights": w.tolist(), "bias": b.tolist(), "centroids": [], "level_dims": []}
    return Router.model_validate({**router.model_dump(), **update})
