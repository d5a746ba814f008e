"""Signing, publishing, fetching and verifying a run manifest in the DHT.

The creator signs the manifest's sha256 (the run id) with its RSA key. Any peer that verified the
record re-publishes it unchanged under its own owner subkey, so the run outlives its creator; a
reader accepts a record only if the hash of the manifest matches the run id and the signature
verifies, and (with `--run NAME@HASH`) only the pinned run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import hivemind
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from pydantic import ValidationError

from dht.keys import MANIFEST_TTL_SECONDS, manifest_key
from dht.node import SwarmError
from dht.records import store_record
from dht.schema import ManifestRecord
from peer.config import RunManifest, one_line

logger = logging.getLogger(__name__)

#: hivemind's DHT process reads requests from a pipe that uvloop made non-blocking; a request larger
#: than the pipe buffer (64 KiB) arrives in pieces and kills the DHT process. Keep records well below.
MAX_MANIFEST_BYTES = 48 * 1024


def sign_manifest(manifest: RunManifest, key: RSAPrivateKey) -> ManifestRecord:
    run_id = manifest.run_id
    size = len(manifest.canonical_json().encode())
    if size > MAX_MANIFEST_BYTES:
        raise ValueError(
            f"manifest is {size} bytes, more than a DHT record may hold ({MAX_MANIFEST_BYTES}); "
            "use a smaller router or fewer fields"
        )
    return ManifestRecord(
        run_id=run_id,
        manifest_json=manifest.canonical_json(),
        creator_public_key=key.get_public_key().to_bytes(),
        signature=key.sign(run_id.encode()),
    )


def verify_record(record: ManifestRecord) -> RunManifest:
    """The manifest inside a record, or ValueError saying why it cannot be trusted."""
    if hashlib.sha256(record.manifest_json.encode()).hexdigest() != record.run_id:
        raise ValueError("manifest hash does not match its run id")
    try:
        public_key = RSAPublicKey.from_bytes(record.creator_public_key)
        valid = public_key.verify(record.run_id.encode(), record.signature)
    except Exception as e:
        raise ValueError(f"unreadable creator key or signature: {e}") from e
    if not valid:
        raise ValueError("creator signature does not verify")
    try:
        manifest = RunManifest.model_validate_json(record.manifest_json)
    except ValidationError as e:
        raise ValueError(f"manifest does not parse: {one_line(e)}") from e
    if manifest.canonical_json() != record.manifest_json:
        # A manifest written by a different version could parse yet hash differently; refuse it.
        raise ValueError("manifest is not in canonical form (written by an incompatible version?)")
    return manifest


def save_record(record: ManifestRecord, path: Path) -> None:
    path.write_text(record.model_dump_json(indent=1))


def load_record(path: Path) -> ManifestRecord:
    try:
        return ManifestRecord.model_validate_json(Path(path).read_text())
    except (OSError, ValidationError, json.JSONDecodeError) as e:
        raise SwarmError(f"cannot read manifest file {path}: {e}") from e


def publish_record(dht: hivemind.DHT, key: RSAPrivateKey, record: ManifestRecord) -> bool:
    name = json.loads(record.manifest_json)["name"]
    return store_record(dht, manifest_key(name), key, record, MANIFEST_TTL_SECONDS)


def fetch_manifest(
    dht: hivemind.DHT, run_name: str, pin: str | None = None, timeout_seconds: float = 15.0
) -> tuple[RunManifest, ManifestRecord]:
    """Finds the one verified manifest for `run_name` (and `pin`), retrying while the DHT warms up."""
    deadline = time.monotonic() + timeout_seconds
    rejected: list[str] = []
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
                if pin is None or record.run_id.startswith(pin):
                    candidates[record.run_id] = (manifest, record)
        if len(candidates) == 1:
            return next(iter(candidates.values()))
        if len(candidates) > 1:
            ids = ", ".join(f"{run_name}@{rid[:12]}" for rid in sorted(candidates))
            raise SwarmError(f"several runs are named {run_name!r}; pin one with --run: {ids}")
        if time.monotonic() > deadline:
            why = f" (refused records: {'; '.join(sorted(set(rejected)))})" if rejected else ""
            pinned = f" with hash {pin}..." if pin else ""
            raise SwarmError(f"no verified manifest for run {run_name!r}{pinned} in the DHT{why}")
        time.sleep(0.5)
