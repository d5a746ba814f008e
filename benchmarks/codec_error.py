"""What each codec costs and loses: `python -m benchmarks.codec_error --out DIR`.

Every codec of the table (`peer.codecs.specs.CODEC_SPECS`) encodes and decodes, through the real
`peer.codecs.formats` functions, flat float32 vectors of several sizes and seeds drawn from:

* **gaussian**: N(0, 0.01²), what `tests/test_streaming.py` feeds the codecs (the scale matters only
  to fp16, whose subnormals start at 6e-5);
* **student-t**: Student's t with 3 degrees of freedom, rescaled to the same standard deviation: a
  heavy-tailed stand-in for an outer gradient (a few coordinates far larger than the rest, which is
  what block absmax scales suffer from).

Per codec: bytes per number measured from the encoded payload (largest size, so the last block's
padding is negligible) against the table's `wire_bytes_per_value`, and the relative L2 error
|x − decode(encode(x))| / |x|, mean and max over sizes and seeds. For the sparse codec the error of
one sync is mostly *dropped mass*, the part of the outer gradient kept back as error feedback and
sent in later syncs; the JSON splits it into dropped (values not sent) and rounding (of the values
sent). `error_bound` in the table is the Gaussian max here × 1.5 (tests check it).

Writes DIR/codec_error.json, DIR/codec_error.md and DIR/codec_error.png, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from peer.codecs.formats import make_codec
from peer.codecs.specs import CODEC_SPECS

SIZES = (1_000, 10_001, 100_000, 1_000_000)
SCALE = 0.01  # the standard deviation of every sample (the test's Gaussian)
STUDENT_DF = 3
DISTRIBUTIONS = ("gaussian", "student-t")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.codec_error", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated vector lengths")
    return p.parse_args(argv)


def sample(distribution: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if distribution == "gaussian":
        return torch.randn(n, generator=g) * SCALE
    # t = z / sqrt(chi²_ν / ν), chi²_ν a sum of ν squared normals; its variance ν / (ν − 2) is divided
    # out so the std is SCALE
    z = torch.randn(n, generator=g, dtype=torch.float64)
    chi2 = torch.randn(n, STUDENT_DF, generator=g, dtype=torch.float64).square().sum(1)
    t = z / (chi2 / STUDENT_DF).sqrt()
    return (t * SCALE / (STUDENT_DF / (STUDENT_DF - 2)) ** 0.5).float()


def round_trip(name: str, x: torch.Tensor) -> dict[str, float]:
    """One encode/decode: bytes per number and relative errors (total; sparse: dropped and rounding)."""
    codec = make_codec(name)
    data = codec.encode(x)
    y = codec.decode(data, x.numel())
    norm = float(x.double().norm())
    out = dict(bytes_per_number=len(data) / x.numel(), rel_error=float((x - y).double().norm()) / norm)
    if CODEC_SPECS[name].topk:
        sent = y != 0
        out["dropped"] = float(x[~sent].double().norm()) / norm
        out["rounding"] = float((x[sent] - y[sent]).double().norm()) / norm
    return out


def measure(name: str, distribution: str, sizes: list[int], seeds: int) -> dict:
    """Every size and seed of one codec on one distribution, summarised."""
    runs = [
        round_trip(name, sample(distribution, n, s)) | dict(size=n, seed=s)
        for n in sizes
        for s in range(seeds)
    ]
    out = dict(bytes_per_number=next(r["bytes_per_number"] for r in runs if r["size"] == max(sizes)))
    for key in ("rel_error", "dropped", "rounding"):
        if key in runs[0]:
            values = [r[key] for r in runs]
            out[f"{key}_mean"], out[f"{key}_max"] = statistics.fmean(values), max(values)
    out["runs"] = runs
    return out


def run(sizes: list[int], seeds: int) -> dict:
    codecs = {}
    for name, spec in CODEC_SPECS.items():
        print(f"{name}: {len(sizes)} sizes x {seeds} seeds x {len(DISTRIBUTIONS)} distributions", flush=True)
        codecs[name] = dict(
            table_bytes_per_number=spec.wire_bytes_per_value,
            error_bound=spec.error_bound,
            **{d: measure(name, d, sizes, seeds) for d in DISTRIBUTIONS},
        )
    return dict(sizes=sizes, seeds=seeds, scale=SCALE, student_df=STUDENT_DF, codecs=codecs)


def table(results: dict) -> str:
    lines = [
        "| codec | bytes / number (measured) | (table) | rel. L2 error, Gaussian: mean | max "
        "| Student-t ν=3: mean | max | error_bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c in results["codecs"].items():
        g, t = c["gaussian"], c["student-t"]
        lines.append(
            f"| {name} | {g['bytes_per_number']:.4f} | {c['table_bytes_per_number']:.4f} "
            f"| {g['rel_error_mean']:.2e} | {g['rel_error_max']:.2e} | {t['rel_error_mean']:.2e} "
            f"| {t['rel_error_max']:.2e} | {c['error_bound']:.2e} |"
        )
    for name, c in results["codecs"].items():
        if "dropped_mean" in c["gaussian"]:
            g, t = c["gaussian"], c["student-t"]
            lines.append(
                f"\n{name}: of the error, dropped mass (kept back as error feedback, sent later) "
                f"{g['dropped_mean']:.3f} Gaussian / {t['dropped_mean']:.3f} Student-t; rounding of the "
                f"values sent {g['rounding_mean']:.3f} / {t['rounding_mean']:.3f} (relative L2, means)"
            )
    lines.append(
        f"\nsizes {', '.join(f'{n:,}' for n in results['sizes'])}; seeds {results['seeds']}; "
        f"std {results['scale']}; bytes measured at the largest size"
    )
    return "\n".join(lines)


def plot(out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, c in results["codecs"].items() if c["gaussian"]["rel_error_max"] > 0]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.38
    for i, (dist, color) in enumerate(zip(DISTRIBUTIONS, ("#1f77b4", "#ff7f0e"), strict=True)):
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        means = [results["codecs"][n][dist]["rel_error_mean"] for n in names]
        maxes = [results["codecs"][n][dist]["rel_error_max"] for n in names]
        ax.bar(xs, means, width, color=color, label=f"{dist} (mean; whisker: max)")
        ax.errorbar(xs, means, yerr=[[0] * len(names), [b - a for a, b in zip(means, maxes, strict=True)]],
                    fmt="none", ecolor="black", capsize=3, lw=1)  # fmt: skip
        for x, mean in zip(xs, means, strict=True):  # inside the bar: above it sit whisker and bound
            ax.text(x, mean / 1.25, f"{mean:.2g}", ha="center", va="top", color="white", fontsize=8)
    # the bounds hold for Gaussian data: drawn over the Gaussian bars
    bounds = [results["codecs"][n]["error_bound"] for n in names]
    xs = [j - 0.5 * width for j in range(len(names))]
    ax.scatter(xs, bounds, marker="_", s=500, color="red", zorder=3, label="error_bound (tests)")
    labels = [f"{n}\n{results['codecs'][n]['gaussian']['bytes_per_number']:.3f} B/num" for n in names]
    ax.set_xticks(range(len(names)), labels)
    ax.set_yscale("log")
    ax.set_ylim(1e-5, 3)
    ax.set_ylabel("relative L2 error of one round trip")
    ax.set_title("codec error (sparse: mostly dropped mass, sent later as error feedback); fp32 is exact")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = run([int(s) for s in args.sizes.split(",") if s.strip()], args.seeds)
    (args.out / "codec_error.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results)
    (args.out / "codec_error.md").write_text("# Codec round-trip error\n\n" + text + "\n")
    plot(args.out / "codec_error.png", results)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
