"""What one robust aggregation costs, and whether it gives the bits an earlier version gave.

Times `peer.sync.aggregate.aggregate` on `--parts` random parts of `--numel` values, dense and
sparse (`--density` of each part nonzero, as sparse2bit's 92 of 4096), for every aggregator; with
`--reference COMMIT` the same inputs also go through that commit's `peer/sync/aggregate.py` (read
with `git show`), side by side, and the table says whether both gave the same bits.

    python -m benchmarks.aggregate_cost --reference e6a45ab
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from peer.sync import aggregate as current


def load_reference(commit: str, path: str = "peer/sync/aggregate.py"):
    """The module at `path` as it was at `commit`, as a module of its own (its imports are today's)."""
    repo = Path(__file__).resolve().parents[1]
    show = ["git", "show", f"{commit}:{path}"]
    source = subprocess.run(show, cwd=repo, check=True, capture_output=True, text=True).stdout
    name = Path(path).stem + "_reference"
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / f"{name}.py"
        file.write_text(source)
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return module


def parts(n: int, numel: int, density: float, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = np.zeros(numel, dtype=np.float32)
        kept = rng.choice(numel, int(density * numel), replace=False) if density < 1 else np.arange(numel)
        x[kept] = rng.normal(scale=1e-3, size=kept.size).astype(np.float32)
        out.append(x)
    return out


def timed_call(call, repeats: int) -> tuple[float, object]:
    """ms per call of `call` (after one untimed call), and that first call's result."""
    result = call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3, result


def timed(module, xs: list[np.ndarray], method: str, repeats: int) -> tuple[float, np.ndarray]:
    contributions = [module.Contribution(f"p{i}", x, 1.0 + i % 3) for i, x in enumerate(xs)]
    config = module.AggregatorConfig(method=method)
    return timed_call(lambda: module.aggregate(contributions, config), repeats)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", type=int, default=4)
    p.add_argument("--numel", type=int, default=810_000, help="values per part (a WAN lab fragment round)")
    p.add_argument("--density", type=float, default=92 / 4096, help="nonzero share of a sparse part")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--reference", default=None, help="a commit whose aggregate.py to run beside")
    args = p.parse_args(argv)
    reference = load_reference(args.reference) if args.reference else None
    print(f"{args.parts} parts of {args.numel:,} values; ms per aggregation")
    print("| parts | method | ms | " + (f"ms at {args.reference} | same bits |" if reference else ""))
    print("|---|---|---:|" + ("---:|---|" if reference else ""))
    for kind, density in (("dense", 1.0), ("sparse", args.density)):
        xs = parts(args.parts, args.numel, density, seed=0)
        for method in current.AGGREGATORS:
            ms, result = timed(current, xs, method, args.repeats)
            row = f"| {kind} | {method} | {ms:.1f} |"
            if reference is not None:
                ref_ms, ref_result = timed(reference, xs, method, args.repeats)
                row += f" {ref_ms:.1f} | {'yes' if ref_result.tobytes() == result.tobytes() else 'NO'} |"
            print(row)


if __name__ == "__main__":
    main()
