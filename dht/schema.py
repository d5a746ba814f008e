"""Versioned schemas of every record pathswarm stores in the DHT.

Each record carries a `version`; readers accept unknown extra fields so that newer peers can add
fields without breaking older ones, but a record whose known fields are malformed is refused.
"""

from __future__ import annotations

import hashlib
import re

from hivemind.utils.crypto import RSAPublicKey
from pydantic import BaseModel, ConfigDict, Field, field_validator

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: a grid has at most 8 levels, 64 modules per level and 4096 paths (peer/model/grid.py): ids of a few
#: characters, so a padded id ("l000…0m0") cannot make a claim long
_MODULE_ID = re.compile(r"^(trunk|l[0-9]{1,2}m[0-9]{1,2}|p[0-9]{1,4})\Z")
_PATH_INDEX = re.compile(r"^\d{1,7}$")

#: a claim's `path_steps` names at most this many paths (a peer keeps its most trained ones there)
MAX_PATH_STEPS_ENTRIES = 64
#: ... and its `round_steps` at most this many (the paths of its latest round)
MAX_ROUND_STEPS_ENTRIES = 4
#: the longest admission token a record carries (a 2048-bit key's is about 620 characters)
MAX_ADMISSION_TOKEN_CHARS = 2048
#: modules one keeper's stash record names: a keeper that would keep more refuses them (peer/swarm/keeper.py)
MAX_STASH_MODULES = 512


class Record(BaseModel):
    """Base of every record: versioned, frozen, tolerant of fields added by newer peers."""

    model_config = ConfigDict(extra="allow", frozen=True)

    version: int = Field(1, ge=1)


class ManifestRecord(Record):
    """A run manifest as the creator signed it. `run_id` is sha256 of the canonical manifest JSON and
    `signature` is the creator's RSA signature of `run_id`; anyone may re-publish the record, nobody
    can alter it unnoticed."""

    run_id: str
    manifest_json: str = Field(max_length=48 * 1024)
    creator_public_key: bytes = Field(max_length=4096)
    signature: bytes = Field(max_length=4096)

    @field_validator("run_id")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _HEX64.match(v):
            raise ValueError("run_id must be 64 lowercase hex characters")
        return v

    def unsigned_because(self) -> str | None:
        """Why this record is not its creator's (a hash or signature that does not check), or None.
        Checked by every DHT node of a run before it stores a copy, and by every reader again."""
        if hashlib.sha256(self.manifest_json.encode()).hexdigest() != self.run_id:
            return "manifest hash does not match its run id"
        try:
            creator = RSAPublicKey.from_bytes(self.creator_public_key)
            valid = creator.verify(self.run_id.encode(), self.signature)
        except Exception as e:
            return f"unreadable creator key or signature: {e}"
        return None if valid else "creator signature does not verify"


class ClaimRecord(Record):
    """A peer's claim on a path, with the progress others use for planning and catching up. The
    validator ties `peer_id` to the key that signed the record. Version 3: stored under the claim
    shard of its path (`dht.keys.claim_shard`), at most `MAX_CLAIM_BYTES` long."""

    version: int = Field(3, ge=3)

    peer_id: str = Field(min_length=1, max_length=128)
    path: int = Field(ge=0, lt=1 << 20)
    modules: list[str] = Field(max_length=64)
    step: int = Field(0, ge=0)
    outer_round: int = Field(0, ge=0)
    tokens_total: int = Field(0, ge=0)
    tokens_per_second: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    client_mode: bool = False
    #: false while the peer is still starting or catching up: it claims its path, but holders do not
    #: wait for it in their averaging groups yet
    ready: bool = True
    #: set in the last record a departing peer publishes, so holders stop waiting for it at once
    leaving: bool = False
    #: per module: sha256 of the peer's global copy and outer momentum (equal on holders in step)
    digests: dict[str, str] = Field(default_factory=dict, max_length=64)
    #: per module: each fragment's count of applied syncs
    module_rounds: dict[str, list[int]] = Field(default_factory=dict, max_length=64)
    #: what the peer reports about itself for monitoring (claims, not facts: never used to decide)
    software_version: str = Field("", max_length=64)
    #: "direct", "relay", "unreachable" or "unknown" (how other peers can reach this one)
    reachability: str = Field("unknown", max_length=32)
    #: mean training loss of the peer's last outer round
    loss: float | None = Field(None, allow_inf_nan=False)
    #: module syncs by outcome (averaged, alone, partial, excluded, incomplete, failed) and rejected parts
    #: by reason, since start
    sync_outcomes: dict[str, int] = Field(default_factory=dict, max_length=16)
    bad_parts: dict[str, int] = Field(default_factory=dict, max_length=16)
    bytes_sent: int = Field(0, ge=0)
    bytes_received: int = Field(0, ge=0)
    #: path index (decimal) -> inner steps this peer trained on that path, its most trained paths
    #: (added after version 2: absent in older peers' claims). A claim, not a fact: it only steers
    #: which path a peer rotates to (peer/swarm/rotation.py), never what is averaged or trusted.
    path_steps: dict[str, int] = Field(default_factory=dict, max_length=MAX_PATH_STEPS_ENTRIES)
    #: of those, the steps of round `outer_round` itself, per path (a peer moves only between rounds:
    #: one path, two after a restart): readers work out the counts as of the round before, which every
    #: claim of that round or the next gives alike (peer.swarm.rotation.round_view)
    round_steps: dict[str, int] = Field(default_factory=dict, max_length=MAX_ROUND_STEPS_ENTRIES)
    #: the run creator's signed admission of this peer (peer/run/admission.py), "" while it has none;
    #: readers verify it against the manifest's creator key before it counts for anything
    admission: str = Field("", max_length=MAX_ADMISSION_TOKEN_CHARS)

    @field_validator("modules")
    @classmethod
    def _module_ids(cls, v: list[str]) -> list[str]:
        for m in v:
            if not _MODULE_ID.match(m):
                raise ValueError(f"bad module id {m!r}")
        return v

    @field_validator("path_steps", "round_steps")
    @classmethod
    def _path_steps(cls, v: dict[str, int]) -> dict[str, int]:
        for path, steps in v.items():
            if not _PATH_INDEX.match(path) or not 0 <= steps < 2**40:
                raise ValueError(f"bad path steps {path!r}: {steps!r}")
        return v

    @field_validator("digests", "module_rounds")
    @classmethod
    def _per_module(cls, v: dict) -> dict:
        for m, x in v.items():
            if not _MODULE_ID.match(m):
                raise ValueError(f"bad module id {m!r}")
            if isinstance(x, str) and not _HEX64.match(x):
                raise ValueError("a digest is 64 lowercase hex characters")
            if isinstance(x, list) and (len(x) > 64 or any(r < 0 or r >= 2**40 for r in x)):
                raise ValueError("bad fragment rounds")
        return v


class ProbeRecord(Record):
    """What one peer measured: its compute and memory, and links to a bounded sample of peers."""

    peer_id: str = Field(min_length=1, max_length=128)
    tokens_per_second: float = Field(gt=0, allow_inf_nan=False)
    memory_bytes: int = Field(ge=0)
    #: other peer id -> [one-way latency in seconds, bandwidth in bytes per second]
    links: dict[str, list[float]] = Field(default_factory=dict, max_length=64)
    injected: bool = False
    #: the peer's admission to the run ("" while it has none): DHT nodes keep admitted peers' probes
    #: first when a flood fills the key (dht/shard_store.py); readers never trust it unverified
    admission: str = Field("", max_length=MAX_ADMISSION_TOKEN_CHARS)

    @field_validator("links")
    @classmethod
    def _links(cls, v: dict[str, list[float]]) -> dict[str, list[float]]:
        for peer, pair in v.items():
            if len(peer) > 128 or len(pair) != 2 or not (0 <= pair[0] < 60 and 0 < pair[1] < 1e13):
                raise ValueError(f"bad link measurement {peer!r}: {pair!r}")
        return v


class KeptModule(BaseModel):
    """One module state a keeper holds."""

    model_config = ConfigDict(extra="allow", frozen=True)

    fragment_rounds: list[int] = Field(max_length=64)
    digest: str = Field(min_length=64, max_length=64)


class StashRecord(Record):
    """The module states one keeper holds and serves (the last copy of a module whose holders left)."""

    peer_id: str = Field(min_length=1, max_length=128)
    modules: dict[str, KeptModule] = Field(default_factory=dict, max_length=MAX_STASH_MODULES)
    #: the keeper's admission to the run ("" for the creator's own keeper, which needs none)
    admission: str = Field("", max_length=MAX_ADMISSION_TOKEN_CHARS)

    @field_validator("modules")
    @classmethod
    def _module_ids(cls, v: dict[str, KeptModule]) -> dict[str, KeptModule]:
        for m in v:
            if not _MODULE_ID.match(m):
                raise ValueError(f"bad module id {m!r}")
        return v


class ArtifactsRecord(Record):
    """The artifacts (by sha256) one peer serves. A claim: every chunk it sends is verified."""

    peer_id: str = Field(min_length=1, max_length=128)
    sha256s: list[str] = Field(default_factory=list, max_length=16)
    #: the peer's admission to the run ("" while it has none), as in ProbeRecord
    admission: str = Field("", max_length=MAX_ADMISSION_TOKEN_CHARS)

    @field_validator("sha256s")
    @classmethod
    def _hexes(cls, v: list[str]) -> list[str]:
        if not all(_HEX64.match(h) for h in v):
            raise ValueError("an artifact is named by 64 lowercase hex characters")
        return v


class RouterRecord(Record):
    """A router version after the manifest's, as the run's creator signed it. `payload_json` names
    the run, the version, the round from which peers route with it and the router file by hash
    (peer/run/router_versions.py parses it); `signature` is the creator's RSA signature of its
    sha256. Anyone may re-publish the record; only the creator's key makes one that verifies."""

    run_id: str
    router_version: int = Field(ge=1, lt=1 << 31)
    payload_json: str = Field(max_length=4096)
    signature: bytes = Field(max_length=4096)

    @field_validator("run_id")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _HEX64.match(v):
            raise ValueError("run_id must be 64 lowercase hex characters")
        return v

    @staticmethod
    def payload_digest(payload_json: str) -> bytes:
        """What the creator signs: the payload's sha256, hex."""
        return hashlib.sha256(payload_json.encode()).hexdigest().encode()

    def signed_by(self, creator_public_key: bytes) -> bool:
        """Whether `creator_public_key` signed this payload. Checked by the DHT nodes of the run before
        they store a copy, and by every reader again."""
        digest = self.payload_digest(self.payload_json)
        try:
            return bool(RSAPublicKey.from_bytes(creator_public_key).verify(digest, self.signature))
        except Exception:  # an unreadable key or signature signs nothing
            return False


#: a contribution record names at most this many peers it averaged with (its most frequent partners)
MAX_CONTRIBUTION_PARTNERS = 16


class ContributionRecord(Record):
    """A peer's own totals over the whole run (across resumes), for volunteers to see. Besides the
    DHT's owner signature it carries one of its own (peer/swarm/contribution.py): `signature` is the
    peer's RSA signature of every other field and `public_key` the key it verifies with, whose peer id
    must be `peer_id`, so a reader that keeps the record after it expired can still check it. Every
    number is a claim; `averaged_with` (partner -> rounds averaged together) lets a reader confirm
    another peer's `rounds_averaged` from its partners' own records."""

    run_id: str
    peer_id: str = Field(min_length=1, max_length=128)
    tokens: int = Field(0, ge=0, lt=2**62)
    inner_steps: int = Field(0, ge=0, lt=2**48)
    #: outer rounds in which at least one of the peer's modules averaged with another holder
    rounds_averaged: int = Field(0, ge=0, lt=2**40)
    #: distinct modules the peer trained over the run (every module of every path it held)
    modules_held: int = Field(0, ge=0, lt=1 << 20)
    online_seconds: int = Field(0, ge=0, lt=2**40)
    averaged_with: dict[str, int] = Field(default_factory=dict, max_length=MAX_CONTRIBUTION_PARTNERS)
    #: unix seconds when the peer signed it (a reader keeps the latest of each peer)
    signed_at: int = Field(0, ge=0, lt=2**40)
    public_key: str = Field("", max_length=1024)
    signature: str = Field("", max_length=1024)
    #: the peer's admission to the run ("" while it has none), as in ProbeRecord (signed with the rest)
    admission: str = Field("", max_length=MAX_ADMISSION_TOKEN_CHARS)

    @field_validator("run_id")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _HEX64.match(v):
            raise ValueError("run_id must be 64 lowercase hex characters")
        return v

    @field_validator("averaged_with")
    @classmethod
    def _partners(cls, v: dict[str, int]) -> dict[str, int]:
        for peer, rounds in v.items():
            if not 0 < len(peer) <= 128 or not 0 <= rounds < 2**40:
                raise ValueError(f"bad partner count {peer[:130]!r}: {rounds!r}")
        return v


SCHEMAS: dict[str, type[Record]] = {
    "manifest": ManifestRecord,
    "claim": ClaimRecord,
    "probe": ProbeRecord,
    "stash": StashRecord,
    "artifacts": ArtifactsRecord,
    "router": RouterRecord,
    "contribution": ContributionRecord,
}
