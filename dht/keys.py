"""Every DHT key pathswarm reads or writes, in one place.

Keys are plain strings that hivemind hashes into DHT ids. Each entry says who writes it, under which
subkey, and how long a record lives. Records under these keys are validated by `dht.validators`
(owner signature, schema, expiry cap). Sync groups need no key: holders derive them from the claims.
"""

from __future__ import annotations

import re

_RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")

#: Claims and peer info are renewed by heartbeat; a departed peer disappears after this long.
CLAIM_TTL_SECONDS = 30.0
#: Probe results (compute, memory, links) are re-measured every few minutes.
PROBE_TTL_SECONDS = 300.0
#: Keepers re-publish what module states they hold; their record lives this long.
STASH_TTL_SECONDS = 300.0
#: Peers re-publish which artifacts (base checkpoint, ...) they serve; their record lives this long.
ARTIFACTS_TTL_SECONDS = 300.0
#: Every peer holding a verified manifest re-publishes it with this TTL, twice per TTL (so a copy is
#: renewed once more before it lapses if one store fails). Every store's traversal carries back the
#: copies near the key (up to MAX_MANIFEST_COPIES from each node it asks) and most stores are refused
#: by full keys anyway: renewing every 60 s, as before, bought nothing but those bytes.
MANIFEST_TTL_SECONDS = 300.0
MANIFEST_REPUBLISH_SECONDS = MANIFEST_TTL_SECONDS / 2
#: A DHT node keeps at most this many copies under a run name's manifest key (dht/shard_store.py
#: chooses which), of which copies of other runs by the same name (anyone can create one) take at most
#: MAX_OTHER_RUN_MANIFESTS on a node of the run. Every peer re-publishes the manifest under its own
#: subkey and a find answers with every copy: uncapped, one find of a 4-peer run's 13 kB manifest
#: carried 60 kB (a store's traversal makes several), and the key outgrew hivemind's 4 MiB message at
#: ~85 peers with a 48 KiB manifest, or at once under 90 free keys re-publishing it, after which no
#: joiner could read the run. A copy is the creator's signed record whoever stores it: a few suffice.
MAX_MANIFEST_COPIES = 8
MAX_OTHER_RUN_MANIFESTS = 2
#: The run's other keys hold one record per peer too, and a find answers with all of them: per kind,
#: (records a DHT node keeps under the key, bytes of one record serialized without its signature).
#: Each bound is a legitimate record's largest by its schema, and records times (bytes plus an owner
#: key and a signature) stays under 2.4 MiB, below hivemind's 4 MiB message, whatever a flood of free
#: keys publishes: uncapped, 17 keys' stash records of 256 kB made the reply exceed 4 MiB and no reader
#: found the run's keeper. A node keeps admitted owners' records first (`admission`, or the creator's
#: own key) and lets owners without admission take at most a quarter of a key that holds admitted ones
#: (dht/shard_store.py).
RECORD_LIMITS: dict[str, tuple[int, int]] = {
    "probe": (128, 16 * 1024),
    "stash": (8, 256 * 1024),
    "artifacts": (256, 4 * 1024),
    "router": (64, 10 * 1024),
    "contribution": (256, 8 * 1024),
}
#: A router version (`pathswarm run reroute`) is re-published by the peers that switched to it.
ROUTER_TTL_SECONDS = 300.0
#: A peer re-publishes its signed contribution totals (peer/swarm/contribution.py) this often, and at
#: its departure; the record outlives the peer by its TTL so a monitor polling slowly still sees the end.
CONTRIBUTION_REPUBLISH_SECONDS = 10.0
CONTRIBUTION_TTL_SECONDS = 300.0
#: A run's claims are spread over this many keys at most, by path (`claim_shard`): a run of fewer
#: paths has one shard per path. 256 shards of MAX_CLAIMS_PER_SHARD hold 131,072 claims.
MAX_CLAIM_SHARDS = 256
#: A DHT node keeps, and a reader keeps of one shard, at most this many claims (dht/shard_store.py
#: chooses which). With MAX_CLAIM_BYTES per claim plus its owner key and signature (under 5.5 KiB
#: together, see dht/validators.py) one shard's reply stays under 2.8 MiB, below hivemind's 4 MiB.
MAX_CLAIMS_PER_SHARD = 512
#: Of those, claims without the creator's admission (newcomers of an open run, and free keys) take at
#: most this many places of a shard that holds admitted claims (dht/shard_store.py): a 10,000-key flood
#: into an open run filled whole shards, ~0.9 MB that every find of the key carried and every reader
#: checked (benchmarks/claims_scale.py's open run fell to 0.3 of its tokens/s).
MAX_UNADMITTED_CLAIMS_PER_SHARD = 64
#: A claim's record, serialized without its signature, is at most this long (a real one, with an
#: admission token and 64 path_steps entries, is about 2.3 KiB).
MAX_CLAIM_BYTES = 4096
#: A claim is renewed every heartbeat: none may claim to live longer than this.
MAX_CLAIM_TTL_SECONDS = 2 * CLAIM_TTL_SECONDS
#: No record may claim to live longer than this (a forged far-future expiry is refused).
MAX_RECORD_TTL_SECONDS = 600.0


def check_run_name(name: str) -> str:
    if not _RUN_NAME_RE.match(name):
        raise ValueError(f"run name {name!r} must be 1-64 characters of letters, digits, '_' or '-'")
    return name


def manifest_key(run_name: str) -> str:
    """The signed run manifest. Written by the creator and re-published by every peer that verified
    it, each under its own owner subkey; TTL MANIFEST_TTL_SECONDS."""
    return f"pathswarm_{check_run_name(run_name)}_manifest"


def run_namespace(run_name: str, run_id: str) -> str:
    """Prefix of a run's live keys; the manifest hash keeps two runs of the same name apart."""
    return f"pathswarm_{check_run_name(run_name)}_{run_id[:16]}"


def claim_shard(path: int) -> int:
    """The shard of a run's claims that holds the claims on `path`."""
    return path % MAX_CLAIM_SHARDS


def claim_shards(n_paths: int) -> range:
    """Every shard a run of `n_paths` paths uses (one per path, up to MAX_CLAIM_SHARDS)."""
    return range(min(n_paths, MAX_CLAIM_SHARDS))


def claims_key(run_name: str, run_id: str, shard: int) -> str:
    """Path claims with progress, shard `claim_shard(path)` of the run's: one record per peer under
    its owner subkey, renewed by heartbeat; TTL CLAIM_TTL_SECONDS. Sharded so that no key holds more
    than MAX_CLAIMS_PER_SHARD claims on any node: one key for a whole run outgrew hivemind's 4 MiB
    message at about 3,000 claims."""
    if not 0 <= shard < MAX_CLAIM_SHARDS:
        raise ValueError(f"claim shard {shard} is outside 0..{MAX_CLAIM_SHARDS - 1}")
    return f"{run_namespace(run_name, run_id)}_claims{shard}"


def probes_key(run_name: str, run_id: str) -> str:
    """Measured tokens/s, free memory and links to a sample of peers: one record per peer under its
    owner subkey, re-published each probe cycle; TTL PROBE_TTL_SECONDS. Read by the scheduler."""
    return f"{run_namespace(run_name, run_id)}_probes"


def stash_key(run_name: str, run_id: str) -> str:
    """Module states a keeper holds (`pathswarm bootstrap --keep_state`): one record per keeper under
    its owner subkey, listing each module's fragment rounds and digest; TTL STASH_TTL_SECONDS,
    re-published as the kept states advance."""
    return f"{run_namespace(run_name, run_id)}_stash"


def artifacts_key(run_name: str, run_id: str) -> str:
    """Which of the run's content-addressed artifacts a peer serves (peer/artifacts/): one record per
    peer under its owner subkey, re-published every minute; TTL ARTIFACTS_TTL_SECONDS."""
    return f"{run_namespace(run_name, run_id)}_artifacts"


def router_key(run_name: str, run_id: str) -> str:
    """Router versions after the manifest's (DiPaCo's discriminative re-routing): signed by the run's
    creator (`pathswarm run reroute`), re-published unchanged by every peer that switched to one,
    each under its own owner subkey; TTL ROUTER_TTL_SECONDS. Readers keep the highest version whose
    creator signature verifies."""
    return f"{run_namespace(run_name, run_id)}_router"


def contributions_key(run_name: str, run_id: str) -> str:
    """A peer's totals over the run (tokens, inner steps, rounds averaged with others, modules held,
    time online), signed by the peer inside the record too: one record per peer under its owner subkey,
    re-published every CONTRIBUTION_REPUBLISH_SECONDS and when it leaves; TTL CONTRIBUTION_TTL_SECONDS.
    Read by the monitor only (peers never decide on it)."""
    return f"{run_namespace(run_name, run_id)}_contributions"


def run_keys(run_name: str, run_id: str | None) -> dict[str, str]:
    """Keys whose records have a schema, by record kind (`claim<shard>` for each claim shard); the
    validator is built from this."""
    keys = {"manifest": manifest_key(run_name)}
    if run_id is not None:
        for shard in range(MAX_CLAIM_SHARDS):
            keys[f"claim{shard}"] = claims_key(run_name, run_id, shard)
        keys["probe"] = probes_key(run_name, run_id)
        keys["stash"] = stash_key(run_name, run_id)
        keys["artifacts"] = artifacts_key(run_name, run_id)
        keys["router"] = router_key(run_name, run_id)
        keys["contribution"] = contributions_key(run_name, run_id)
    return keys
