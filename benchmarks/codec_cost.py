"""What encoding and decoding one part costs, and whether an earlier version sent the same bytes.

Times `encode` and `decode` of each codec on a part of `--numel` values (a WAN lab fragment round,
values like an outer gradient's); with `--reference COMMIT` the same part also goes through that
commit's `peer/codecs/formats.py` (read with `git show`), side by side, and the table says whether
both encoded the same bytes and decoded them to the same values.

    python -m benchmarks.codec_cost --reference cc1a9d7
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.aggregate_cost import load_reference, timed_call
from peer.codecs import formats as current

CODECS = ("nf4", "e3m0", "int8", "sparse", "sparse2bit", "dense2bit")


def row(module, name: str, x: torch.Tensor, repeats: int) -> tuple[float, float, bytes, bytes]:
    codec = module.make_codec(name)
    encode_ms, data = timed_call(lambda: codec.encode(x), repeats)
    decode_ms, values = timed_call(lambda: codec.decode(data, x.numel()), repeats)
    return encode_ms, decode_ms, data, values.numpy().tobytes()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=810_000, help="values per part (a WAN lab fragment round)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--reference", default=None, help="a commit whose formats.py to run beside")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # a peer's sync threads: one core each
    reference = load_reference(args.reference, "peer/codecs/formats.py") if args.reference else None
    x = torch.from_numpy(np.random.default_rng(0).normal(scale=1e-3, size=args.numel).astype(np.float32))
    print(f"one part of {args.numel:,} values; ms per call")
    then = f" encode at {args.reference} | decode at {args.reference} | same bytes and values |"
    print("| codec | encode | decode |" + (then if reference else ""))
    print("|---|---:|---:|" + ("---:|---:|---|" if reference else ""))
    for name in CODECS:
        encode_ms, decode_ms, data, values = row(current, name, x, args.repeats)
        line = f"| {name} | {encode_ms:.1f} | {decode_ms:.1f} |"
        if reference is not None:
            ref_encode, ref_decode, ref_data, ref_values = row(reference, name, x, args.repeats)
            same = ref_data == data and ref_values == values
            line += f" {ref_encode:.1f} | {ref_decode:.1f} | {'yes' if same else 'NO'} |"
        print(line)


if __name__ == "__main__":
    main()
