"""What a run fixes for everyone: `RunManifest` and its sections, signed into the DHT when a run is
created; every peer trains with exactly it.

A field with a description is a `pathswarm run create` flag (peer/run/options.py): its name is the
field's (or its `flag`, where two sections would share one), its help the description.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dht.keys import check_run_name
from peer.artifacts.ref import ArtifactRef
from peer.codecs.specs import CODEC_NAMES, CODEC_SPECS
from peer.data.sources import DatasetSpec
from peer.model.grid import ModelConfig

#: 3: α applies at τ = 0 too (v2 ignored it there), so a v2 manifest would train differently;
#: 4: base_checkpoint; 5: dataset.shards, tokenizer_file, router_file; 6: inner_steps (H) moves
#: into sync, beside fragments (P) and overlap_steps (τ); and admission; 7: dataset.fingerprints;
#: 8: routing_index
MANIFEST_FORMAT_VERSION = 8
#: a router file larger than this is refused before it is fetched or read
MAX_ROUTER_FILE_BYTES = 64 << 20
#: a routing index larger than this is refused before it is fetched: 16-byte records of the 10
#: million documents a peer's index keeps at most (peer/data/routed.py)
MAX_ROUTING_INDEX_BYTES = 16 * 10_000_000


class _Frozen(BaseModel):
    """Immutable, and refusing unknown fields: parts of a signed manifest."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class InnerOptimizerConfig(_Frozen):
    """AdamW on the local path (DiPaCo defaults), cosine schedule with linear warmup; with `muon`,
    Muon on the weight matrices of the path's linear layers (MuLoCo)."""

    lr: float = Field(4e-4, gt=0)
    warmup_steps: int = Field(50, ge=0)
    total_steps: int = Field(10_000, ge=1)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip_norm: float = Field(1.0, gt=0)
    muon: bool = Field(
        False,
        description="inner optimizer Muon on the linear layers' weight matrices (its update scaled to "
        "AdamW's RMS, so the same lr and weight decay apply; momentum 0.95, Nesterov), AdamW on the rest "
        "(MuLoCo; measured in docs/benchmarks/sparse_outer.md)",
    )


class OuterOptimizerConfig(_Frozen):
    """SGD with Nesterov momentum on each module's global copy (DiLoCo)."""

    lr: float = Field(
        0.7, gt=0, description="outer SGD lr (DiLoCo's 0.7)", json_schema_extra={"flag": "outer_lr"}
    )
    momentum: float = Field(
        0.9,
        ge=0,
        lt=1,
        description="outer Nesterov momentum (0: plain SGD)",
        json_schema_extra={"flag": "outer_momentum"},
    )
    #: run create sets it from the momentum: Nesterov exactly when there is momentum
    nesterov: bool = True
    #: DiPaCo rescales a shared module's outer gradient by sqrt(paths through it); off by default
    #: because our probe measured it worse than dense (DESIGN.md).
    sqrt_paths_scaling: bool = False


class SyncConfig(_Frozen):
    """How holders of a module average their outer gradients (Streaming DiLoCo when fragments > 1):
    every H inner steps, in P fragments synced H/P steps apart, each overlapping τ inner steps."""

    inner_steps: int = Field(50, ge=1, description="H: inner steps per outer round")
    fragments: int = Field(1, ge=1, le=64, description="P: fragments per module, synced H/P steps apart")
    overlap_steps: int = Field(0, ge=0, description="τ: inner steps a fragment sync may overlap (below H/P)")
    codec: str = Field(
        "fp32",
        description="how outer gradients are encoded on the wire",
        json_schema_extra={"choices": CODEC_NAMES},
    )
    mixing_alpha: float | None = Field(
        None,
        ge=0,
        le=1,
        validate_default=True,
        description="α: the local copy's weight when a fragment's outer step is merged in, for every τ "
        "(θ_local ← α·θ_local + (1−α)·θ̃, arXiv 2501.18512); unset: 0.5 (the paper's) when τ > 0, "
        "else 0 (plain DiLoCo's replacement)",
    )
    error_feedback_decay: float = Field(
        0.95,
        gt=0,
        le=1,
        description="sparse codecs: the unsent rest of earlier outer gradients is added to the next one "
        "times this (error feedback with decay, as SparseLoCo; 1 keeps all of it)",
    )
    averaging_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="a round waits this long for every member's outer gradient, then averages without "
        "the missing",
    )
    report_timeout_seconds: float = Field(
        5.0,
        gt=0,
        description="a member waits this long for the others' reports of a round (small, sent at once)",
    )
    aggregator: Literal["mean", "clipped_mean", "trimmed_mean", "median", "centered_clip"] = Field(
        "centered_clip", description="how a group combines its outer gradients (peer/sync/aggregate.py)"
    )
    weight_cap: float = Field(
        2.0, ge=1, description="a member's weight counts at most this many times the group's median"
    )
    norm_cap: float = Field(
        2.0,
        ge=1,
        description="a member's outer gradient is clipped to this many times the group's median norm",
    )
    max_delta_norm: float = Field(
        1e4,
        ge=0,
        description="received outer gradients with a larger L2 norm per fragment are refused (0: no bound)",
    )
    max_group_size: int = Field(
        0,
        ge=0,
        description="a module with more holders averages in rotating subgroups of well-connected peers "
        "(peer/scheduler/groups.py); 0: one group of all holders",
    )
    max_round_senders: int = Field(
        32,
        ge=2,
        le=256,
        description="most senders one round accepts (bounds memory, whatever a flood of claims says)",
    )

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

    @model_validator(mode="after")
    def _consistent(self) -> SyncConfig:
        h, p, tau = self.inner_steps, self.fragments, self.overlap_steps
        if p > h:
            raise ValueError(f"fragments P = {p} exceeds inner_steps H = {h}")
        if tau >= max(1, h // p):
            # fragment p's sync would still be in flight when fragment p+1's starts
            raise ValueError(f"overlap_steps τ = {tau} must be below H/P = {h}/{p} = {h // p}")
        return self


class AdmissionConfig(_Frozen):
    """How a key earns standing in the run: whose reports, votes and confirmations count
    (peer/run/admission.py; docs/threat-model.md says what each mode costs whom)."""

    mode: Literal["open", "invite"] = Field(
        "open",
        description="invite: only keys the creator admitted take part; open: anyone trains, and a key's "
        "votes count once the creator's authority admitted it after its probation",
        json_schema_extra={"flag": "admission"},
    )
    probation_rounds: int = Field(
        3, ge=1, le=1000, description="open: rounds in which admitted holders averaged a key's outer "
        "gradient before the authority admits it",
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
    probe_every_seconds: float = Field(
        300.0, gt=0, description="seconds between a peer's probes of its speed and links"
    )
    replan_online: bool = Field(
        False, description="planned runs: re-plan at round ends after a join, a leave or a new probe, "
        "and move a peer when the plan's gain over --replan_horizon_rounds beats the move's cost",
    )  # fmt: skip
    replan_horizon_rounds: int = Field(
        20, ge=1, le=100_000, description="rounds over which re-planning counts a plan's saving "
        "against the cost of its moves",
    )  # fmt: skip
    move_lost_rounds: float = Field(
        1.0, ge=0, le=1000, description="rounds a moving peer loses besides its download (rebuild, the "
        "wait until holders see its claim), in the cost of a move",
    )  # fmt: skip

    @model_validator(mode="after")
    def _online_needs_a_plan(self) -> SchedulerConfig:
        if self.replan_online and self.mode != "planned":
            raise ValueError(f"replan_online re-runs the plan: it needs mode 'planned', not {self.mode!r}")
        return self


class RunManifest(_Frozen):
    """Everything that must be identical on every peer of a run. Its sha256 is the run id.

    A field with a description, here or in a section, is a `run create` flag of the field's name
    (or its `flag`); the others `run create` computes (the model's shape from --preset and --grid).
    """

    format_version: int = MANIFEST_FORMAT_VERSION
    name: str = Field(description="the run's name: 1-64 letters, digits, '_' or '-'")
    seed: int = Field(
        0, description="seeds the modules' initial weights, the router's fit and the data's split"
    )
    model: ModelConfig = ModelConfig()
    seq_len: int = Field(64, ge=8, description="tokens per training sequence")
    inner: InnerOptimizerConfig = InnerOptimizerConfig()
    outer: OuterOptimizerConfig = OuterOptimizerConfig()
    sync: SyncConfig = SyncConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    admission: AdmissionConfig = AdmissionConfig()
    dataset: DatasetSpec = DatasetSpec()
    tokenizer: str = Field("bytes", description="'bytes' or a tokenizer.json file")
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
    #: where each of the corpus's first documents goes under the router, routed once by the run's
    #: creator (peer/run/routing_index.py); None: every peer routes for itself
    routing_index: ArtifactRef | None = None
    created_at: float = 0.0

    @model_validator(mode="before")
    @classmethod
    def _format(cls, data: Any) -> Any:
        # before the fields: another format's fields would only add noise to the one reason that matters
        v = data.get("format_version", MANIFEST_FORMAT_VERSION) if isinstance(data, dict) else None
        if v is not None and v != MANIFEST_FORMAT_VERSION:
            raise ValueError(
                f"manifest format {v} is not this pathswarm's ({MANIFEST_FORMAT_VERSION}): "
                "use the pathswarm version the run was created with, or create the run again"
            )
        return data

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_run_name(v)

    @model_validator(mode="after")
    def _consistent(self) -> RunManifest:
        if self.seq_len + 1 > self.model.max_seq_len:
            raise ValueError(
                f"seq_len + 1 = {self.seq_len + 1} exceeds model.max_seq_len = {self.model.max_seq_len}"
            )
        if self.router_file is not None and self.router:
            raise ValueError("a manifest carries its router inline or as router_file, not both")
        if self.router_file is not None and self.router_file.size_bytes > MAX_ROUTER_FILE_BYTES:
            raise ValueError(
                f"router_file of {self.router_file.size_bytes} bytes exceeds {MAX_ROUTER_FILE_BYTES}"
            )
        if self.routing_index is not None and self.routing_index.size_bytes > MAX_ROUTING_INDEX_BYTES:
            raise ValueError(
                f"routing_index of {self.routing_index.size_bytes} bytes exceeds {MAX_ROUTING_INDEX_BYTES}"
            )
        return self

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    @property
    def run_id(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()
