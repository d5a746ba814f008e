"""Router versions after the manifest's: DiPaCo's discriminative re-routing in a live run.

The run's creator (`pathswarm run reroute`) signs a payload naming the run, the version, the outer
round from which peers route with it, and the router file by hash (an artifact, fetched like the
base model). The record goes to the DHT under `router_key` and beside the manifest as
`router-v{N}.json`. A reader checks the signature against the creator key of the manifest it
already verified, so nobody but the creator can re-route a run; among records that verify, the
highest version wins. Peers that switched re-publish the record unchanged, so it outlives the tool.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import hivemind
from hivemind.utils.crypto import RSAPrivateKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dht.keys import ROUTER_TTL_SECONDS, router_key
from dht.records import read_records, store_record
from dht.schema import ManifestRecord, RouterRecord
from peer.artifacts.ref import ArtifactRef
from peer.artifacts.store import require_artifact
from peer.config import MAX_ROUTER_FILE_BYTES, one_line
from peer.errors import ConfigError
from peer.model.router import Router

logger = logging.getLogger(__name__)

_FILE_RE = re.compile(r"^router-v(\d+)\.json$")


class RouterVersion(BaseModel):
    """What the creator signs: this run's router number `router_version`, used from `switch_round`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str = Field(min_length=64, max_length=64)
    router_version: int = Field(ge=1, lt=1 << 31)
    #: peers switch at their first round boundary at or after this outer round
    switch_round: int = Field(ge=0, lt=1 << 40)
    router_file: ArtifactRef
    created_at: float = 0.0

    @field_validator("router_file")
    @classmethod
    def _small(cls, ref: ArtifactRef) -> ArtifactRef:
        if ref.size_bytes > MAX_ROUTER_FILE_BYTES:
            raise ValueError(f"a router file of {ref.size_bytes} bytes exceeds {MAX_ROUTER_FILE_BYTES}")
        return ref


def sign_router_version(version: RouterVersion, key: RSAPrivateKey) -> RouterRecord:
    payload = version.model_dump_json()
    return RouterRecord(
        run_id=version.run_id,
        router_version=version.router_version,
        payload_json=payload,
        signature=key.sign(RouterRecord.payload_digest(payload)),
    )


def verify_router_record(record: RouterRecord, manifest_record: ManifestRecord) -> RouterVersion:
    """The router version inside `record`, or ValueError saying why it cannot be trusted: it must
    be of this run, signed by the key that signed the run's manifest, and parse."""
    if record.run_id != manifest_record.run_id:
        raise ValueError("a router version of another run")
    if not record.signed_by(manifest_record.creator_public_key):
        raise ValueError("not signed by the run's creator")
    try:
        version = RouterVersion.model_validate_json(record.payload_json)
    except ValidationError as e:
        raise ValueError(f"router version does not parse: {one_line(e)}") from e
    if version.run_id != record.run_id or version.router_version != record.router_version:
        raise ValueError("the signed payload names another run or version than the record")
    return version


def latest_router_version(
    dht: hivemind.DHT, run_name: str, manifest_record: ManifestRecord
) -> tuple[RouterVersion, RouterRecord, int] | None:
    """The highest router version in the DHT whose creator signature verifies, its record, and how
    many publishers (the creator and the peers that switched) hold that version; None if none."""
    best: tuple[RouterVersion, RouterRecord] | None = None
    holders: dict[int, int] = {}
    for record, _ in read_records(dht, router_key(run_name, manifest_record.run_id), RouterRecord):
        try:
            version = verify_router_record(record, manifest_record)
        except ValueError as e:
            logger.debug(f"refused a router record: {e}")
            continue
        holders[version.router_version] = holders.get(version.router_version, 0) + 1
        if best is None or version.router_version > best[0].router_version:
            best = (version, record)
    if best is None:
        return None
    return best[0], best[1], holders[best[0].router_version]


def publish_router_record(dht: hivemind.DHT, key: RSAPrivateKey, run_name: str, record: RouterRecord) -> bool:
    return store_record(dht, router_key(run_name, record.run_id), key, record, ROUTER_TTL_SECONDS)


def save_router_record(record: RouterRecord, folder: Path) -> Path:
    path = Path(folder) / f"router-v{record.router_version}.json"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(record.model_dump_json(indent=1))
        tmp.replace(path)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e}") from None
    return path


def latest_router_on_disk(
    folder: Path, manifest_record: ManifestRecord
) -> tuple[RouterVersion, RouterRecord] | None:
    """The highest verified `router-v{N}.json` in `folder` (where `run reroute` writes them)."""
    found = []
    for path in Path(folder).glob("router-v*.json"):
        if not _FILE_RE.match(path.name):
            continue
        try:
            record = RouterRecord.model_validate_json(path.read_text())
            if record.run_id != manifest_record.run_id:
                continue  # another run's, written into the same folder
            found.append((verify_router_record(record, manifest_record), record))
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"router version file {path} does not verify: {str(e).splitlines()[0]}"
            ) from None
    return max(found, key=lambda vr: vr[0].router_version) if found else None


def read_router(path: Path, what: str = "router file") -> Router:
    """A router from its JSON file (already checked against its hash)."""
    try:
        return Router.from_json(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"the {what} {path} is unreadable: {type(e).__name__}: {e}") from None


def router_json(router: Router) -> dict:
    return json.loads(router.to_json())


def router_trained_with(metas: list[dict], folders: list[Path]) -> tuple[int, Router | None]:
    """The router version the most re-routed of these checkpoints (their `meta`) trained with, and
    that router from `folders` (checked against its hash); (0, None): the manifest's own router."""
    best = max(metas, key=lambda m: int(m.get("router_version") or 0), default={})
    number = int(best.get("router_version") or 0)
    if not number:
        return 0, None
    try:
        ref = ArtifactRef.model_validate(best["router_file"])
    except (KeyError, ValidationError) as e:
        raise ConfigError(f"a checkpoint names router version {number} without a valid file: {e}") from None
    return number, read_router(require_artifact(ref, folders, f"router version {number}"))
