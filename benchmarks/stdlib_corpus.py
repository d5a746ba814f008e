"""A real-text corpus from local files: `python -m benchmarks.stdlib_corpus --out FILE.jsonl`.

Paragraphs (blank-line separated, 200 to 2,000 characters) of the running Python's standard library
sources (`<stdlib>/*.py`), one JSON line each with a "text" field: code and docstrings written by
people, on every machine, with no download. Python 3.11's gives 6,762 paragraphs (3.1 MB);
`--recursive` adds its packages' sources too (`<stdlib>/**/*.py`, installed packages left out): about
46,000 paragraphs (20 MB), for budgets that would repeat the smaller corpus
(`python -m benchmarks.dipaco --data_files FILE.jsonl`).
"""

from __future__ import annotations

import argparse
import json
import re
import sysconfig
from pathlib import Path

#: folders under the stdlib that hold installed packages, not the standard library
INSTALLED = {"site-packages", "dist-packages"}


def paragraphs(folder: Path, recursive: bool = False) -> list[str]:
    out = []
    sources = folder.rglob("*.py") if recursive else folder.glob("*.py")
    for source in sorted(s for s in sources if not INSTALLED & set(s.relative_to(folder).parts)):
        text = source.read_text(encoding="utf-8", errors="ignore")
        out += [p.strip() for p in re.split(r"\n\s*\n", text) if 200 <= len(p.strip()) <= 2000]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recursive", action="store_true", help="its packages too (~7x the text)")
    args = parser.parse_args()
    docs = paragraphs(Path(sysconfig.get_paths()["stdlib"]), args.recursive)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    print(f"{len(docs)} documents, {sum(map(len, docs))} characters -> {args.out}")


if __name__ == "__main__":
    main()
