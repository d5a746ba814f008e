"""The volunteer's Docker files as a reader takes them, without Docker: the README's `docker run`
line and docker/compose.yaml give a stopping peer the time to checkpoint and leave, and Compose
mounts the folder a run without shared data reads its files from. (tests/test_docker.py builds the
image and checks the same stack with docker-compose itself.)"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
#: SIGTERM to exit: the peer finishes its step, checkpoints and says bye to its holders
MIN_STOP_SECONDS = 60


def _seconds(duration: str) -> float:
    """A compose duration ("2m", "90s", "1m30s") in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), duration
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def _docker_run_lines(page: Path) -> list[str]:
    return [line for line in page.read_text().splitlines() if "docker run " in line and " peer " in line]


def test_the_docker_run_lines_give_the_peer_time_to_checkpoint_and_leave():
    for page in (ROOT / "README.md", ROOT / "docs" / "volunteer.md"):
        lines = _docker_run_lines(page)
        assert lines, f"{page.name} has no docker run line"
        for line in lines:
            found = re.search(r"--stop-timeout[ =](\d+)", line)
            assert found and int(found.group(1)) >= MIN_STOP_SECONDS, f"{page.name}: {line}"


def test_compose_gives_a_grace_period_and_mounts_a_data_folder_for_runs_without_shared_data():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())  # merge keys resolved
    services = compose["services"]
    for name in ("peer", "peer-gpu"):
        peer = services[name]
        assert _seconds(peer["stop_grace_period"]) >= MIN_STOP_SECONDS, name
        env = peer["environment"]
        root = env["PATHSWARM_DATA_ROOT"]
        mounts = {
            m.group(2): m for v in peer["volumes"] if (m := re.fullmatch(r"(.+):(/[^:]*)(?::(ro|rw))?", v))
        }
        assert root in mounts and mounts[root].group(3) == "ro", (name, peer["volumes"])
        source = mounts[root].group(1)  # ${DATA_DIR:-volume}: the host folder, else a named volume
        default = re.fullmatch(r"\$\{DATA_DIR:-([\w-]+)\}", source)
        assert default and default.group(1) in compose["volumes"], source
    for name in ("bootstrap", "monitor"):  # a keeper writes its state on the way out
        assert _seconds(services[name]["stop_grace_period"]) > 10, name
    example = (ROOT / "docker" / ".env.example").read_text()
    assert re.search(r"^DATA_DIR=", example, re.M) and "--share_data" in example
