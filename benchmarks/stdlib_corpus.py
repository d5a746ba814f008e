"""A real-text corpus from local files: `python -m benchmarks.stdlib_corpus --out FILE.jsonl`.

Paragraphs (blank-line separated, 200 to 2,000 characters) of the running Python's standard library
sources (`<stdlib>/*.py`), one JSON line each with a "text" field: code and docstrings written by
people, on every machine, with no download. Python 3.11's gives 6,762 paragraphs (3.1 MB);
`--recursive` adds its packages' sources too (`<stdlib>/**/*.py`, installed packages left out): about
46,000 paragraphs (20 MB), for budgets that would repeat the smaller corpus
(`python -m benchmarks.dipaco --data_files FILE.jsonl`); `--site_packages` adds the installed
packages' sources as well (every `site-packages` folder of the running Python: torch, numpy and the
rest, written by people too), for budgets that would repeat even that. A paragraph that occurs more
than once (licence headers, generated stubs) is kept once, so held-out documents never occur in
training.
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
        out += file_paragraphs(source)
    return out


def file_paragraphs(source: Path) -> list[str]:
    """The blank-line separated paragraphs of one source file that are 200 to 2,000 characters."""
    text = source.read_text(encoding="utf-8", errors="ignore")
    return [p.strip() for p in re.split(r"\n\s*\n", text) if 200 <= len(p.strip()) <= 2000]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recursive", action="store_true", help="its packages too (~7x the text)")
    parser.add_argument(
        "--site_packages",
        action="store_true",
        help="and the installed packages' sources (implies --recursive)",
    )
    args = parser.parse_args()
    paths = sysconfig.get_paths()
    docs = paragraphs(Path(paths["stdlib"]), args.recursive or args.site_packages)
    if args.site_packages:
        for folder in sorted({paths["purelib"], paths["platlib"]}):
            docs += [d for source in sorted(Path(folder).rglob("*.py")) for d in file_paragraphs(source)]
    docs = list(dict.fromkeys(docs))  # each paragraph once, in order
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    print(f"{len(docs)} documents, {sum(map(len, docs))} characters -> {args.out}")


if __name__ == "__main__":
    main()
