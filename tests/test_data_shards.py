"""A run's data and tokenizer shared by hash: `run create --share_data` copies the local files beside
the manifest (a tokenizer file always goes there), a node started with that manifest serves them, and
a peer with no copy (no --data_root, the originals gone) fetches them, checks them and trains on the
same documents, routed by the run's routing index; eval finds them too."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from peer.artifacts.ref import describe_file
from peer.cli.local_swarm import LocalSwarm
from peer.data.sources import DatasetSpec, load_documents, local_files, shard_files
from peer.errors import ConfigError
from peer.run.record import load_verified_manifest
from tests.swarm_harness import wait_for
from tests.test_data import _train_file_tokenizer

pytestmark = pytest.mark.swarm

REPO = Path(__file__).resolve().parent.parent

TOPICS = ("rivers carry silt to the sea", "a compiler turns source into code", "bread rises with yeast")


def _corpus(folder: Path, files: int = 3, lines: int = 120) -> list[Path]:
    folder.mkdir(parents=True)
    out = []
    for f in range(files):
        path = folder / f"part{f}.txt"
        path.write_text(
            "\n".join(
                f"{TOPICS[(f + i) % 3]} and line {i} of file {f} says {i * 7 % 13}" for i in range(lines)
            )
            + "\n"
        )
        out.append(path)
    return out


def _create(folder: Path, corpus: Path, *extra: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "manifest.json"
    args = ["run", "create", "--name", "shared", "--out", str(out), "--grid", "1x2", "--inner_steps", "10",
            "--seq_len", "32", "--dataset", "text", "--data_files", str(corpus / "*.txt"), "--no_publish",
            *extra]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "peer", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_a_spec_names_its_files_by_path_or_by_hash_and_a_missing_shard_is_named(tmp_path):
    files = _corpus(tmp_path / "corpus", files=2, lines=5)
    refs = [describe_file(f, f.name)[0] for f in files]
    with pytest.raises(ValueError, match="either by path"):
        DatasetSpec(kind="text", data_files=["a.txt"], shards=refs)
    with pytest.raises(ValueError, match="only used with kind"):
        DatasetSpec(kind="builtin", shards=refs)
    spec = DatasetSpec(kind="text", shards=refs)
    store = tmp_path / "store"
    store.mkdir()
    shutil.copy(files[0], store / refs[0].sha256)
    with pytest.raises(ConfigError, match=r"data shard part1\.txt .* is in none of"):
        shard_files(spec, [store])
    shutil.copy(files[1], store / refs[1].sha256)
    assert local_files(spec, shard_folders=[tmp_path / "elsewhere", store]) == [
        str(store / r.sha256) for r in refs
    ]
    # the same documents in the same order as the files they came from
    by_path = list(load_documents(DatasetSpec(kind="text", data_files=[str(tmp_path / "corpus" / "*.txt")])))
    assert list(load_documents(spec, shard_folders=[store])) == by_path


@pytest.mark.timeout(300)
def test_a_peer_without_the_files_fetches_the_runs_shards_and_tokenizer_and_trains_on_them(tmp_path):
    corpus = tmp_path / "corpus"
    files = _corpus(corpus)
    (tmp_path / "tok").mkdir()
    _train_file_tokenizer(tmp_path / "tok" / "tokenizer.json", ["<s>", "</s>", "<pad>"])
    manifest_path = _create(
        tmp_path / "run", corpus, "--share_data", "--tokenizer", str(tmp_path / "tok" / "tokenizer.json")
    )
    manifest, record = load_verified_manifest(manifest_path)
    spec = manifest.dataset
    assert spec.data_files == [] and [r.name for r in spec.shards] == [
        f"{i:05d}-part{i}.txt" for i in range(3)
    ]
    assert manifest.tokenizer_file is not None
    originals = {describe_file(f, f.name)[0].sha256: f.read_bytes() for f in files}
    shutil.rmtree(corpus)  # nobody has the files or the tokenizer by path any more
    shutil.rmtree(tmp_path / "tok")
    # each waits for the other: a peer slow to fetch the shards under load would otherwise find its
    # partner's two rounds over and gone, and train its own alone from round 0
    common = ["--torch_threads", "1", "--batch_size", "4", "--heartbeat_seconds", "1"]
    common += ["--wait_for_peers", "2"]
    with LocalSwarm(tmp_path / "logs") as swarm:
        swarm.start_bootstrap(extra=["--manifest_path", str(manifest_path)])
        # both join by name and pin alone: no manifest file, no --data_root
        for name, path in (("a", "0"), ("b", "1")):
            args = ["--run", f"shared@{record.run_id[:16]}", "--path", path, "--checkpoint_dir",
                    str(tmp_path / name), "--max_rounds", "2"]  # fmt: skip
            swarm.start_peer(name, [*args, *common])
        for name in ("a", "b"):
            wait_for(lambda n=name: not swarm.alive(n), 180, f"peer {name}'s two rounds", swarm)
            assert swarm.wait(name, timeout=10) == 0, swarm.log_path(name).read_text()[-3000:]
        boot_log, *logs = (swarm.log_path(n).read_text() for n in ("bootstrap", "a", "b"))
    assert "6 artifacts" in boot_log, boot_log[-2000:]  # 3 shards, the tokenizer, the router, the index
    for name, log in zip("ab", logs, strict=True):
        assert log.count("fetching data shard") == 3 and "round 2 step" in log, log[-3000:]
        assert "fetching the run's tokenizer" in log, log[-3000:]
        assert "fetching the run's routing index" in log, log[-3000:]
        for ref in spec.shards:
            assert (tmp_path / name / "artifacts" / ref.sha256).read_bytes() == originals[ref.sha256]
        # the run's index covers its 360 documents: the peer routed none of them itself
        assert not [f for f in (tmp_path / name / "routes").glob("*.idx") if f.stat().st_size], name
    # eval reads the held-out documents from the shards (here: the peer's copies)
    shutil.rmtree(tmp_path / "run" / "artifacts")
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "eval", "--manifest_path", str(manifest_path), "--checkpoints",
         str(tmp_path / "a"), str(tmp_path / "b"), "--max_docs", "10", "--baseline_steps", "0",
         "--swarm_baseline_steps", "0",
         "--json", str(tmp_path / "eval.json")],
        capture_output=True, text=True, cwd=REPO, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "eval.json").read_text())["composite"]["docs"] >= 1
