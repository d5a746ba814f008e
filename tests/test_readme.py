"""The README's first two lines are the commands a fresh machine runs; CI must run the second."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer.cli.local_swarm import LocalSwarm
from peer.data.corpus import write_corpus

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    lines = ROOT.joinpath("README.md").read_text().splitlines()
    install_and_demo, tests = lines[0].strip(), lines[1].strip()
    assert "pathswarm demo" in install_and_demo and "pip install" in install_and_demo
    assert "pytest" in tests and "pip install" in tests
    assert tests in ROOT.joinpath(".ci", "run").read_text()


def readme_block(heading: str) -> list[str]:
    """The commands of the first ```bash block under `heading`, continuation lines joined."""
    text = ROOT.joinpath("README.md").read_text()
    section = text[text.index(heading) :]
    block = section[section.index("```bash\n") + len("```bash\n") :]
    block = block[: block.index("```")]
    commands, current = [], ""
    for line in block.splitlines():
        line = re.sub(r"\s+# .*$", "", line) if not line.lstrip().startswith("#") else ""
        if not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        commands.append((current + line).strip())
        current = ""
    return commands


@pytest.mark.timeout(420)
def test_the_researchers_steps_run_as_written(tmp_path):
    """Every command of "For researchers" in order, as written: the bootstrap's port and the address
    placeholder are the only substitutions (a test cannot own port 31337), and the peer line runs
    once per peer with its own checkpoint_dir, as its comment says."""
    write_corpus(tmp_path / "corpus", 1200, seed=3, fmt="txt", docs_per_file=400)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    commands = readme_block("## For researchers")
    assert [c.split()[1] for c in commands] == [
        "run", "bootstrap", "peer", "eval", "generate", "export", "export"
    ], commands  # fmt: skip

    def run(command: str) -> str:
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=240)  # fmt: skip
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout

    def start(command: str, name: str) -> subprocess.Popen:
        with open(tmp_path / f"{name}.log", "w") as log:
            return subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=tmp_path, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def log_of(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()

    run(commands[0])
    with LocalSwarm(tmp_path / "logs") as swarm:  # stops whatever is left, whatever happens
        swarm.procs["bootstrap"] = start(commands[1].replace("/tcp/31337", "/tcp/0"), "bootstrap")
        deadline, found = time.monotonic() + 90, []
        while not found:
            assert swarm.alive("bootstrap") and time.monotonic() < deadline, log_of("bootstrap")
            found = re.findall(r"^--initial_peers (\S+)", log_of("bootstrap"), re.M)
            time.sleep(0.3)
        peer = commands[2].replace("/ip4/127.0.0.1/tcp/31337/p2p/…", found[0])
        assert peer != commands[2] and "ckpt/peer0" in peer, commands[2]
        for i in range(4):
            swarm.procs[f"peer{i}"] = start(peer.replace("ckpt/peer0", f"ckpt/peer{i}"), f"peer{i}")
        for i in range(4):
            assert swarm.wait(f"peer{i}", timeout=240) == 0, log_of(f"peer{i}")[-3000:]
    evaluated = run(commands[3])
    assert "composite / dense perplexity" in evaluated, evaluated
    report = json.loads((tmp_path / "eval.json").read_text())
    assert all(e["steps"] > 0 for e in report["composite"]["per_path"].values()), report["composite"]
    assert run(commands[4]).strip()
    run(commands[5])
    run(commands[6])
    assert (tmp_path / "path0" / "config.json").exists()
    assert (tmp_path / "path0-hf" / "model.safetensors").exists()
    assert (tmp_path / "path0-hf" / "tokenizer.json").exists()
