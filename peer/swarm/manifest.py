"""A run's manifest in the DHT: published by every peer that verified it, fetched by joiners.

Any peer that verified the record re-publishes it unchanged under its own owner subkey, so the run
outlives its creator; a reader accepts only records that verify (`peer.run.record`), and with
`--run NAME@HASH` only the pinned run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time

import hivemind
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import ValidationError

from dht.keys import MANIFEST_TTL_SECONDS, manifest_key
from dht.records import store_record
from dht.schema import ManifestRecord
from peer.config import RunManifest
from peer.errors import SwarmError
from peer.run.record import verify_record

logger = logging.getLogger(__name__)


def publish_record(dht: hivemind.DHT, key: RSAPrivateKey, record: ManifestRecord) -> bool:
    name = json.loads(record.manifest_json)["name"]
    return store_record(dht, manifest_key(name), key, record, MANIFEST_TTL_SECONDS)


def creator_of(record: ManifestRecord) -> str:
    """The creator key's fingerprint: sha256 of its public key (shown at join, pinned by --creator)."""
    return hashlib.sha256(record.creator_public_key).hexdigest()


def fetch_manifest(
    dht: hivemind.DHT,
    run_name: str,
    pin: str | None = None,
    timeout_seconds: float = 15.0,
    creator: str | None = None,
) -> tuple[RunManifest, ManifestRecord]:
    """Finds the one verified manifest for `run_name` (and `pin`, and `creator`), retrying while the
    DHT warms up. Anyone can publish a manifest under a name: several candidates are listed with their
    creators, never chosen between silently."""
    deadline = time.monotonic() + timeout_seconds
    rejected: list[str] = []
    unpinned: dict[str, str] = {}  # verified runs of this name that the pin or --creator excludes
    while True:
        candidates: dict[str, tuple[RunManifest, ManifestRecord]] = {}
        found = dht.get(manifest_key(run_name), latest=True)
        if found is not None and isinstance(found.value, dict):
            for item in found.value.values():
                try:
                    record = ManifestRecord.model_validate(item.value)
                    manifest = verify_record(record)
                except (ValidationError, ValueError) as e:
                    rejected.append(str(e).splitlines()[0])
                    continue
                if manifest.name != run_name:
                    rejected.append("manifest names another run")
                    continue
                pinned = pin is None or record.run_id.startswith(pin)
                if pinned and (creator is None or creator_of(record).startswith(creator)):
                    candidates[record.run_id] = (manifest, record)
                else:
                    unpinned[record.run_id] = creator_of(record)
        if len(candidates) == 1:
            return next(iter(candidates.values()))
        if len(candidates) > 1:
            ids = ", ".join(
                f"{run_name}@{rid[:16]} (creator {creator_of(candidates[rid][1])[:16]})"
                for rid in sorted(candidates)
            )
            raise SwarmError(f"several runs are named {run_name!r}; pin one with --run or --creator: {ids}")
        if time.monotonic() > deadline:
            raise SwarmError(_not_found(run_name, pin, creator, unpinned, rejected, timeout_seconds))
        time.sleep(0.5)


def _not_found(
    run_name: str,
    pin: str | None,
    creator: str | None,
    unpinned: dict[str, str],
    rejected: list[str],
    waited_seconds: float,
) -> str:
    why = f" (refused records: {'; '.join(sorted(set(rejected)))})" if rejected else ""
    if unpinned:
        found = ", ".join(f"hash {rid[:16]}… (creator {c[:16]}…)" for rid, c in sorted(unpinned.items()))
        wanted = [f"hash {pin} (--run {run_name}@{pin})"] if pin else []
        wanted += [f"creator {creator} (--creator)"] if creator else []
        return (
            f"the swarm has no run {run_name!r} with {' and '.join(wanted)}: it has {run_name!r} only with "
            f"{found}; check the hash or creator you were given (a different hash is a different run)"
        )
    pinned = f" with hash {pin}..." if pin else ""
    return (
        f"no verified manifest for run {run_name!r}{pinned} in the DHT after {waited_seconds:g} s{why}: "
        "check the --run name, and that the --initial_peers belong to that run's swarm"
    )
