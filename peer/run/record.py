"""A run's manifest as a signed record: signing, verifying, and the manifest file.

The creator signs the manifest's sha256 (the run id) with its RSA key. A reader accepts a record only
if the hash of the manifest matches the run id, the signature verifies and the manifest parses in
canonical form; `load_verified_manifest` does all of that for a file (and an expected run name and
pin), for the peer, the bootstrap node and the offline commands alike.
"""

from __future__ import annotations

import json
from pathlib import Path

from hivemind.utils.crypto import RSAPrivateKey
from pydantic import ValidationError

from dht.schema import ManifestRecord
from peer.config import RunManifest, one_line
from peer.errors import ConfigError

#: every DHT node near the key stores and serves the manifest, and every joiner fetches it: a small
#: record. (It was also once the limit below which hivemind's DHT process survived a request; that
#: bug is fixed in dht/node.py.) Anything bigger travels as an artifact (router_file, shards).
MAX_MANIFEST_BYTES = 48 * 1024


def sign_manifest(manifest: RunManifest, key: RSAPrivateKey) -> ManifestRecord:
    run_id = manifest.run_id
    size = len(manifest.canonical_json().encode())
    if size > MAX_MANIFEST_BYTES:
        raise ConfigError(
            f"manifest is {size} bytes, more than a DHT record may hold ({MAX_MANIFEST_BYTES}); "
            "use a smaller router, or with --share_data fewer and larger data files"
        )
    return ManifestRecord(
        run_id=run_id,
        manifest_json=manifest.canonical_json(),
        creator_public_key=key.get_public_key().to_bytes(),
        signature=key.sign(run_id.encode()),
    )


def verify_record(record: ManifestRecord) -> RunManifest:
    """The manifest inside a record, or ValueError saying why it cannot be trusted."""
    unsigned = record.unsigned_because()
    if unsigned is not None:
        raise ValueError(unsigned)
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
    """The signed record in a manifest file; a file that is not one is refused in one line naming the
    file and what is wrong with it (not JSON, truncated, which field)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read manifest file {path}: {getattr(e, 'strerror', None) or e}") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # the text ended where the parser wanted more (a string runs to the end, or a value is due)
        cut = e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string")
        what = "is truncated (it ends mid-JSON)" if cut and text.strip() else "is not JSON"
        raise ConfigError(
            f"manifest file {path} {what}: {e.msg.removesuffix(' at')} at line {e.lineno} column {e.colno}; "
            "use the file `pathswarm run create --out` wrote"
        ) from e
    if not isinstance(data, dict):
        raise ConfigError(f"manifest file {path} holds a JSON {type(data).__name__}, not a signed manifest")
    try:
        return ManifestRecord.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"manifest file {path} is not a signed manifest: {one_line(e)}") from e


def load_verified_manifest(
    path: Path, run_name: str | None = None, pin: str | None = None
) -> tuple[RunManifest, ManifestRecord]:
    """The manifest in a signed manifest file, after checking its hash and signature, and that it is
    the run `run_name` (with a run id starting with `pin`) when those are given."""
    record = load_record(path)
    try:
        manifest = verify_record(record)
    except ValueError as e:
        raise ConfigError(f"manifest file {path} does not verify: {e}") from e
    if run_name is not None and manifest.name != run_name:
        raise ConfigError(f"manifest file {path} is for run {manifest.name!r}, not {run_name!r}")
    if pin and not record.run_id.startswith(pin):
        raise ConfigError(
            f"manifest file {path} holds run {manifest.name} with hash {record.run_id[:16]}…, but --run "
            f"pins hash {pin}: a different hash is a different run (check the hash you were given)"
        )
    return manifest, record
