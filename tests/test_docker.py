"""The volunteer's image and compose stack, tested with real tools: podman builds docker/Dockerfile and
runs a containerized peer that trains with peers on the host, stops on SIGTERM with a checkpoint in
its volume and resumes from it; docker-compose (Debian's) validates docker/compose.yaml."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from dht.node import start_dht
from peer.checkpoint import load_latest_checkpoint
from peer.cli.local_swarm import LocalSwarm
from peer.swarm.claims import live_claims
from tests.swarm_harness import RUN, logs_of, wait_for, write_manifest

pytestmark = pytest.mark.swarm

REPO = Path(__file__).resolve().parent.parent
IMAGE = "localhost/pathswarm:test"
BASE_IMAGE = "docker.io/library/python:3.11-slim"
PODMAN = ["podman", "--runtime", "runc"]
FIGURES = Path(os.environ.get("PATHSWARM_DOCKER_FIGURES", "/tmp/pathswarm-docker-figures.json"))


def _podman_ready() -> str | None:
    if shutil.which("podman") is None or shutil.which("runc") is None:
        return "podman and runc are not installed (Debian packages podman, runc)"
    if subprocess.run(["podman", "image", "exists", BASE_IMAGE]).returncode != 0:
        return f"no local {BASE_IMAGE} for --pull=never: run ../shared/tools/container-base.sh first"
    return None


@pytest.fixture(scope="module")
def image() -> str:
    reason = _podman_ready()
    if reason:
        pytest.skip(reason)
    # TORCH_INDEX_URL= : this machine reaches no PyTorch index; pip's own configuration has the CPU wheel
    build = subprocess.run(
        ["podman", "build", "--isolation=chroot", "--pull=never", "--format", "docker",
         "--build-arg", "TORCH_INDEX_URL=", "-f", "docker/Dockerfile", "-t", IMAGE, "."],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    return IMAGE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    assert not check or proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


def image_sizes(image: str) -> dict[str, int]:
    total = json.loads(podman("image", "inspect", image).stdout)[0]["Size"]
    base = json.loads(podman("image", "inspect", BASE_IMAGE).stdout)[0]["Size"]
    return {"image_bytes": total, "base_bytes": base, "above_base_bytes": total - base}


@pytest.mark.timeout(1800)
def test_containerized_peer_trains_with_host_peers_and_resumes_after_sigterm(tmp_path, image):
    manifest, run_id = write_manifest(tmp_path)
    volume = f"pathswarm-test-{uuid.uuid4().hex[:8]}"
    names: list[str] = []
    podman("volume", "create", volume)
    watcher = None
    try:
        with LocalSwarm(tmp_path / "logs") as swarm:
            swarm.start_bootstrap(extra=["--manifest_path", str(manifest)])
            watcher, _ = start_dht(
                initial_peers=swarm.initial_peers, client_mode=True, run_name=RUN, run_id=run_id
            )
            swarm.start_peer("host", ["--run", f"{RUN}@{run_id[:16]}", "--path", "0", "--torch_threads", "1",
                                      "--batch_size", "4", "--heartbeat_seconds", "1", "--max_rounds", "1000",
                                      "--checkpoint_dir", str(tmp_path / "host")])  # fmt: skip
            metrics_port = free_port()

            def start_container(name: str) -> float:
                names.append(name)
                started = time.monotonic()
                podman("run", "-d", "--name", name, "--network", "host", "-v", f"{volume}:/data",
                       "-e", f"PATHSWARM_METRICS_PORT={metrics_port}", image,
                       "peer", "--run", f"{RUN}@{run_id[:16]}", "--initial_peers", *swarm.initial_peers,
                       "--host_maddrs", "/ip4/127.0.0.1/tcp/0", "--path", "0", "--batch_size", "4",
                       "--torch_threads", "1", "--heartbeat_seconds", "1")  # fmt: skip
                return started

            def logs(name: str) -> str:
                proc = podman("logs", name, check=False)
                return proc.stdout + proc.stderr

            def claim_of(peer_id: str):
                return live_claims(watcher, RUN, run_id, 4).get(peer_id)

            def peer_id_in(name: str) -> str:
                joined = re.compile(r"joined run \S+ \(created by key \w+\) as (\w+)")
                found = wait_for(lambda: joined.search(logs(name)), 180, f"{name} to join", swarm)
                return found.group(1)

            # first life: join, first step, two outer rounds with the host peer
            started = start_container("vol-peer-1")
            peer_id = peer_id_in("vol-peer-1")
            wait_for(lambda: (c := claim_of(peer_id)) is not None and c.step >= 1, 300, "a first step", swarm)
            first_step_seconds = time.monotonic() - started
            wait_for(lambda: (c := claim_of(peer_id)) is not None and c.outer_round >= 2, 300,
                     f"two outer rounds\n{logs('vol-peer-1')[-3000:]}", swarm)  # fmt: skip
            health = podman("exec", "vol-peer-1", "pathswarm", "health", check=False)
            assert health.returncode == 0 and health.stdout.startswith("healthy"), health

            # SIGTERM (what `docker stop` sends): finish the step, checkpoint into the volume, leave
            podman("stop", "--time", "90", "vol-peer-1", timeout=120)
            state = json.loads(podman("inspect", "vol-peer-1").stdout)[0]["State"]
            first_log = logs("vol-peer-1")
            assert state["ExitCode"] == 0, first_log[-3000:]
            mount = Path(json.loads(podman("volume", "inspect", volume).stdout)[0]["Mountpoint"])
            _, meta = load_latest_checkpoint(mount / "checkpoints")
            assert meta["peer_id"] == peer_id and meta["outer_round"] >= 2, meta
            assert (mount / "identity.key").exists()
            first_rounds = meta["outer_round"]

            # second life from the same volume: same identity, resumes where it stopped, averages on
            start_container("vol-peer-2")
            assert peer_id_in("vol-peer-2") == peer_id
            wait_for(lambda: f"resumed from checkpoint at step {meta['step']}" in logs("vol-peer-2"), 120,
                     f"the restart to resume\n{logs('vol-peer-2')[-3000:]}", swarm)  # fmt: skip

            # two more rounds *trained*: catching up to the holders' round alone also raises the claim's count
            def trained_on() -> bool:
                steps = [int(s) for s in re.findall(r"round \d+ step (\d+) loss", logs("vol-peer-2"))]
                c = claim_of(peer_id)
                return (
                    c is not None
                    and c.outer_round >= first_rounds + 2
                    and max(steps, default=0) > meta["step"]
                )

            wait_for(trained_on, 300, f"two more rounds\n{logs('vol-peer-2')[-3000:]}", swarm)
            podman("stop", "--time", "90", "vol-peer-2", timeout=120)
            second_log = logs("vol-peer-2")
            _, meta2 = load_latest_checkpoint(mount / "checkpoints")
            assert meta2["outer_round"] >= first_rounds + 2 and meta2["step"] > meta["step"], meta2
            averaged = re.findall(
                r"round \d+ step \d+ loss [\d.]+ \{.*averaged/2.*\}", first_log + second_log
            )
            assert averaged, logs_of(swarm, "host") + second_log[-3000:]
            FIGURES.write_text(json.dumps({
                **image_sizes(image),
                "start_to_first_step_seconds": round(first_step_seconds, 1),
                "rounds_first_life": first_rounds,
                "rounds_total": meta2["outer_round"],
                "rounds_averaged_with_host": len(averaged),
            }, indent=1))  # fmt: skip
    finally:
        if watcher is not None:
            watcher.shutdown()
        for name in names:
            podman("rm", "-f", "-t", "5", name, check=False)
        podman("volume", "rm", "-f", volume, check=False)


# --- compose ---------------------------------------------------------------------------------------

ENV_EXAMPLE = REPO / "docker" / ".env.example"


def compose_config(env: dict[str, str]) -> subprocess.CompletedProcess:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (Debian package docker-compose): cannot validate")
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    return subprocess.run(
        ["docker-compose", "-f", "docker/compose.yaml", "--profile", "cpu", "config"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**keep, **env},
    )  # fmt: skip


def example_env() -> dict[str, str]:
    pairs = [
        line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines() if re.match(r"^[A-Z_]+=", line)
    ]
    return {k: v for k, v in pairs}


@pytest.mark.timeout(120)
def test_compose_file_is_valid_and_wires_the_volunteer_settings():
    proc = compose_config(example_env())
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    services = config["services"]
    assert set(services) == {"bootstrap", "peer", "peer-gpu", "monitor", "prometheus", "grafana"}
    assert services["peer"]["profiles"] == ["cpu"] and services["peer-gpu"]["profiles"] == ["gpu"]
    devices = services["peer-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    env = services["peer"]["environment"]
    settings = example_env()
    assert (
        env["PATHSWARM_RUN"] == settings["RUN"]
        and env["PATHSWARM_INITIAL_PEERS"] == settings["INITIAL_PEERS"]
    )
    assert env["PATHSWARM_BATCH_SIZE"] == settings["BATCH_SIZE"]
    for name in ("bootstrap", "peer", "peer-gpu", "monitor", "prometheus", "grafana"):
        assert services[name]["restart"] == "unless-stopped", name
    assert any(v.endswith(":/data:rw") or v.endswith(":/data") for v in services["peer"]["volumes"])
    # docker stop's SIGTERM: time to finish the step, checkpoint and leave (Docker's default is 10 s)
    assert services["peer"]["stop_grace_period"] == "2m" and services["peer-gpu"]["stop_grace_period"] == "2m"
    # a run without --share_data: its files from DATA_DIR (unset in the example: an empty volume)
    assert env["PATHSWARM_DATA_ROOT"] == "/corpus" and "peer-corpus:/corpus:ro" in services["peer"]["volumes"]
    with_data = compose_config({**settings, "DATA_DIR": "/srv/corpus"})
    peer = yaml.safe_load(with_data.stdout)["services"]["peer"]
    assert "/srv/corpus:/corpus:ro" in peer["volumes"], peer["volumes"]
    assert "monitor --run " + settings["RUN"] in services["monitor"]["command"]
    # every file the stack mounts is in the repository (the monitoring files come from the monitor's issue)
    mounts = [v.split(":")[0] for s in services.values() for v in s.get("volumes", []) if v.startswith("/")]
    missing = [m for m in mounts if not Path(m).exists()]
    if missing and not (REPO / "monitoring" / "prometheus").exists():
        pytest.skip(f"monitoring files not in this checkout yet: {missing}")
    assert not missing, missing


@pytest.mark.timeout(120)
def test_compose_refuses_to_start_without_a_run_name():
    env = {k: v for k, v in example_env().items() if k != "RUN"}
    proc = compose_config(env)
    assert proc.returncode != 0 and "set RUN in docker/.env" in proc.stderr, proc.stderr


@pytest.mark.timeout(120)
def test_compose_monitoring_listens_on_loopback_and_grafana_has_no_anonymous_or_default_admin():
    proc = compose_config({**example_env(), "GRAFANA_ADMIN_PASSWORD": "pw-from-env"})
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    grafana = services["grafana"]["environment"]
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_AUTH_ANONYMOUS_ORG_ROLE" not in grafana
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"] == "pw-from-env"
    # this machine only, unless docker/.env says otherwise
    assert grafana["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert "--web.listen-address=127.0.0.1:9090" in services["prometheus"]["command"]
    assert services["monitor"]["command"].split()[-2:] == ["--host", "127.0.0.1"]
    for name, service in services.items():
        published = [str(p) for p in service.get("ports", [])]
        assert all(p.startswith("127.0.0.1:") for p in published), (name, published)
    exposed = compose_config({**example_env(), "MONITOR_HOST": "0.0.0.0", "GRAFANA_HOST": "0.0.0.0"})
    exposed_services = yaml.safe_load(exposed.stdout)["services"]
    assert exposed_services["monitor"]["command"].split()[-2:] == ["--host", "0.0.0.0"]
    assert exposed_services["grafana"]["environment"]["GF_SERVER_HTTP_ADDR"] == "0.0.0.0"
    # Grafana's entrypoint, run by a real shell as compose would ($$ is compose's escaped $): it refuses
    # an unset or default password before Grafana (/run.sh) starts, and otherwise hands over to it
    entrypoint = services["grafana"]["entrypoint"]
    assert entrypoint[:2] == ["sh", "-c"]
    script = entrypoint[2].replace("$$", "$")
    for password, refused in (("", True), ("admin", True), ("pw-from-env", False)):
        ran = subprocess.run(
            ["sh", "-c", script, *entrypoint[3:]], capture_output=True, text=True, timeout=10,
            env={"PATH": os.environ["PATH"], "GF_SECURITY_ADMIN_PASSWORD": password},
        )  # fmt: skip
        said = "grafana: set GRAFANA_ADMIN_PASSWORD in docker/.env" in ran.stderr
        assert (ran.returncode == 64 and said) if refused else (ran.returncode != 64 and not said), (
            password, ran.returncode, ran.stderr,
        )  # fmt: skip
