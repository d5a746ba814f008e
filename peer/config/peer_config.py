"""What each peer chooses: `PeerConfig`, one volunteer's settings, layered from a config file,
`PATHSWARM_*` environment variables and command-line flags (in increasing priority), validated once
and logged at start. Its fields are the `pathswarm peer` flags, their descriptions the help.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dht.keys import CLAIM_TTL_SECONDS, check_run_name
from dht.serve_limits import DEFAULT_SERVE_LIMITS as _SERVE
from dht.serve_limits import ServeLimitSettings
from peer.errors import ConfigError

#: a pin of 16 hex digits (64 bits) cannot be matched by a forged manifest with feasible work
MIN_PIN_HEX = 16


class PeerConfig(BaseModel):
    """One peer's settings. Field names are the CLI flags (hivemind/petals spelling)."""

    model_config = ConfigDict(extra="forbid")

    initial_peers: list[str] = Field(
        default_factory=list,
        description="multiaddrs of peers already in the swarm, each with its /p2p/<peer id> (as a bootstrap "
        "node prints them)",
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"], description="multiaddrs to listen on"
    )
    announce_maddrs: list[str] = Field(
        default_factory=list, description="multiaddrs to advertise to other peers"
    )
    identity_path: Path | None = Field(
        None,
        description="file with this peer's private key (created if missing); unset: a new key each start",
    )
    client_mode: bool = Field(False, description="do not accept incoming connections")
    use_relay: bool = Field(
        True,
        description="use libp2p circuit relays, as hivemind and petals do: reach and serve peers through "
        "relays",
        json_schema_extra={
            "negative": "no_relay",
            "negative_help": "hivemind's use_relay=False (its p2pd still relays for others: measured)",
        },
    )
    use_auto_relay: bool = Field(
        False,
        description="behind a NAT with no open port: reserve a slot on a relay (the initial peers) so "
        "that other peers can reach this one through it",
    )
    new_swarm: bool = Field(False, description="start a new swarm (no --initial_peers)")
    p2p_daemon_batch_scheduling: bool = Field(
        True,
        description="run the p2p daemon's threads under SCHED_BATCH (Linux; dht/daemon_scheduling.py): "
        "its wake-ups for arriving packets wait for the training thread's time slice instead of "
        "preempting it",
    )
    run: str = Field(description="run NAME or NAME@HASH (pins the manifest's sha256 or a prefix of it)")
    manifest_path: Path | None = Field(None, description="a signed manifest file to verify and publish")
    invite: str | None = Field(
        None,
        max_length=128,
        description="an invite code from the run's creator (pathswarm run invite): redeemed once with the "
        "run's authority for this peer's admission, kept in --checkpoint_dir",
    )
    admission: str | None = Field(
        None,
        max_length=4096,
        description="this peer's admission to the run, signed by its creator (pathswarm run admit): the "
        "token itself or a file holding it; unset: the one kept in --checkpoint_dir, if any",
    )
    creator: str | None = Field(
        None,
        min_length=MIN_PIN_HEX,
        max_length=64,
        pattern=r"^[0-9a-f]+$",
        description="refuse a manifest not signed by this creator key (hex prefix of its sha256, as "
        "shown at join)",
    )
    data_root: Path | None = Field(
        None,
        description="the folder a run's local data files are read from; required for a run from the "
        "swarm that names local files, whose patterns then may not leave it",
    )
    artifacts_dir: Path | None = Field(
        None,
        description="where fetched artifacts (the run's base model) are kept and served from; unset: "
        "CHECKPOINT_DIR/artifacts, else ~/.cache/pathswarm/artifacts",
    )
    path: str | None = Field(
        None,
        description="claim this path: an index or one module index per level; unset: the scheduler picks",
    )
    device: str = Field("auto", description="auto, cpu or cuda[:N]")
    batch_size: int = Field(8, ge=1, description="sequences per inner step")
    prefetch_batches: int = Field(
        0,
        ge=0,
        le=64,
        description="batches made ahead of the training loop on a thread of their own while the inner "
        "step runs; 0: each made in the loop when it is needed (on a CPU peer the thread cost more "
        "than it saved: docs/benchmarks/goodput.md, session 42)",
    )
    max_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="memory the path may use, checked before anything is allocated; unset: what the "
        "device has free",
    )
    inner_optimizer: Literal["adamw", "adamw8bit"] = Field(
        "adamw", description="the inner optimizer: AdamW, or bitsandbytes' 8-bit AdamW (CUDA only)"
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve Prometheus /metrics on this port; unset: no metrics"
    )
    # loopback by default: a volunteer exposes metrics deliberately
    metrics_host: str = Field(
        "127.0.0.1",
        description="the address /metrics listens on: 127.0.0.1 serves this machine only (a container "
        "on --network host too, as docker/ runs it); 0.0.0.0 serves every network it is on, e.g. for a "
        "container on Docker's bridge network published with -p 9100:9100, or a Prometheus elsewhere",
    )
    checkpoint_dir: Path | None = Field(
        None,
        description="write checkpoints here; a folder that already holds checkpoints needs --resume (they "
        "are never pruned for a fresh start); unset: no checkpoints",
    )
    checkpoint_every_rounds: int = Field(1, ge=1, description="checkpoint every N outer rounds")
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept on disk")
    resume: bool = Field(
        False,
        description="continue from the latest checkpoint in --checkpoint_dir (needed to start again on a "
        "folder that holds checkpoints)",
    )
    max_rounds: int | None = Field(
        None,
        ge=1,
        description="stop after this peer has done this many outer rounds of its own (fragment-0 syncs "
        "it took part in or ran alone), counted across --resume; a late joiner does them all (the "
        "swarm's round number, in the log's `round N`, may be higher); unset: no limit",
    )
    max_steps: int | None = Field(None, ge=1, description="stop after this many inner steps; unset: no limit")
    max_inner_steps_per_second: float | None = Field(
        None,
        gt=0,
        description="cap on this peer's training rate (a volunteer sharing the machine; a slower peer in a "
        "lab); the published tokens/s is the capped one; unset: as fast as the device goes",
    )
    heartbeat_seconds: float = Field(
        5.0, gt=0, description="how often this peer renews its path claim in the DHT"
    )
    rotate_every_rounds: int = Field(
        4,
        ge=0,
        description="with fewer live peers than paths, every N outer rounds one peer of a most-trained "
        "path moves to the least-trained path nobody holds, so every path gets trained "
        "(peer/swarm/rotation.py); 0: never; a --path peer stays",
    )
    wait_for_peers: int = Field(
        0,
        ge=0,
        description="start training only once this many peers (this one included) are ready, e.g. for "
        "a run whose peers start together; 0: start at once",
    )
    wait_for_peers_timeout_seconds: float = Field(
        300.0, gt=0, description="after waiting this long for --wait_for_peers, start anyway"
    )
    probe_file: Path | None = Field(
        None, description="JSON of injected probe values (tests, benchmarks: peer/swarm/probes.py)"
    )
    torch_threads: int | None = Field(None, ge=1, description="torch's CPU threads; unset: torch's default")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log verbosity")
    # what other peers can make this one upload (module states, merge copies, artifact chunks): keys
    # are free, so the totals bound a flood and peers without standing get only a share of them
    serve_megabytes_per_second: float = Field(
        _SERVE.bytes_per_second / 1e6, gt=0,
        description="uploads to other peers, MB/s over all of them (a request beyond it waits)",
    )  # fmt: skip
    serve_uploads_at_once: int = Field(
        _SERVE.uploads_at_once, ge=1, description="uploads to other peers at once, over all of them"
    )
    serve_megabytes_per_second_per_peer: float = Field(
        _SERVE.per_asker_bytes_per_second / 1e6, gt=0, description="uploads to one peer, MB/s"
    )
    serve_uploads_at_once_per_peer: int = Field(
        _SERVE.per_asker_uploads_at_once, ge=1, description="uploads to one peer at once"
    )
    serve_stranger_share: float = Field(
        _SERVE.stranger_share, gt=0, le=1,
        description="the share of both totals that peers not admitted to the run may take",
    )  # fmt: skip

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

    def serve_limits(self) -> ServeLimitSettings:
        return ServeLimitSettings(
            self.serve_megabytes_per_second * 1e6,
            self.serve_uploads_at_once,
            self.serve_megabytes_per_second_per_peer * 1e6,
            self.serve_uploads_at_once_per_peer,
            self.serve_stranger_share,
        )

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
