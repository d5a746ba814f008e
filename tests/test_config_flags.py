"""Each setting is declared once, in the config tree: the `peer` and `run create` flags, their help
and their defaults come from the pydantic models (peer/cli/flags.py); H sits beside P and τ in
`sync`, and a manifest of another format is refused with one line. Fast: no processes."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel, Field, ValidationError

from monitoring.metrics import PeerMetrics
from monitoring.swarm.service import MonitorOptions
from peer.cli.flags import given
from peer.cli.main import build_parser, main, subcommand_names
from peer.cli.swarm_commands import peer_config
from peer.config import (
    MANIFEST_FORMAT_VERSION,
    PeerConfig,
    RunManifest,
    SyncConfig,
    load_peer_config,
    one_line,
)
from peer.errors import ConfigError
from peer.run.options import MANIFEST_FLAGS, RunOptions, manifest_flags, manifest_settings


def subparser(*path: str) -> argparse.ArgumentParser:
    parser, _ = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def flag_help(parser: argparse.ArgumentParser, flag: str) -> str:
    """A flag's help as `--help` prints it, on one line."""
    text = parser.format_help()
    found = re.search(rf"^  {flag}\b(.*?)(?=^  -|^\S|\Z)", text, re.S | re.M)
    assert found, f"{flag} is not in the help"
    return " ".join(found.group(1).split())


@pytest.mark.parametrize(
    "flag,default",
    [
        ("--metrics_host", "127.0.0.1"),
        ("--heartbeat_seconds", "5"),
        ("--batch_size", "8"),
        ("--host_maddrs", "/ip4/0.0.0.0/tcp/0"),
        ("--log_level", "INFO"),
        ("--resume", "off"),
        ("--use_relay", "on"),
    ],
)
def test_peer_help_shows_the_defaults(flag, default):
    assert flag_help(subparser("peer"), flag).endswith(f"(default: {default})")


@pytest.mark.parametrize(
    "flag,default",
    [
        ("--inner_steps", "50"),
        ("--fragments", "1"),
        ("--overlap_steps", "0"),
        ("--codec", "fp32"),
        ("--outer_lr", "0.7"),
        ("--outer_momentum", "0.9"),
        ("--seq_len", "64"),
        ("--grid", "2x2"),
        ("--averaging_timeout_seconds", "60"),
    ],
)
def test_run_create_help_shows_the_defaults(flag, default):
    assert flag_help(subparser("run", "create"), flag).endswith(f"(default: {default})")


def test_every_setting_has_a_described_flag_whose_help_says_its_default():
    peer, create = subparser("peer"), subparser("run", "create")
    for parser, model in ((peer, PeerConfig), (create, RunOptions)):
        flags = {s for a in parser._actions for s in a.option_strings}
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            assert f"--{name}" in flags, f"{model.__name__}.{name} has no flag"
            said = flag_help(parser, f"--{name}")
            assert re.search(r"\((default: .+|required.*)\)$", said) or "unset:" in said, said


def test_absent_flags_stay_absent_so_the_layers_below_them_count():
    parser, _ = build_parser()
    args = parser.parse_args(["peer", "--run", "demo", "--batch_size", "3", "--no_relay"])
    assert given(args, PeerConfig) == {"run": "demo", "batch_size": 3, "use_relay": False}


def test_a_flag_beats_the_environment_which_beats_the_config_file(tmp_path, monkeypatch):
    cfg = tmp_path / "peer.toml"
    cfg.write_text(
        'run = "fromfile"\nbatch_size = 3\nheartbeat_seconds = 2.0\nmetrics_host = "0.0.0.0"\n'
        'initial_peers = ["/ip4/1.2.3.4/tcp/1"]\nuse_relay = true\n'
    )
    monkeypatch.setenv("PATHSWARM_BATCH_SIZE", "5")
    monkeypatch.setenv("PATHSWARM_HEARTBEAT_SECONDS", "3")
    monkeypatch.setenv("PATHSWARM_USE_RELAY", "true")
    parser, _ = build_parser()
    args = parser.parse_args(["peer", "--config", str(cfg), "--batch_size", "7", "--no_relay"])
    config = peer_config(args)
    assert (config.batch_size, config.use_relay) == (7, False)  # flags
    assert config.heartbeat_seconds == 3.0  # the environment
    assert (config.run, config.metrics_host) == ("fromfile", "0.0.0.0")  # the file
    assert config.keep_checkpoints == 2  # the model's default


def test_run_create_flags_fill_the_manifest_sections():
    parser, _ = build_parser()
    argv = ["run", "create", "--name", "r", "--out", "m.json", "--inner_steps", "12", "--fragments", "4"]
    argv += ["--overlap_steps", "2", "--outer_lr", "0.5", "--dataset_name", "x/y", "--max_group_size", "3"]
    options = RunOptions(**given(parser.parse_args(argv), RunOptions))
    settings = manifest_settings(options)
    assert settings["sync"] == {**settings["sync"], "inner_steps": 12, "fragments": 4, "overlap_steps": 2}
    assert settings["sync"]["max_group_size"] == 3 and settings["outer"]["lr"] == 0.5
    assert settings["dataset"]["name"] == "x/y" and settings["dataset"]["kind"] == "builtin"
    assert SyncConfig(**settings["sync"]).inner_steps == 12
    # the defaults are the manifest's own, not a second copy of them
    assert RunOptions(name="r").inner_steps == SyncConfig().inner_steps
    assert (
        RunOptions.model_fields["fragments"].description == SyncConfig.model_fields["fragments"].description
    )


def test_a_described_field_of_a_new_manifest_section_becomes_a_flag():
    class Stake(BaseModel):
        """A section like the ones to come."""

        min_stake: int = Field(0, ge=0, description="a peer needs this much stake to join")
        note: str = ""  # not described: run create computes it

    class Manifest(RunManifest):
        """The manifest with one more section."""

        stake: Stake = Stake()

    flags = manifest_flags(Manifest)
    assert flags["min_stake"][0] == ("stake", "min_stake") and "note" not in flags
    assert set(MANIFEST_FLAGS) < set(flags)

    class Clashing(Manifest):
        """Two sections that would make the same flag."""

        other: Stake = Stake()

    with pytest.raises(TypeError, match="--min_stake would set both stake.min_stake and other.min_stake"):
        manifest_flags(Clashing)


def test_h_sits_beside_p_and_tau_and_the_sync_checks_them():
    assert "inner_steps" not in RunManifest.model_fields
    assert list(SyncConfig.model_fields)[:3] == ["inner_steps", "fragments", "overlap_steps"]
    with pytest.raises(ValidationError, match="fragments P = 4 exceeds inner_steps H = 2"):
        SyncConfig(inner_steps=2, fragments=4)
    with pytest.raises(ValidationError, match="must be below H/P = 12/4 = 3"):
        SyncConfig(inner_steps=12, fragments=4, overlap_steps=3)


def _format_5(manifest: RunManifest) -> dict:
    """`manifest` as format 5 wrote it: H at the top level."""
    old = manifest.model_dump(mode="json")
    old["inner_steps"] = old["sync"].pop("inner_steps")
    return {**old, "format_version": 5}


def test_a_format_5_manifest_is_refused_with_one_line(tmp_path):
    from hivemind.utils.crypto import RSAPrivateKey

    from peer.run.record import ManifestRecord, load_verified_manifest

    old = _format_5(RunManifest(name="old-run", sync=SyncConfig(inner_steps=20)))
    with pytest.raises(ValidationError) as err:
        RunManifest.model_validate(old)
    reason = one_line(err.value)
    assert reason == (
        f"manifest format 5 is not this pathswarm's ({MANIFEST_FORMAT_VERSION}): use the pathswarm "
        "version the run was created with, or create the run again"
    )
    # as a signed file, the way a peer or a bootstrap node reads it
    manifest_json = json.dumps(old, sort_keys=True, separators=(",", ":"))
    key = RSAPrivateKey()
    run_id = hashlib.sha256(manifest_json.encode()).hexdigest()
    record = ManifestRecord(
        run_id=run_id,
        manifest_json=manifest_json,
        creator_public_key=key.get_public_key().to_bytes(),
        signature=key.sign(run_id.encode()),
    )
    path = tmp_path / "manifest.json"
    path.write_text(record.model_dump_json())
    with pytest.raises(ConfigError) as err:
        load_verified_manifest(path)
    assert "\n" not in str(err.value) and reason in str(err.value), err.value


def help_output(capsys, *command: str) -> str:
    """What `pathswarm COMMAND --help` prints, as a user sees it."""
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def help_entries(text: str) -> dict[str, str]:
    """Every option of a --help output with its help text on one line."""
    entries, current = {}, None
    for line in text.splitlines():
        if re.match(r"^  -", line):
            flags, _, rest = line.strip().partition("  ")
            current = flags.split(",")[-1].split()[0]
            entries[current] = rest.strip()
        elif current and re.match(r"^ {3,}\S", line):
            entries[current] = f"{entries[current]} {line.strip()}".strip()
        else:
            current = None
    return entries


def test_the_top_level_help_names_every_subcommand(capsys):
    parser, _ = build_parser()
    text = help_output(capsys)
    usage, description = text.split("positional arguments")[0].split("\n\n", 1)
    assert usage.startswith("usage:")
    description = " ".join(description.split())
    assert description.endswith("."), description  # whole, not cut off
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in action.choices:
        assert re.search(rf"\b{name}\b", description), f"{name} is missing from: {description}"
    for name in subcommand_names(parser):
        assert name in description, f"{name} is missing from: {description}"
    assert {"run create", "run reroute", "run invite", "run admit"} <= set(subcommand_names(parser))


def test_every_subcommands_help_shows_every_flags_default(capsys):
    """The real --help of every subcommand, nested ones included: each option says its default, that
    it is required, or what leaving it unset does, whether it came from the config tree or by hand."""
    parser, _ = build_parser()
    commands = subcommand_names(parser)
    assert len(commands) >= 13, commands
    for command in commands:
        entries = help_entries(help_output(capsys, *command.split()))
        assert entries and "--help" in entries, command
        silent = {
            flag: said
            for flag, said in entries.items()
            if flag != "--help" and not re.search(r"default|required|unset", said)
        }
        assert not silent, f"pathswarm {command} --help: {silent}"


def test_metrics_host_help_says_the_address_a_peer_listens_on_and_how_to_expose_it(capsys):
    said = help_entries(help_output(capsys, "peer"))["--metrics_host"]
    default = re.search(r"\(default: (\S+)\)$", said).group(1)
    assert default == "127.0.0.1" and "0.0.0.0" in said and "-p 9100:9100" in said, said
    config = load_peer_config({"run": "demo", "initial_peers": ["/ip4/127.0.0.1/tcp/1/p2p/x"]})
    metrics = PeerMetrics(run="demo", peer_id="p", path="0", version="0")
    try:  # what the peer does with it (peer/training/peer.py)
        metrics.serve(0, config.metrics_host)
        assert metrics._server.server_address[0] == default
    finally:
        metrics.shutdown()
    # the image keeps the default: its README line runs on the host's network, where loopback is the host's
    dockerfile = (Path(__file__).parents[1] / "docker" / "Dockerfile").read_text()
    assert "PATHSWARM_METRICS_HOST" not in dockerfile.replace("-e PATHSWARM_METRICS_HOST", "")
    monitor = help_entries(help_output(capsys, "monitor"))["--host"]
    assert "(default: 127.0.0.1" in monitor and MonitorOptions("r", [], []).host == "127.0.0.1"


def test_the_monitor_listens_on_this_machine_only_unless_host_says_otherwise():
    from monitoring.swarm.service import MonitorOptions

    monitor = subparser("monitor")
    needed = ["--initial_peers", "/ip4/127.0.0.1/tcp/1", "--run", "r"]
    assert monitor.parse_args(needed).host == "127.0.0.1" == MonitorOptions("r", needed[1:2], []).host
    assert "(default: 127.0.0.1, this machine only;" in flag_help(monitor, "--host")
    assert monitor.parse_args([*needed, "--host", "0.0.0.0"]).host == "0.0.0.0"
