"""The typed configuration tree: what a run fixes for everyone, and what each peer chooses.

`RunManifest` is signed into the DHT when a run is created; every peer trains with exactly it.
`PeerConfig` is one volunteer's settings, layered from a config file, `PATHSWARM_*` environment
variables and command-line flags (in increasing priority), validated once and logged at start.
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dht.keys import CLAIM_TTL_SECONDS, check_run_name
from peer.artifacts.ref import ArtifactRef
from peer.codecs.specs import CODEC_NAMES, CODEC_SPECS
from peer.data.sources import DatasetSpec
from peer.errors import ConfigError
from peer.model.grid import ModelConfig

#: 3: α applies at τ = 0 too (v2 ignored it there), so a v2 manifest would train differently; 4:
#: base_checkpoint; 5: dataset.shards, tokenizer_file, router_file; 6: admission
MANIFEST_FORMAT_VERSION = 6
#: a router file larger than this is refused before it is fetched or read
MAX_ROUTER_FILE_BYTES = 64 << 20
#: a pin of 16 hex digits (64 bits) cannot be matched by a forged manifest with feasible work
MIN_PIN_HEX = 16


class _Frozen(BaseModel):
    """Immutable, and refusing unknown fields: parts of a signed manifest."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class InnerOptimizerConfig(_Frozen):
    """AdamW on the local path (DiPaCo defaults), cosine schedule with linear warmup."""

    lr: float = Field(4e-4, gt=0)
    warmup_steps: int = Field(50, ge=0)
    total_steps: int = Field(10_000, ge=1)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip_norm: float = Field(1.0, gt=0)


class OuterOptimizerConfig(_Frozen):
    """SGD with Nesterov momentum on each module's global copy (DiLoCo)."""

    lr: float = Field(0.7, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    #: DiPaCo rescales a shared module's outer gradient by sqrt(paths through it); off by default
    #: because our probe measured it worse than dense (DESIGN.md).
    sqrt_paths_scaling: bool = False


class SyncConfig(_Frozen):
    """How holders of a module average their outer gradients (Streaming DiLoCo when fragments > 1)."""

    codec: str = "fp32"
    fragments: int = Field(1, ge=1, le=64, description="P: fragments per module, synced H/P steps apart")
    overlap_steps: int = Field(0, ge=0, description="τ: inner steps a fragment sync may overlap")
    #: α, the local copy's weight when a fragment's outer step is merged in, for every τ (arXiv
    #: 2501.18512's θ_local ← α·θ_local + (1−α)·θ̃); unset: 0.5 (the paper's) when τ > 0, else 0,
    #: which is plain DiLoCo's replacement
    mixing_alpha: float | None = Field(None, ge=0, le=1, validate_default=True)
    #: sparse codecs: the unsent rest of earlier outer gradients is added to the next one times this
    #: (error feedback with decay, as SparseLoCo; 1 keeps all of it)
    error_feedback_decay: float = Field(0.95, gt=0, le=1)
    #: how long a round waits for every member's outer gradient before averaging without the missing
    averaging_timeout_seconds: float = Field(60.0, gt=0)
    #: how long a member waits for the others' reports of a round (they are small and sent at once)
    report_timeout_seconds: float = Field(5.0, gt=0)
    #: how the group combines its outer gradients (peer/sync/aggregate.py)
    aggregator: Literal["mean", "clipped_mean", "trimmed_mean", "centered_clip"] = "centered_clip"
    #: a member's weight counts at most this many times the group's median weight
    weight_cap: float = Field(2.0, ge=1)
    #: a member's outer gradient is clipped to this many times the group's median norm
    norm_cap: float = Field(2.0, ge=1)
    #: received outer gradients with a larger L2 norm per fragment are refused outright (0 = no bound)
    max_delta_norm: float = Field(1e4, ge=0)
    #: a module with more holders than this averages in rotating subgroups of well-connected peers
    #: (peer/scheduler/groups.py); 0 = one group of all holders
    max_group_size: int = Field(0, ge=0)
    #: most senders one round accepts (a bound on memory, whatever a flood of claims says)
    max_round_senders: int = Field(32, ge=2, le=256)

    @field_validator("mixing_alpha")
    @classmethod
    def _default_alpha(cls, v: float | None, info) -> float:
        if v is not None:
            return v
        return 0.5 if info.data.get("overlap_steps", 0) > 0 else 0.0

    @field_validator("codec")
    @classmethod
    def _codec(cls, v: str) -> str:
        if v not in CODEC_SPECS:
            raise ValueError(f"unknown codec {v!r}; choose one of {', '.join(CODEC_NAMES)}")
        return v


class AdmissionConfig(_Frozen):
    """How a key earns standing in the run: whose reports, votes and confirmations count
    (peer/run/admission.py; docs/threat-model.md says what each mode costs whom)."""

    mode: Literal["open", "invite"] = Field(
        "open",
        description="invite: only keys the creator admitted take part; open: anyone trains, and a key's "
        "votes count once the creator's authority admitted it after its probation",
    )
    probation_rounds: int = Field(
        3, ge=1, le=1000, description="open: rounds in which admitted holders took a key's outer gradient "
        "before the authority admits it",
    )  # fmt: skip
    admissions_per_hour: int = Field(
        60, ge=1, description="open: keys the authority admits per hour at most (a flood of keys waits)"
    )
    key_cost_bits: int = Field(
        0, ge=0, le=32, description="open: leading zero bits of sha256(run, peer id, nonce) a key must "
        "find before the authority admits it (a cost per key: 2**bits hashes; 0 = none)",
    )  # fmt: skip


class SchedulerConfig(_Frozen):
    """Heterogeneity-aware placement (Yuan et al. 2022): who trains which path."""

    #: "planned": the cost-model plan over measured probes picks a joining peer's path;
    #: "least_covered": the least-covered path, ties broken by a hash of the peer id
    mode: Literal["planned", "least_covered"] = "planned"
    #: a fresh plan replaces the current claims only if it is at least this much (relative) faster
    replan_min_gain: float = Field(0.1, ge=0)
    #: peers each peer measures links to per probe cycle
    max_links: int = Field(8, ge=0, le=64)
    probe_every_seconds: float = Field(300.0, gt=0)


class RunManifest(_Frozen):
    """Everything that must be identical on every peer of a run. Its sha256 is the run id."""

    format_version: int = MANIFEST_FORMAT_VERSION
    name: str
    seed: int = 0
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(64, ge=8)
    inner_steps: int = Field(50, ge=1, description="H: inner steps between outer syncs")
    inner: InnerOptimizerConfig = InnerOptimizerConfig()
    outer: OuterOptimizerConfig = OuterOptimizerConfig()
    sync: SyncConfig = SyncConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    admission: AdmissionConfig = AdmissionConfig()
    dataset: DatasetSpec = DatasetSpec()
    tokenizer: str = "bytes"
    tokenizer_fingerprint: str = ""
    #: a tokenizer file (not "bytes"), fetched by hash like the base model: no volunteer needs the
    #: file at the creator's path
    tokenizer_file: ArtifactRef | None = None
    router: dict[str, Any] = Field(default_factory=dict)
    #: the router as a file fetched by hash, instead of `router` inline: a router of any size (a
    #: discriminative one over many paths) keeps the manifest a small DHT record
    router_file: ArtifactRef | None = None
    #: the dense base model every module starts from and the router's features come from
    #: (peer/model/base.py), fetched by hash from the peers that serve it (peer/artifacts/)
    base_checkpoint: ArtifactRef | None = None
    created_at: float = 0.0

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_run_name(v)

    @field_validator("format_version")
    @classmethod
    def _format(cls, v: int) -> int:
        if v != MANIFEST_FORMAT_VERSION:
            raise ValueError(
                f"manifest format {v} is not this pathswarm's ({MANIFEST_FORMAT_VERSION}): "
                "use the pathswarm version the run was created with, or create the run again"
            )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RunManifest:
        if self.seq_len + 1 > self.model.max_seq_len:
            raise ValueError(
                f"seq_len + 1 = {self.seq_len + 1} exceeds model.max_seq_len = {self.model.max_seq_len}"
            )
        h, p, tau = self.inner_steps, self.sync.fragments, self.sync.overlap_steps
        if p > h:
            raise ValueError(f"sync.fragments = {p} exceeds inner_steps H = {h}")
        if tau >= max(1, h // p):
            # fragment p's sync would still be in flight when fragment p+1's starts
            raise ValueError(f"sync.overlap_steps τ = {tau} must be below H/P = {h}/{p} = {h // p}")
        if self.router_file is not None and self.router:
            raise ValueError("a manifest carries its router inline or as router_file, not both")
        if self.router_file is not None and self.router_file.size_bytes > MAX_ROUTER_FILE_BYTES:
            raise ValueError(
                f"router_file of {self.router_file.size_bytes} bytes exceeds {MAX_ROUTER_FILE_BYTES}"
            )
        return self

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @property
    def run_id(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()


class PeerConfig(BaseModel):
    """One peer's settings. Field names are the CLI flags (hivemind/petals spelling)."""

    model_config = ConfigDict(extra="forbid")

    initial_peers: list[str] = Field(default_factory=list)
    host_maddrs: list[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = Field(default_factory=list)
    identity_path: Path | None = None
    client_mode: bool = False
    #: libp2p circuit relays, as hivemind and petals spell them: reach and serve peers through relays
    use_relay: bool = True
    #: behind a NAT with no open port: reserve a slot on a relay so that other peers can reach this one
    use_auto_relay: bool = False
    new_swarm: bool = False
    run: str = Field(..., description="NAME or NAME@HASH (pins the manifest's sha256 or a prefix of it)")
    manifest_path: Path | None = Field(None, description="a signed manifest file to verify and publish")
    #: the creator key a run's manifest must be signed with (hex prefix of its sha256, as shown at join)
    creator: str | None = Field(None, min_length=MIN_PIN_HEX, max_length=64, pattern=r"^[0-9a-f]+$")
    #: the folder a run's local data files are read from; required for a run from the swarm that names
    #: local files, whose patterns then may not leave it
    data_root: Path | None = None
    #: where fetched artifacts (the run's base model) are kept and served from; default: beside
    #: --checkpoint_dir, else ~/.cache/pathswarm/artifacts
    artifacts_dir: Path | None = None
    path: str | None = Field(None, description="claim this path (index or one module index per level)")
    device: str = "auto"
    batch_size: int = Field(8, ge=1)
    #: memory the path may use (default: what the device has free); checked before anything is allocated
    max_memory_bytes: int | None = Field(None, ge=1)
    inner_optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    metrics_port: int | None = Field(None, ge=0, le=65535)
    #: loopback by default: a volunteer exposes metrics deliberately (containers pass 0.0.0.0)
    metrics_host: str = "127.0.0.1"
    checkpoint_dir: Path | None = None
    checkpoint_every_rounds: int = Field(1, ge=1)
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept on disk")
    resume: bool = False
    #: stop after this many outer rounds of this peer's own (fragment-0 syncs it took part in or ran
    #: alone), counted across --resume; not the swarm's round number, which a late joiner starts past 0
    max_rounds: int | None = Field(None, ge=1)
    max_steps: int | None = Field(None, ge=1)
    heartbeat_seconds: float = Field(5.0, gt=0)
    #: with fewer live peers than paths, every N outer rounds one peer of a most-trained path moves
    #: to the least-trained path nobody holds (peer/swarm/rotation.py); 0 = never. A peer given
    #: --path stays on it.
    rotate_every_rounds: int = Field(4, ge=0)
    #: start training only once this many peers (this one included) are ready, e.g. for a run
    #: whose peers start together; 0 = start at once
    wait_for_peers: int = Field(0, ge=0)
    wait_for_peers_timeout_seconds: float = Field(300.0, gt=0)
    #: inject measured values (tests, benchmarks): see peer/swarm/probes.py load_probe_file
    probe_file: Path | None = None
    torch_threads: int | None = Field(None, ge=1)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("run")
    @classmethod
    def _run(cls, v: str) -> str:
        name, _, pin = v.partition("@")
        check_run_name(name)
        if pin and (len(pin) < MIN_PIN_HEX or any(c not in "0123456789abcdef" for c in pin)):
            raise ValueError(
                f"run pin {pin!r} must be at least {MIN_PIN_HEX} lowercase hex digits of the manifest hash"
            )
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v not in ("auto", "cpu") and not v.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], not {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> PeerConfig:
        if not self.initial_peers and not self.new_swarm:
            raise ValueError("give --initial_peers of a running peer, or --new_swarm to start a new swarm")
        if self.new_swarm and self.manifest_path is None:
            raise ValueError(
                "--new_swarm needs --manifest_path: nobody else can give this peer the run manifest"
            )
        if self.heartbeat_seconds * 2 >= CLAIM_TTL_SECONDS:
            # a claim must be renewed well within its TTL, also with clocks up to TTL/2 apart
            raise ValueError(
                f"--heartbeat_seconds must be below {CLAIM_TTL_SECONDS / 2:g} (half the claim TTL)"
            )
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("--resume needs --checkpoint_dir")
        wants_cuda = self.device.startswith("cuda") or self.inner_optimizer == "adamw8bit"
        if wants_cuda and not _cuda_available():
            if self.device.startswith("cuda"):
                raise ValueError(f"--device {self.device}: CUDA is not available on this machine")
            raise ValueError("--inner_optimizer adamw8bit needs a CUDA device (bitsandbytes 8-bit AdamW)")
        if self.inner_optimizer == "adamw8bit" and self.device == "cpu":
            raise ValueError("--inner_optimizer adamw8bit needs a CUDA device, not --device cpu")
        return self

    @property
    def run_name(self) -> str:
        return self.run.partition("@")[0]

    @property
    def run_pin(self) -> str | None:
        return self.run.partition("@")[2] or None


def _cuda_available() -> bool:
    import torch  # only for settings that need a GPU: the config tree stays light to import

    return torch.cuda.is_available()


ENV_PREFIX = "PATHSWARM_"


def _env_values(model: type[BaseModel]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        raw = os.environ.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if "list" in str(field.annotation):
            values[name] = json.loads(raw) if raw.lstrip().startswith("[") else raw.replace(",", " ").split()
        else:
            values[name] = raw
    return values


def _file_values(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {path} is malformed: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table/object of settings")
    return data


def one_line(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def load_peer_config(cli_values: dict[str, Any], config_file: Path | None = None) -> PeerConfig:
    """Merges file < environment < command line, then validates once."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(_file_values(config_file))
    merged.update(_env_values(PeerConfig))
    merged.update({k: v for k, v in cli_values.items() if v is not None})
    try:
        return PeerConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(f"invalid peer configuration: {one_line(e)}") from None
