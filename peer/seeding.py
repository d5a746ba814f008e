"""Seeds that are the same in every process, on every platform and Python version (unlike hash()).

Everything that peers must agree on without talking — module initialisation, data order, tie-breaks
between peers, donors — is seeded from `stable_seed` of the things it depends on.
"""

from __future__ import annotations

import hashlib


def stable_seed(*parts: object) -> int:
    """A seed that is the same in every process and Python version (unlike hash())."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF
