"""A cap on how many records one DHT node keeps under a key, and which records it keeps.

hivemind stores every valid subkey under a key and answers a lookup with all of them in one message:
a flood of free keys under one key grows the reply past hivemind's 4 MiB limit and every reader of
that key gets nothing. Under a capped key (a run's claim shards, registered by
`dht.validators.RecordSchemaValidator`) a node keeps at most `cap` records. When a new owner arrives
at a full key, the node keeps the higher ranked of it and its lowest ranked record:

1. records whose admission token the run's creator signed (`admitted(peer_id, token)`) first: keys
   cost nothing, a creator's signature does (under the manifest key: copies of this node's own run's
   manifest, which only its creator could sign);
2. then by a hash of the owner key salted with a secret this node draws at start, so each node keeps
   a different sample of the rest and nobody can choose a key that wins everywhere.

Records without admission take at most `unadmitted_cap` places of a key that holds admitted ones
(an open run with an authority: its established peers carry tokens, newcomers on probation do not):
a flood of free keys then fills a small part of the shard, not all of it, so that every find of the
key (a store's traversal, a heartbeat's read) carries and checks a few dozen strangers' claims, not
hundreds. A key without any admitted record (an open run whose creator runs no authority: nobody has
a token) keeps up to `cap` of them, as before.

An owner already stored renews its record (a stranger over the strangers' share, stored before
the key held admitted records, only if it outranks the lowest, which it evicts). In an invite run
(`admitted_only`) no key takes part without the creator's admission, so a node keeps no record whose
owner it does not admit: a flood of free keys then costs each node a signature check per store, not
a full shard that every find of the key carries back (hivemind's store traverses with finds) and
every reader checks again.

hivemind's storage has no hook for this, so the node's storage class is wrapped once at import (as
dht/node.py wraps the DHT process); the limits live in this module because validators and storage
meet only inside the DHT process.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import os
import weakref
from collections.abc import Callable

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils import MSGPackSerializer

Admitted = Callable[[str, str], bool]
#: ranks a node remembers (a decode and a cached signature check each to recompute)
MAX_REMEMBERED_RANKS = 65536


class SubkeyCap:
    """At most `cap` records per key among `keys`, ranked as the module docstring says."""

    def __init__(
        self,
        keys: list[bytes],
        cap: int,
        admitted: Admitted | None = None,
        admitted_only: bool = False,
        unadmitted_cap: int | None = None,
        first: Callable[[dict], bool] | None = None,
    ):
        """`admitted(peer_id, token)` ranks first the records whose `peer_id` the run admitted by
        their `admission` token (claims); `first(record)` is any other such rule on the decoded record
        (a manifest of this node's own run). "Admitted" below means ranked first by either."""
        if admitted is not None and first is not None:
            raise ValueError("rank records first by admission or by another rule, not both")
        if admitted_only and admitted is None and first is None:
            raise ValueError("admitted_only needs the run's admission check (admitted)")
        self.keys = {DHTID.from_bytes(k) for k in keys}
        self.cap = cap
        #: places of a key holding admitted records that records without admission may take
        self.unadmitted_cap = cap if unadmitted_cap is None else min(cap, unadmitted_cap)
        self.admitted = admitted
        self.first = first
        self.admitted_only = admitted_only
        self._salt = os.urandom(16)
        self._ranks: dict[tuple[DHTID, object], tuple[bool, bytes]] = {}
        #: per stored dictionary (a node's storage and its cache each hold one per key, and a key that
        #: expired and came back has a new one), a min-heap of (rank, tiebreak, subkey) of its records,
        #: lowest first; stale items (evicted, expired or re-ranked records) are dropped at the top
        self._heaps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._tiebreak = itertools.count()
        #: per stored dictionary, the subkeys stored with admission (`_admitted_in` drops stale ones)
        self._admitted_subkeys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def rank(self, key: DHTID, subkey, value: bytes) -> tuple[bool, bytes]:
        """(admitted, salted hash of the owner) of a record now being stored: higher is kept.
        Remembered per owner, so that a full key's lowest rank costs lookups, not decodes."""
        admitted = False
        if self.admitted is not None or self.first is not None:
            try:
                record = MSGPackSerializer.loads(RSASignatureValidator._SIGNATURE_RE.sub(b"", value))
                if self.first is not None:
                    admitted = bool(self.first(record))
                else:
                    admitted = bool(self.admitted(str(record["peer_id"]), str(record.get("admission", ""))))
            except Exception:  # a record this node could not rank is ranked last, never trusted
                admitted = False
        owner = subkey if isinstance(subkey, bytes) else repr(subkey).encode()
        rank = (admitted, hashlib.blake2b(self._salt + owner, digest_size=16).digest())
        if len(self._ranks) >= MAX_REMEMBERED_RANKS:
            self._ranks.clear()  # mostly owners long gone; a stored record's rank is recomputed
        self._ranks[(key, subkey)] = rank
        return rank

    def _known_rank(self, key: DHTID, subkey, value: bytes) -> tuple[bool, bytes]:
        known = self._ranks.get((key, subkey))
        return known if known is not None else self.rank(key, subkey, value)

    def make_room(self, key: DHTID, entries: DictionaryDHTValue, subkey, value: bytes) -> bool:
        """Whether `subkey` may be stored in `entries` now, evicting the lowest ranked if needed.
        Every store ranks its record (its admission may have changed). The lowest ranked record of a
        full key comes from a heap kept per stored dictionary, so a store costs O(log cap) amortized:
        a scan of the key's records on every store took most of a storage node's CPU under a flood."""
        new = self.rank(key, subkey, value)
        if self.admitted_only and not new[0]:
            return False
        # a renewal takes no new place; but strangers stored before the key held admitted records may
        # be over their share, and then a renewal too must outrank the lowest (which it evicts)
        if len(entries) + (subkey not in entries) <= self._room(key, entries, new):
            self._push(key, entries, new, subkey)
            return True
        worst, worst_rank = self._lowest(key, entries)
        if worst_rank is not None and new <= worst_rank:
            return False
        if worst is not None:
            del entries[worst]
            heapq.heappop(self._heaps[entries])
        self._push(key, entries, new, subkey)
        return True

    def _room(self, key: DHTID, entries: DictionaryDHTValue, rank: tuple[bool, bytes]) -> int:
        """How many records `entries` may hold when a record of `rank` arrives: `cap`, or for one
        without admission at a key that holds admitted records, those plus `unadmitted_cap`. At a key
        at its room the lowest ranked record is one without admission, so a newcomer that outranks it
        takes its place and the count without admission stays."""
        if rank[0] or len(entries) < self.unadmitted_cap:
            return self.cap
        admitted = self._admitted_in(key, entries)
        return self.cap if admitted == 0 else min(self.cap, self.unadmitted_cap + admitted)

    def _admitted_in(self, key: DHTID, entries: DictionaryDHTValue) -> int:
        """How many of `entries` are admitted: the subkeys pushed with admission, checked against
        what `entries` still holds (evicted, expired or re-ranked ones leave), so a store at a key full
        of strangers' records looks up the few admitted ones, not every record."""
        marked = self._marked(key, entries)
        for s in list(marked):
            item = entries.get(s)
            if item is None or not self._known_rank(key, s, item.value)[0]:
                marked.discard(s)
        return len(marked)

    def _marked(self, key: DHTID, entries: DictionaryDHTValue) -> set:
        """The subkeys of `entries` marked admitted; a dictionary first seen (stored whole, or its
        first record stored by hivemind itself) is marked from its records once."""
        marked = self._admitted_subkeys.get(entries)
        if marked is None:
            marked = {s for s, item in entries.items() if self._known_rank(key, s, item.value)[0]}
            self._admitted_subkeys[entries] = marked
        return marked

    def _push(self, key: DHTID, entries: DictionaryDHTValue, rank: tuple[bool, bytes], subkey) -> None:
        heap = self._heaps.get(entries)
        if heap is None or len(heap) > 4 * self.cap + 64:
            heap = self._rebuild(key, entries)
        heapq.heappush(heap, (rank, next(self._tiebreak), subkey))
        if rank[0]:  # a record ranked anew without admission leaves the mark at the next count
            self._marked(key, entries).add(subkey)

    def _rebuild(self, key: DHTID, entries: DictionaryDHTValue) -> list:
        ranked = ((self._known_rank(key, s, item.value), s) for s, item in entries.items())
        heap = [(rank, next(self._tiebreak), s) for rank, s in ranked]
        heapq.heapify(heap)
        self._heaps[entries] = heap
        return heap

    def _lowest(self, key: DHTID, entries: DictionaryDHTValue) -> tuple[object, tuple[bool, bytes] | None]:
        """The lowest ranked record in `entries` and its rank, from the top of their heap."""
        heap = self._heaps.get(entries)
        for _ in range(2):  # the kept heap, then (if it ran out of valid items) one rebuilt from entries
            heap = self._rebuild(key, entries) if heap is None else heap
            while heap:
                rank, _, s = heap[0]
                item = entries.get(s)
                if item is not None and self._known_rank(key, s, item.value) == rank:
                    return s, rank
                heapq.heappop(heap)  # evicted, expired, or ranked anew by a later store
            heap = None
        return None, None

    def keeps_first(self, key: DHTID, subkey, value: bytes) -> bool:
        """Whether the first record of an empty key may be stored (not, in an invite run, a stranger's)."""
        return not self.admitted_only or self.rank(key, subkey, value)[0]

    def trimmed(self, key: DHTID, entries: DictionaryDHTValue) -> DictionaryDHTValue:
        """`entries` cut to the `cap` highest ranked (a whole dictionary stored at once, e.g. cached),
        without strangers' records where only admitted ones are kept."""
        items = list(entries.items())
        if self.admitted_only:
            items = [(s, item) for s, item in items if self._known_rank(key, s, item.value)[0]]
        elif len(items) <= self.unadmitted_cap:
            return entries
        items.sort(key=lambda kv: self._known_rank(key, kv[0], kv[1].value), reverse=True)
        admitted = sum(1 for s, item in items if self._known_rank(key, s, item.value)[0])
        room = self.cap if admitted == 0 else min(self.cap, admitted + self.unadmitted_cap)
        out = DictionaryDHTValue()
        for subkey, item in items[:room]:
            out.store(subkey, item.value, item.expiration_time)
        return out


_CAPS: dict[DHTID, SubkeyCap] = {}


def cap_keys(cap: SubkeyCap) -> None:
    """Applies `cap` to its keys in this process's DHT storage (the last registered wins)."""
    for key in cap.keys:
        _CAPS[key] = cap


def cap_of(key: DHTID) -> SubkeyCap | None:
    return _CAPS.get(key)


def _capped_store_subkey(store_subkey):
    def patched(self, key: DHTID, subkey, value: bytes, expiration_time: float) -> bool:
        cap = _CAPS.get(key)
        if cap is not None:
            current = self.get(key)
            if current is not None and isinstance(current.value, DictionaryDHTValue):
                if not cap.make_room(key, current.value, subkey, value):
                    return False
            elif not cap.keeps_first(key, subkey, value):
                return False
        return store_subkey(self, key, subkey, value, expiration_time)

    patched.pathswarm_capped = True
    return patched


def _capped_store(store):
    def patched(self, key: DHTID, value, expiration_time: float, subkey=None) -> bool:
        cap = _CAPS.get(key)
        if cap is not None and subkey is None and isinstance(value, DictionaryDHTValue):
            value = cap.trimmed(key, value)
            if len(value) == 0:
                return False
        return store(self, key, value, expiration_time, subkey)

    patched.pathswarm_capped = True
    return patched


if not getattr(DHTLocalStorage.store_subkey, "pathswarm_capped", False):
    DHTLocalStorage.store_subkey = _capped_store_subkey(DHTLocalStorage.store_subkey)
    DHTLocalStorage.store = _capped_store(DHTLocalStorage.store)
