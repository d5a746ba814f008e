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
#: Every peer holding a verified manifest re-publishes it this often, with this TTL.
MANIFEST_TTL_SECONDS = 300.0
#: A router version (`pathswarm run reroute`) is re-published by the peers that switched to it.
ROUTER_TTL_SECONDS = 300.0
#: A peer re-publishes its signed contribution totals (peer/swarm/contribution.py) this often, and at
#: its departure; the record outlives the peer by its TTL so a monitor polling slowly still sees the end.
CONTRIBUTION_REPUBLISH_SECONDS = 10.0
CONTRIBUTION_TTL_SECONDS = 300.0
#: A reader keeps at most this many claims of one run (a flood of keys cannot grow its memory).
MAX_CLAIMS_PER_RUN = 4096
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


def claims_key(run_name: str, run_id: str) -> str:
    """Path claims with progress: one record per peer under its owner subkey, renewed by heartbeat;
    TTL CLAIM_TTL_SECONDS."""
    return f"{run_namespace(run_name, run_id)}_claims"


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
    """Keys whose records have a schema, by record kind; the validator is built from this."""
    keys = {"manifest": manifest_key(run_name)}
    if run_id is not None:
        keys["claim"] = claims_key(run_name, run_id)
        keys["probe"] = probes_key(run_name, run_id)
        keys["stash"] = stash_key(run_name, run_id)
        keys["artifacts"] = artifacts_key(run_name, run_id)
        keys["router"] = router_key(run_name, run_id)
        keys["contribution"] = contributions_key(run_name, run_id)
    return keys
