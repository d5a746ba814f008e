"""The five network scenarios of Yuan et al. (arXiv 2206.01288, section 4) and JSON scenario files.

Numbers from the paper and the AWS measurements released with it (latency ms, bandwidth Gbps):

1. `datacenter_on_demand`: 8 instances x 8 V100 (p3.16xlarge); 100 Gbps inside an instance,
   25 Gbps between instances; latency negligible (0, as in the paper's simulation).
2. `datacenter_spot`: spot instances of different sizes: 8 x p3.8xlarge (4 V100) + 32 x p3.2xlarge
   (1 V100) for 64 GPUs; 100 Gbps inside an instance, 10 Gbps between instances; latency 0.
3. `two_datacenters`: two halves (Ohio, Virginia), 5 Gbps / 1 ms inside each, 10 ms / 1.12 Gbps
   between them.
4. `four_regions`: quarters in Virginia, Oregon, California and Ohio, 11-67 ms and 1.02-1.25 Gbps
   between them (the paper's "10-70 ms, 1.0-1.3 Gbps"), pairs in `_FOUR_REGIONS`.
5. `world_wide`: eighths in Oregon, Virginia, Ohio, Tokyo, Seoul, London, Frankfurt, Ireland,
   11-238 ms and 0.335-1.16 Gbps between them (the paper's "10-250 ms, 0.3-1.3 Gbps").

Inside a region (scenarios 4 and 5): 5 ms / 2 Gbps (DESIGN.md; the paper gives 2 Gbps).
A sixth, `world_wide_uneven`, is ours: the world-wide links with each peer in a region drawn at
random (so regions hold different numbers of peers) and every link scaled by a factor in
[0.9, 1.1], as real probes would be; it is where a greedy clustering stops being optimal.
Peers per region: N split in contiguous blocks as evenly as possible, the first regions taking one
more when N does not divide. Compute: the paper used V100s throughout, so `compute="uniform"` gives
every peer the same tokens/s; `compute="mixed"` (our assumption for a volunteer swarm, not the
paper's) draws each peer's speed from {0.5x: 25%, 1x: 50%, 2x: 25%} with the scenario seed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import numpy as np

from peer.errors import ConfigError
from peer.scheduler.snapshot import GridSpec, SwarmSnapshot

GBPS = 1e9 / 8  # bytes per second in one Gbit/s

#: Between AWS regions, as measured for Yuan et al. 2022: region, region, latency ms, bandwidth Gbit/s.
_WORLD_TEXT = """
Oregon Virginia 67 0.79
Oregon Ohio 49 1.1
Oregon Tokyo 96 0.523
Oregon Seoul 124 0.46
Oregon London 136 0.42
Oregon Frankfurt 143 0.404
Oregon Ireland 124 0.482
Virginia Ohio 11 1.12
Virginia Tokyo 143 0.524
Virginia Seoul 172 0.5
Virginia London 76 1.16
Virginia Frankfurt 90 1.02
Virginia Ireland 67 1.05
Ohio Tokyo 130 0.694
Ohio Seoul 159 0.529
Ohio London 86 1.05
Ohio Frankfurt 99 0.799
Ohio Ireland 77 1.14
Tokyo Seoul 34 1.1
Tokyo London 210 0.366
Tokyo Frankfurt 223 0.36
Tokyo Ireland 199 0.465
Seoul London 238 0.342
Seoul Frankfurt 235 0.358
Seoul Ireland 228 0.335
London Frankfurt 14 1.14
London Ireland 12 1.09
Frankfurt Ireland 24 1.08
"""
_FOUR_REGIONS_TEXT = """
Virginia Oregon 67 1.15
Virginia California 59 1.05
Virginia Ohio 11 1.12
Oregon California 12 1.25
Oregon Ohio 49 1.1
California Ohio 52 1.02
"""


def _pairs(text: str) -> dict[tuple[str, str], tuple[float, float]]:
    rows = (line.split() for line in text.strip().splitlines())
    return {(a, b): (float(ms), float(gbps)) for a, b, ms, gbps in rows}


_WORLD = _pairs(_WORLD_TEXT)
_FOUR_REGIONS = _pairs(_FOUR_REGIONS_TEXT)
_INSIDE_REGION = (5, 2.0)

#: Workload of the paper's GPT-3 XL runs, one path = one 3-layer tasklet (d_model 2048, ~151M
#: parameters): fp16 gradients of ~302 MB averaged each iteration (H = 1) over 62.5k tokens
#: (0.5M-token batch / 8 data-parallel groups). Tokens/s assumes ~30 TFLOP/s sustained on a V100
#: at 6 FLOP per parameter per token (our assumption; the paper does not state throughput).
TASKLET_PARAMS = 3 * 12 * 2048**2
PAPER_FRAGMENT_BYTES = 2 * TASKLET_PARAMS
PAPER_TOKENS_PER_STEP = 62_500
V100_TOKENS_PER_SECOND = 30e12 / (6 * TASKLET_PARAMS)
V100_MEMORY_BYTES = 16 * 2**30  # the p3 instances' V100s have 16 GB

SCENARIOS = ("datacenter_on_demand", "datacenter_spot", "two_datacenters", "four_regions", "world_wide")
EXTRA_SCENARIOS = ("world_wide_uneven",)
_WORLD_REGIONS = ["Oregon", "Virginia", "Ohio", "Tokyo", "Seoul", "London", "Frankfurt", "Ireland"]


def paper_grid(n_paths: int = 8, **changes) -> GridSpec:
    values = dict(
        n_paths=n_paths,
        fragment_bytes=float(PAPER_FRAGMENT_BYTES),
        inner_steps=1,
        tokens_per_step=PAPER_TOKENS_PER_STEP,
    )
    values.update(changes)
    return GridSpec(**values)


def _blocks(n: int, k: int) -> np.ndarray:
    """Region index of each of n peers split into k contiguous, near-equal blocks."""
    return np.repeat(np.arange(k), [n // k + (1 if i < n % k else 0) for i in range(k)])


def _regional(
    n: int, names: list[str], pairs: dict, region: np.ndarray | None = None
) -> tuple[list[str], np.ndarray, np.ndarray]:
    region = _blocks(n, len(names)) if region is None else region
    lat_ms = np.full((len(names),) * 2, float(_INSIDE_REGION[0]))
    gbps = np.full((len(names),) * 2, _INSIDE_REGION[1])
    for (a, b), (ms, g) in pairs.items():
        i, j = names.index(a), names.index(b)
        lat_ms[i, j] = lat_ms[j, i] = ms
        gbps[i, j] = gbps[j, i] = g
    ids = [f"{names[r].lower()}-{k:04d}" for k, r in enumerate(region)]
    return ids, lat_ms[np.ix_(region, region)] / 1e3, gbps[np.ix_(region, region)] * GBPS


def _instances(n: int, sizes: list[int], inside_gbps: float, between_gbps: float):
    instance = np.repeat(np.arange(len(sizes)), sizes)[:n]
    ids = [f"gpu-{k:04d}" for k in range(n)]
    gbps = np.where(instance[:, None] == instance[None, :], inside_gbps, between_gbps)
    return ids, np.zeros((n, n)), gbps * GBPS


def scenario_matrices(name: str, n_peers: int, seed: int = 0) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(peer ids, latency seconds, bandwidth bytes/s) of a named scenario with n_peers peers."""
    if n_peers < 1:
        raise ConfigError(f"--peers must be >= 1, got {n_peers}")
    if name == "datacenter_on_demand":
        return _instances(n_peers, [8] * math.ceil(n_peers / 8), 100.0, 25.0)
    if name == "datacenter_spot":
        fours = n_peers // 8  # half of the GPUs in 4-GPU instances, as 32 of 64 in the paper
        return _instances(n_peers, [4] * fours + [1] * (n_peers - 4 * fours), 100.0, 10.0)
    if name == "two_datacenters":
        ids, lat, bw = _regional(n_peers, ["Ohio", "Virginia"], {("Ohio", "Virginia"): (10, 1.12)})
        same = np.equal.outer(*(2 * [_blocks(n_peers, 2)]))
        return ids, np.where(same, 1e-3, lat), np.where(same, 5.0 * GBPS, bw)
    if name == "four_regions":
        return _regional(n_peers, ["Virginia", "Oregon", "California", "Ohio"], _FOUR_REGIONS)
    if name == "world_wide":
        return _regional(n_peers, _WORLD_REGIONS, _WORLD)
    if name == "world_wide_uneven":
        rng = np.random.default_rng(seed)
        region = np.sort(rng.integers(0, len(_WORLD_REGIONS), size=n_peers))
        ids, lat, bw = _regional(n_peers, _WORLD_REGIONS, _WORLD, region)
        jitter = np.triu(rng.uniform(0.9, 1.1, size=(n_peers, n_peers)), 1)
        jitter = jitter + jitter.T
        return ids, lat * jitter, bw * jitter
    known = ", ".join(SCENARIOS + EXTRA_SCENARIOS)
    raise ConfigError(f"unknown scenario {name!r}; known: {known} or a .json file")


def make_scenario(
    name: str,
    n_peers: int = 64,
    grid: GridSpec | None = None,
    compute: Literal["uniform", "mixed"] = "uniform",
    seed: int = 0,
) -> SwarmSnapshot:
    """A snapshot of one of the paper's scenarios (module docstring), with the paper's workload
    unless `grid` says otherwise."""
    ids, lat, bw = scenario_matrices(name, n_peers, seed)
    tps = np.full(n_peers, V100_TOKENS_PER_SECOND)
    if compute == "mixed":
        tps = tps * np.random.default_rng(seed).choice([0.5, 1.0, 1.0, 2.0], size=n_peers)
    elif compute != "uniform":
        raise ConfigError(f"compute must be 'uniform' or 'mixed', got {compute!r}")
    mem = np.full(n_peers, V100_MEMORY_BYTES)
    return SwarmSnapshot.from_matrices(ids, lat, bw, grid or paper_grid(), tps, mem)


def load_scenario_json(path: str | Path, grid: GridSpec | None = None) -> SwarmSnapshot:
    """A scenario file: {"peers": [...], "latency_seconds": [[...]], "bandwidth_bytes_per_second":
    [[...]], "tokens_per_second": [...], "memory_bytes": [...] (optional)}.

    `null` marks a missing measurement (filled conservatively, see `snapshot`); NaN, infinities,
    negative latencies, non-positive bandwidths between distinct peers and ragged or non-square
    matrices are refused with a one-line ValueError naming the file and the field.
    """
    path = Path(path)
    where = f"scenario file {path}"
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{where}: cannot read it ({e.strerror})") from None
    try:
        data = json.loads(text, parse_constant=lambda c: _refuse(where, c))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object with peers and matrices")
    for key in ("peers", "latency_seconds", "bandwidth_bytes_per_second"):
        if key not in data:
            raise ConfigError(f"{where}: missing field {key!r}")
    peers = data["peers"]
    if not isinstance(peers, list) or not peers or not all(isinstance(p, str) and p for p in peers):
        raise ConfigError(f"{where}: 'peers' must be a non-empty list of non-empty strings")
    if len(set(peers)) != len(peers):
        raise ConfigError(f"{where}: 'peers' has duplicate ids")
    n = len(peers)
    matrices = {}
    for key in ("latency_seconds", "bandwidth_bytes_per_second"):
        m = data[key]
        if not isinstance(m, list) or len(m) != n or not all(isinstance(r, list) and len(r) == n for r in m):
            raise ConfigError(f"{where}: '{key}' must be a square {n}x{n} matrix (one row per peer)")
        matrices[key] = _numbers(m, where, key)
    vectors = {}
    for key in ("tokens_per_second", "memory_bytes"):
        v = data.get(key)
        if v is not None and (not isinstance(v, list) or len(v) != n):
            raise ConfigError(f"{where}: '{key}' must be a list of {n} values (one per peer)")
        vectors[key] = None if v is None else _numbers(v, where, key)
    lat, bw = matrices["latency_seconds"], matrices["bandwidth_bytes_per_second"]
    off = ~np.eye(n, dtype=bool)
    if np.any(lat[~np.isnan(lat)] < 0):
        raise ConfigError(f"{where}: 'latency_seconds' has a negative value")
    if np.any(bw[off & ~np.isnan(bw)] <= 0):
        raise ConfigError(f"{where}: 'bandwidth_bytes_per_second' must be > 0 between distinct peers")
    tps = vectors["tokens_per_second"]
    if tps is not None and np.any(tps[~np.isnan(tps)] <= 0):
        raise ConfigError(f"{where}: 'tokens_per_second' must be > 0")
    mem = vectors["memory_bytes"]
    if mem is not None and np.any(mem[~np.isnan(mem)] < 0):
        raise ConfigError(f"{where}: 'memory_bytes' must be >= 0")
    return SwarmSnapshot.from_matrices(peers, lat, bw, grid or paper_grid(), tps, mem)


def _refuse(where: str, constant: str):
    raise ConfigError(f"{where}: {constant} is not a measurement (use null for a missing value)")


def _numbers(values: list, where: str, key: str) -> np.ndarray:
    flat = values if not values or not isinstance(values[0], list) else [x for r in values for x in r]
    for x in flat:
        if x is not None and (isinstance(x, bool) or not isinstance(x, int | float)):
            raise ConfigError(f"{where}: '{key}' holds {x!r}, not a number or null")
    arr = np.array([np.nan if x is None else float(x) for x in flat], dtype=float)
    if np.any(np.isinf(arr)):
        raise ConfigError(f"{where}: '{key}' holds an infinite value")
    return arr.reshape(len(values), -1) if flat is not values else arr


def load_scenario(
    name_or_file: str,
    n_peers: int | None = None,
    grid: GridSpec | None = None,
    compute: Literal["uniform", "mixed"] = "uniform",
    seed: int = 0,
) -> SwarmSnapshot:
    """A named scenario (`n_peers` peers, default 64) or a JSON file (its first `n_peers` peers in
    sorted-id order when given)."""
    if name_or_file.endswith(".json") or Path(name_or_file).is_file():
        snap = load_scenario_json(name_or_file, grid)
        if n_peers is not None:
            if n_peers > snap.n_peers:
                raise ConfigError(f"--peers {n_peers}: scenario file has only {snap.n_peers} peers")
            snap = snap.subset(snap.peer_ids[:n_peers])
        return snap
    return make_scenario(name_or_file, 64 if n_peers is None else n_peers, grid, compute, seed)
