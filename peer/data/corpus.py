"""An offline, seeded, multi-domain toy corpus for the demo and the tests (nothing is downloaded).

DiPaCo only pays off when documents fall into groups that a router can tell apart from their first
tokens, so the domains here differ in their byte statistics (digits and operators, English words,
indented code, delimited records, a diacritic-heavy made-up language) while each stays regular
enough for a tiny model to push its loss well below the uniform log(vocab).

Documents depend only on (seed, document index), through `random.Random` seeded with an int, which
is stable across processes and platforms: the same seed always gives byte-identical text.
"""

from __future__ import annotations

import functools
import json
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from peer.seeding import stable_seed

DOMAINS: list[str] = ["arithmetic", "prose", "code", "records", "lingua"]

MIN_CHARS = 200
MAX_CHARS = 1500
# Every unit (a line, sentence or function) stays under this, so stopping at the first unit that
# crosses a target of at most MAX_TARGET never overshoots MAX_CHARS.
_MAX_UNIT = 280
_MAX_TARGET = MAX_CHARS - _MAX_UNIT


def _arithmetic_unit(rng: random.Random, state: dict) -> str:
    kind = rng.randrange(6)
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    if kind == 0:
        return f"{a} + {b} = {a + b}."
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"{a} - {b} = {a - b}."
    if kind == 2:
        x, y = rng.randint(2, 12), rng.randint(2, 12)
        return f"{x} * {y} = {x * y}."
    if kind == 3:
        return f"{a} is {'even' if a % 2 == 0 else 'odd'}."
    if kind == 4:
        return f"twice {b} is {2 * b}, and half of {2 * a} is {a}."
    # Counting runs give long stretches that are fully predictable from the context.
    start = rng.randint(1, 500)
    return "count: " + ", ".join(str(start + i) for i in range(rng.randint(4, 9))) + "."


_DETS = ["the", "a", "every", "some", "this", "that", "one"]
_ADJS = (
    "quiet old bright small heavy gentle narrow ancient green tired curious silver warm empty brave "
    "distant yellow wooden honest eager"
).split()
_TOPIC_NOUNS = {
    "sea": ["boat", "sailor", "harbor", "wave", "gull", "island", "net", "lighthouse", "anchor", "tide"],
    "forest": ["fox", "owl", "oak", "path", "hunter", "river", "stone", "deer", "cabin", "mushroom"],
    "town": "baker market teacher bridge clock street window merchant lamp square".split(),
}
_VERBS = (
    "watched followed carried found remembered painted lifted visited answered greeted crossed opened "
    "guarded admired called touched noticed praised"
).split()
_PREPS = ["near", "under", "behind", "beside", "across", "toward", "inside", "beyond"]
_ADVS = ["slowly", "quietly", "happily", "suddenly", "carefully", "often", "rarely", "gladly"]


def _noun_phrase(rng: random.Random, nouns: list[str]) -> str:
    det = rng.choice(_DETS)
    words = [rng.choice(_ADJS)] if rng.random() < 0.5 else []
    words.append(rng.choice(nouns))
    if det == "a" and words[0][0] in "aeiou":
        det = "an"
    return " ".join([det, *words])


def _prose_unit(rng: random.Random, state: dict) -> str:
    nouns = state.setdefault("nouns", _TOPIC_NOUNS[rng.choice(sorted(_TOPIC_NOUNS))])
    np1, np2, np3 = (_noun_phrase(rng, nouns) for _ in range(3))
    verb, verb2 = rng.choice(_VERBS), rng.choice(_VERBS)
    form = rng.randrange(4)
    if form == 0:
        s = f"{np1} {verb} {np2} {rng.choice(_PREPS)} {np3}."
    elif form == 1:
        s = f"{np1} {rng.choice(_ADVS)} {verb} {np2}, and {np3} {verb2} it."
    elif form == 2:
        s = f"when {np1} {verb} {np2}, {np3} {verb2} them {rng.choice(_ADVS)}."
    else:
        s = f"{np1} was {rng.choice(_ADJS)}, so {np2} {verb} {np3}."
    return s[0].upper() + s[1:]


_CODE_VERBS = ["load", "parse", "scale", "filter", "merge", "count", "find", "build", "sort", "check"]
_CODE_NOUNS = ["items", "values", "rows", "names", "scores", "records", "tokens", "paths", "nodes", "lines"]
_CODE_VARS = ["result", "total", "out", "acc", "seen", "buf"]


def _code_unit(rng: random.Random, state: dict) -> str:
    verb, noun = rng.choice(_CODE_VERBS), rng.choice(_CODE_NOUNS)
    var, x = rng.choice(_CODE_VARS), noun[0]
    n, m = rng.randint(0, 99), rng.randint(2, 9)
    form = rng.randrange(4)
    if form == 0:
        return (
            f"def {verb}_{noun}({noun}, limit={n}):\n"
            f"    {var} = []\n"
            f"    for {x} in {noun}:\n"
            f"        if {x} {rng.choice(['<', '>', '<=', '>=', '!='])} limit:\n"
            f"            {var}.append({x} {rng.choice(['*', '+', '-', '//'])} {m})\n"
            f"    return {var}\n"
        )
    if form == 1:
        return (
            f"def {verb}_{noun}({noun}):\n"
            f"    {var} = 0\n"
            f"    i = 0\n"
            f"    while i < len({noun}):\n"
            f"        {var} += {noun}[i] * {m}\n"
            f"        i += 1\n"
            f"    return {var}\n"
        )
    if form == 2:
        cls = verb.capitalize() + noun.capitalize().rstrip("s")
        return (
            f"class {cls}:\n"
            f"    def __init__(self, size={n}):\n"
            f"        self.size = size\n"
            f"        self.{noun} = []\n"
            f"\n"
            f"    def add(self, value):\n"
            f"        self.{noun}.append(value)\n"
            f"        return len(self.{noun})\n"
        )
    return (
        f"# {verb} the {noun} and keep the first {m}\n"
        f"{noun} = [{', '.join(str(rng.randint(0, 99)) for _ in range(rng.randint(3, 8)))}]\n"
        f"assert {verb}_{noun}({noun})[:{m}] is not None\n"
    )


_USERS = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
_CITIES = ["paris", "lagos", "lima", "oslo", "pune", "kyoto", "quito", "perth"]
_ACTIONS = ["login", "logout", "upload", "download", "delete", "search"]
_LEVELS = ["INFO", "INFO", "INFO", "WARN", "ERROR", "DEBUG"]


def _records_unit(rng: random.Random, state: dict) -> str:
    fmt = state.setdefault("fmt", rng.choice(["csv", "jsonl", "log"]))
    state["id"] = state.get("id", rng.randint(1, 9000)) + 1
    state["t"] = state.get("t", rng.randint(0, 80000)) + rng.randint(1, 90)
    user, ms = rng.choice(_USERS), rng.randint(1, 999)
    header = ""
    if fmt == "csv":
        if state["id"] == state.setdefault("first_id", state["id"]):
            header = "id,user,city,age,score\n"
        city, age, score = rng.choice(_CITIES), rng.randint(18, 90), rng.randint(0, 1000) / 10
        return f"{header}{state['id']},{user},{city},{age},{score}"
    if fmt == "jsonl":
        ok = "true" if rng.random() < 0.8 else "false"
        action = rng.choice(_ACTIONS)
        return f'{{"id": {state["id"]}, "user": "{user}", "action": "{action}", "ok": {ok}, "ms": {ms}}}'
    hh, mm, ss = state["t"] // 3600 % 24, state["t"] // 60 % 60, state["t"] % 60
    ip = f"10.{rng.randint(0, 9)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}"
    day, level = state.setdefault("day", rng.randint(10, 28)), rng.choice(_LEVELS)
    stamp = f"2024-05-{day}T{hh:02d}:{mm:02d}:{ss:02d}Z"
    return f"{stamp} {level} {rng.choice(_ACTIONS)}: user {user} from {ip} ({ms} ms)"


# A made-up agglutinative language: stems plus case and tense suffixes, rich in two-byte UTF-8.
_LINGUA_STEMS = (
    "kälö mürs tövä saarn jälk öttö vür hänn pyör lëmp äskel yrtt söl kümm tälv nöör rüsk väin".split()
)
_LINGUA_CASES = ["", "ssä", "llä", "ja", "ën", "stä", "lle"]
_LINGUA_VERBS = ["näkü", "kantö", "löytä", "muistë", "avaü", "kutsü"]
_LINGUA_TENSES = ["i", "nüt", "isi", "kööt", "vät"]


def _lingua_unit(rng: random.Random, state: dict) -> str:
    words = [rng.choice(_LINGUA_STEMS) + rng.choice(_LINGUA_CASES) for _ in range(rng.randint(2, 5))]
    words.append(rng.choice(_LINGUA_VERBS) + rng.choice(_LINGUA_TENSES))
    s = " ".join(words) + rng.choice([".", ".", ".", "?", "!"])
    return s[0].upper() + s[1:]


_UNIT: dict[str, tuple[Callable[[random.Random, dict], str], str]] = {
    "arithmetic": (_arithmetic_unit, "\n"),
    "prose": (_prose_unit, " "),
    "code": (_code_unit, "\n"),
    "records": (_records_unit, "\n"),
    "lingua": (_lingua_unit, " "),
}


def _domain_of(index: int, seed: int) -> str:
    # Every block of len(DOMAINS) consecutive documents holds each domain once, in a seeded order:
    # domains stay exactly balanced on any prefix, yet no position predicts the domain.
    block, offset = divmod(index, len(DOMAINS))
    order = list(DOMAINS)
    random.Random(stable_seed("pathswarm-corpus-order", seed, block)).shuffle(order)
    return order[offset]


def generate_document(index: int, seed: int) -> dict[str, str]:
    domain = _domain_of(index, seed)
    rng = random.Random(stable_seed("pathswarm-corpus", seed, index))
    unit, sep = _UNIT[domain]
    state: dict = {}
    target = rng.randint(MIN_CHARS, _MAX_TARGET)
    text = ""
    while len(text) < target:
        text = text + sep + unit(rng, state) if text else unit(rng, state)
    assert MIN_CHARS <= len(text) <= MAX_CHARS, (domain, len(text))
    return {"text": text, "domain": domain}


def generate_documents(n_docs: int, seed: int) -> list[dict[str, str]]:
    """`n_docs` documents {"text", "domain"}; a prefix of a longer call gives the same documents."""
    return [dict(d) for d in iter_documents(n_docs, seed)]  # copies: a caller's edit stays its own


_made_lock = threading.Lock()
#: the most documents of one seed kept in a process (about 0.8 kB each): a peer reads its corpus
#: again at every path it moves to, and generating it is most of what that read costs
KEPT_DOCUMENTS = 100_000


@functools.lru_cache(maxsize=4)
def _kept(seed: int) -> list[dict[str, str]]:
    return []


def iter_documents(n_docs: int, seed: int) -> Iterator[dict[str, str]]:
    """The documents of `generate_documents(n_docs, seed)`, made as they are read (a reader that
    stops early makes only what it read) and kept for the process's later readers, up to
    `KEPT_DOCUMENTS` of each seed (the last four seeds read). The dicts are shared: read, never edit."""
    if n_docs < 0:
        raise ValueError(f"n_docs must be >= 0, got {n_docs}")
    made = _kept(seed)
    for i in range(n_docs):
        if i < len(made):
            yield made[i]
            continue
        doc = generate_document(i, seed)
        # readers in other threads may have made it meanwhile: keep one copy, in order
        with _made_lock:
            if len(made) == i and i < KEPT_DOCUMENTS:
                made.append(doc)
        yield doc


def write_corpus(
    directory: str | Path,
    n_docs: int,
    seed: int,
    fmt: Literal["jsonl", "txt"] = "jsonl",
    docs_per_file: int = 1000,
) -> list[Path]:
    """Writes part-NNNNN.jsonl ({"text", "domain"} per line) or part-NNNNN.txt (one document per line).

    The text format holds one document per line, so newlines inside a document become spaces there.
    """
    if fmt not in ("jsonl", "txt"):
        raise ValueError(f"unknown corpus format {fmt!r}; use 'jsonl' or 'txt'")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    docs = generate_documents(n_docs, seed)
    paths = []
    for part, start in enumerate(range(0, max(n_docs, 1), docs_per_file)):
        path = out / f"part-{part:05d}.{fmt}"
        chunk = docs[start : start + docs_per_file]
        if fmt == "jsonl":
            lines = [json.dumps(d, ensure_ascii=False, sort_keys=True) for d in chunk]
        else:
            lines = [d["text"].replace("\n", " ") for d in chunk]
        # newline="" keeps the bytes identical on every platform.
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write("".join(line + "\n" for line in lines))
        paths.append(path)
    return paths
