"""The README: its Quick start holds the two commands a fresh machine runs (CI must run the second), its
command blocks run as written, and every relative link in it and in docs/ points at a file."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer.cli.local_swarm import LocalSwarm
from peer.data.corpus import write_corpus
from peer.run.record import load_record
from tests.test_readme_snippets import run_hf_snippet

pytestmark = pytest.mark.swarm

ROOT = Path(__file__).resolve().parents[1]


#: the README stays a front page; the rest lives in docs/
README_MAX_LINES = 300


def test_ci_runs_the_readme_test_command():
    """The Quick start's block is exactly two commands, install + demo first and the tests second;
    `.ci/run` runs the second as written."""
    lines = ROOT.joinpath("README.md").read_text().splitlines()
    assert lines[0].startswith("# ") and lines[0][2:].strip(), lines[0]
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    commands = readme_block("## Quick start")
    assert len(commands) == 2, commands
    install_and_demo, tests = commands
    assert "pathswarm demo" in install_and_demo and "pip install" in install_and_demo
    assert "pytest" in tests and "pip install" in tests
    assert tests in ROOT.joinpath(".ci", "run").read_text()


#: [text](target) and ![alt](target), not inside code spans or fenced blocks
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _links(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return MARKDOWN_LINK.findall(text)


def _anchors(text: str) -> set[str]:
    """The #anchors a markdown page's headings get (GitHub's rule: lower case, punctuation dropped,
    spaces to hyphens)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    headings = re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_in_the_readme_and_docs_resolves():
    """Links to other sites are not followed; every other link must name a file or folder of the
    checkout, and an #anchor into a markdown page one of its headings."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken, checked = [], 0
    for page in pages:
        for target in _links(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # http:, https:, mailto: …
            path, _, anchor = target.partition("#")
            linked = page.parent / path if path else page
            checked += 1
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert checked > 50, checked  # the README and docs/ link to each other: this must find them
    assert not broken, broken


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


def _start(command: str, cwd: Path, name: str, env: dict) -> subprocess.Popen:
    """A README command in the background, its output in cwd/name.log, in its own process group."""
    with open(cwd / f"{name}.log", "w") as log:
        return subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def _log(cwd: Path, name: str) -> str:
    return (cwd / f"{name}.log").read_text()


def _initial_peer(swarm: LocalSwarm, cwd: Path) -> str:
    """The first address of the --initial_peers line the bootstrap prints."""
    deadline, found = time.monotonic() + 90, []
    while not found:
        assert swarm.alive("bootstrap") and time.monotonic() < deadline, _log(cwd, "bootstrap")
        found = re.findall(r"^--initial_peers (\S+)", _log(cwd, "bootstrap"), re.M)
        time.sleep(0.3)
    return found[0]


@pytest.mark.timeout(420)
def test_the_researchers_steps_run_as_written(tmp_path, monkeypatch):
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
        return _start(command, tmp_path, name, env)

    def log_of(name: str) -> str:
        return _log(tmp_path, name)

    run(commands[0])
    with LocalSwarm(tmp_path / "logs") as swarm:  # stops whatever is left, whatever happens
        swarm.procs["bootstrap"] = start(commands[1].replace("/tcp/31337", "/tcp/0"), "bootstrap")
        peer = commands[2].replace("/ip4/127.0.0.1/tcp/31337/p2p/…", _initial_peer(swarm, tmp_path))
        assert peer != commands[2] and "ckpt/peer0" in peer, commands[2]
        for i in range(4):
            swarm.procs[f"peer{i}"] = start(peer.replace("ckpt/peer0", f"ckpt/peer{i}"), f"peer{i}")
        for i in range(4):
            assert swarm.wait(f"peer{i}", timeout=240) == 0, log_of(f"peer{i}")[-3000:]
    evaluated = run(commands[3])
    assert "composite / dense perplexity" in evaluated, evaluated
    report = json.loads((tmp_path / "eval.json").read_text())
    assert all(e["steps"] > 0 for e in report["composite"]["per_path"].values()), report["composite"]
    # the router's biases balance the run's held-out documents too (2.25x on this corpus without)
    assert report["routing_balance"] <= 2.0, report["composite"]["per_path"]
    assert run(commands[4]).strip()
    run(commands[5])
    run(commands[6])
    assert (tmp_path / "path0" / "config.json").exists()
    assert (tmp_path / "path0-hf" / "model.safetensors").exists()
    assert (tmp_path / "path0-hf" / "tokenizer.json").exists()
    # then the researcher page's transformers snippet on that export, with a prompt of 38 bytes (any
    # over 24 once indexed past the 64 positions), as docs/researcher.md links it from here
    prompt = "def add(a, b):\n    return a + b  # sum"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local folder: nothing to fetch
    printed = run_hf_snippet(tmp_path / "path0-hf", prompt)
    assert printed.startswith(prompt) and "[stopped at the model's context: 64 tokens" in printed, printed


@pytest.mark.timeout(300)
def test_the_real_swarm_steps_run_as_written(tmp_path):
    """ "Running a real swarm" as written: a bootstrap with its identity, `run create` publishing to it
    (and reading it back) with the data shared by hash, the researcher's peer serving it, a volunteer
    joining by name and hash prefix (fetching the data) until its first round, then SIGTERM.
    Substituted: the ports (31337 and 9100 may be taken here: 0), the address and the hash
    placeholders."""
    write_corpus(tmp_path / "corpus", 600, seed=4, fmt="txt", docs_per_file=300)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    commands = readme_block("## Running a real swarm")
    assert [c.split()[1] for c in commands] == ["bootstrap", "run", "peer", "peer"], commands
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.procs["bootstrap"] = _start(
            commands[0].replace("/tcp/31337", "/tcp/0"), tmp_path, "bootstrap", env
        )
        address = _initial_peer(swarm, tmp_path)
        create = commands[1].replace("/ip4/…/p2p/…", address)
        proc = subprocess.run(["bash", "-c", create], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=240)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        run_id = load_record(tmp_path / "myrun.json").run_id
        researcher = commands[2].replace("/ip4/…/p2p/…", address)
        swarm.procs["researcher"] = _start(researcher, tmp_path, "researcher", env)
        peer = commands[3].replace("/ip4/…/p2p/…", address).replace("<hash prefix>", run_id[:16])
        swarm.procs["peer"] = _start(
            peer.replace("--metrics_port 9100", "--metrics_port 0"), tmp_path, "peer", env
        )
        deadline = time.monotonic() + 180
        while not re.search(r"round \d+ step \d+ loss", _log(tmp_path, "peer")):
            assert swarm.alive("peer") and time.monotonic() < deadline, _log(tmp_path, "peer")[-3000:]
            time.sleep(0.5)
        for name in ("peer", "researcher"):
            swarm.kill(name, signal.SIGTERM)
            assert swarm.wait(name, timeout=60) == 0, _log(tmp_path, name)[-3000:]
    assert f"joined run myrun@{run_id[:16]}" in _log(tmp_path, "peer")
    # the researcher's peer holds the key that created the run: it admits the run's volunteers
    assert "admitting keys to run myrun (open) as its creator" in _log(tmp_path, "researcher")
    # the volunteer had no copy of the corpus: it trained on the shards the researcher's peer served
    assert "fetching data shard" in _log(tmp_path, "peer")
    assert "fetching data shard" not in _log(tmp_path, "researcher")  # it has the corpus
    assert (tmp_path / "peer.id").exists() and (tmp_path / "bootstrap.id").exists()
