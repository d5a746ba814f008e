"""What a newcomer hits with only the README and --help (issue 33): a data file given to the wrong
reader, a used checkpoint folder without --resume, a copy of the run's data that is not the run's, an
address without its peer id, a broken manifest file, a wrong pinned hash. Each is refused in one line
that names the file or flag and what to do, and loses nothing."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from dht.schema import ManifestRecord
from peer.checkpoint import list_checkpoints, save_checkpoint
from peer.cli.main import main
from peer.config import PeerConfig, RunManifest
from peer.data.corpus import write_corpus
from peer.data.sources import DatasetSpec, load_documents
from peer.errors import ConfigError
from peer.run.create import manifest_from_options
from peer.run.options import RunOptions
from peer.run.record import load_verified_manifest, save_record, sign_manifest
from peer.swarm.manifest import _not_found
from peer.training.checkpoints import PeerCheckpoints
from peer.training.startup_checks import check_data

REPO = Path(__file__).resolve().parents[1]
PEER_ID = "12D3KooWHfCtvv1gqbmabwi5t3oxoBJbyV2qjrUqV8SjegRnavq2"


@pytest.fixture(autouse=True)
def _root_logging():
    """`main` sets up logging for a command's process (handlers on this test's stderr): put back
    what the test session had."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _one_error(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pathswarm ")]
    assert len(lines) == 1, lines
    return lines[0]


# --- 1. a data file in another format than --dataset reads ----------------------------------------


def test_run_create_refuses_json_lines_given_as_text_and_names_the_flag_that_reads_them(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path, 40, seed=0, fmt="jsonl")  # part-00000.jsonl: {"domain": …, "text": …} lines
    out = tmp_path / "run.json"
    code = main(["run", "create", "--name", "r", "--grid", "1x1", "--dataset", "text",
                 "--data_files", "part-00000.jsonl", "--out", str(out), "--no_publish"])  # fmt: skip
    line = _one_error(capsys)
    assert code == 2 and "part-00000.jsonl holds JSON lines" in line and "pass --dataset json" in line, line
    assert not out.exists()


@pytest.mark.parametrize(
    "kind,fmt,found,flag",
    [("json", "txt", "one document per line", "--dataset text"), ("parquet", "jsonl", "JSON lines", "json")],
)
def test_a_data_file_another_reader_reads_is_refused_naming_that_reader(tmp_path, kind, fmt, found, flag):
    [path] = write_corpus(tmp_path, 10, seed=0, fmt=fmt)
    with pytest.raises(ConfigError) as err:
        load_documents(DatasetSpec(kind=kind, data_files=[str(path)]))
    assert f"{path} holds {found}" in str(err.value) and flag in str(err.value), err.value


def test_text_lines_that_start_with_a_bracket_are_still_text(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("[draft] a line of prose\n{braces} open this one\n")
    docs = load_documents(DatasetSpec(kind="text", data_files=[str(path)]), cache_dir=str(tmp_path / "c"))
    assert list(docs) == ["[draft] a line of prose", "{braces} open this one"]


# --- 4. every peer's copy of the run's files is the run's ------------------------------------------


def _text_run(tmp_path: Path, monkeypatch) -> RunManifest:
    """A run created over corpus/*.txt (relative, as the README does), from `tmp_path`."""
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "corpus", 120, seed=0, fmt="txt", docs_per_file=60)
    return manifest_from_options(
        RunOptions(name="r", grid="1x1", dataset="text", data_files=["corpus/*.txt"], inner_steps=5)
    )


def _volunteer(root: Path) -> PeerConfig:
    return PeerConfig(run="r", initial_peers=[f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_ID}"], data_root=root)


def test_a_peer_whose_copy_of_a_data_file_is_cut_short_is_refused_naming_the_file_and_its_lines(
    tmp_path, monkeypatch
):
    manifest = _text_run(tmp_path, monkeypatch)
    recorded = manifest.dataset.fingerprints
    assert [f.name for f in recorded] == ["corpus/part-00000.txt", "corpus/part-00001.txt"]
    assert [f.lines for f in recorded] == [60, 60]
    copy = tmp_path / "volunteer"
    (copy / "corpus").mkdir(parents=True)
    (copy / "corpus/part-00000.txt").write_bytes((tmp_path / "corpus/part-00000.txt").read_bytes())
    whole = (tmp_path / "corpus/part-00001.txt").read_text().splitlines(keepends=True)
    (copy / "corpus/part-00001.txt").write_text("".join(whole[:25]))  # 25 of its 60 lines
    with pytest.raises(ConfigError) as err:
        check_data(manifest, _volunteer(copy))
    text = str(err.value)
    assert f"{copy / 'corpus/part-00001.txt'} is not the run's corpus/part-00001.txt" in text, text
    assert "it has 25 lines" in text and "the run's 60 lines" in text and "\n" not in text, text
    # a missing file is named too; the run's own copy passes
    (copy / "corpus/part-00001.txt").unlink()
    with pytest.raises(
        ConfigError, match="match 1 file under --data_root .*had 2 \\(missing corpus/part-00001"
    ):
        check_data(manifest, _volunteer(copy))
    assert check_data(manifest, _volunteer(tmp_path)) == tmp_path


def test_a_manifest_of_the_previous_format_is_refused_in_one_line(tmp_path):
    """Format 8 added routing_index: a format 7 manifest (without it) says so, not that it is not
    canonical."""
    old = {**RunManifest(name="old-run").model_dump(mode="json"), "format_version": 7}
    del old["routing_index"]
    key = RSAPrivateKey()
    manifest_json = json.dumps(old, sort_keys=True, separators=(",", ":"))
    run_id = hashlib.sha256(manifest_json.encode()).hexdigest()
    path = tmp_path / "old.json"
    record = ManifestRecord(run_id=run_id, manifest_json=manifest_json, signature=key.sign(run_id.encode()),
                            creator_public_key=key.get_public_key().to_bytes())  # fmt: skip
    path.write_text(record.model_dump_json())
    with pytest.raises(ConfigError, match="manifest format 7 is not this pathswarm's \\(8\\)"):
        load_verified_manifest(path)


# --- 2. a used checkpoint folder without --resume --------------------------------------------------


def _peer_config(ckpt: Path, *, run: str = "r", resume: bool = False) -> PeerConfig:
    return PeerConfig(run=run, new_swarm=True, manifest_path=ckpt / "unused.json", checkpoint_dir=ckpt,
                      resume=resume)  # fmt: skip


def _saved(ckpt: Path, run: str, steps: tuple[int, ...] = (10, 20)) -> list[Path]:
    for step in steps:
        save_checkpoint(ckpt, {"w": torch.ones(2)}, {"step": step, "run": run, "run_id": "0" * 64}, keep=5)
    return [info.path for info in list_checkpoints(ckpt)]


def test_a_used_checkpoint_dir_without_resume_is_refused_naming_resume_and_nothing_is_pruned(tmp_path):
    ckpt = tmp_path / "ckpt"
    before = _saved(ckpt, "r")
    with pytest.raises(ConfigError) as err:
        PeerCheckpoints(_peer_config(ckpt)).lock()
    text = str(err.value)
    assert "already holds checkpoints of run r up to step 20" in text and "pass --resume" in text, text
    assert "another --checkpoint_dir" in text and "\n" not in text, text
    assert [info.path for info in list_checkpoints(ckpt)] == before
    # refused, it let the folder go; with --resume it is taken
    taken = PeerCheckpoints(_peer_config(ckpt, resume=True))
    taken.lock()
    taken.release()
    # another run's checkpoints: another folder, not --resume
    with pytest.raises(
        ConfigError, match="holds checkpoints of run r up to step 20, not of run s: give another"
    ):
        PeerCheckpoints(_peer_config(ckpt, run="s")).lock()
    # a folder that holds no checkpoint (the lock, an admission token) is a fresh start
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "admission.token").write_text("x")
    PeerCheckpoints(_peer_config(fresh)).lock()


def test_a_peer_started_again_on_its_checkpoint_dir_without_resume_exits_2_before_joining(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    before = _saved(ckpt, "r")
    code = main(["peer", "--run", "r", "--new_swarm", "--manifest_path", str(tmp_path / "m.json"),
                 "--checkpoint_dir", str(ckpt)])  # fmt: skip
    line = _one_error(capsys)
    assert code == 2 and "--resume" in line and str(ckpt) in line, line
    assert [info.path for info in list_checkpoints(ckpt)] == before


# --- 5. error messages ------------------------------------------------------------------------------


@pytest.mark.swarm
def test_an_initial_peer_without_its_peer_id_is_refused_naming_the_missing_part_and_the_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "peer", "peer", "--run", "r", "--initial_peers", "/ip4/127.0.0.1/tcp/31337",
         "--host_maddrs", "/ip4/127.0.0.1/tcp/0"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "--initial_peers: /ip4/127.0.0.1/tcp/31337 lacks its /p2p/<peer id> part" in lines[0], lines[0]
    assert "p2p daemon" not in lines[0], lines[0]


@pytest.mark.parametrize(
    "content,said",
    [
        ('{"run_id": "ab', "is truncated (it ends mid-JSON)"),
        ("<html>not found</html>", "is not JSON"),
        (
            '{"run_id": "' + "a" * 64 + '", "manifest_json": "{}"}',
            "is not a signed manifest: creator_public_key",
        ),
        ("[1, 2]", "holds a JSON list, not a signed manifest"),
    ],
)
def test_a_broken_manifest_file_is_refused_naming_the_file_and_what_is_wrong(tmp_path, content, said):
    path = tmp_path / "myrun.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        load_verified_manifest(path)
    text = str(err.value)
    assert f"manifest file {path} {said}" in text, text
    assert "validation error" not in text and "\n" not in text, text


def test_a_truncated_copy_of_a_real_manifest_says_truncated(tmp_path):
    record = sign_manifest(RunManifest(name="r"), RSAPrivateKey())
    path = tmp_path / "myrun.json"
    save_record(record, path)
    path.write_text(path.read_text()[:300])
    with pytest.raises(ConfigError, match=f"manifest file {path} is truncated"):
        load_verified_manifest(path)


def test_a_wrong_pinned_hash_is_a_sentence_naming_the_pinned_and_the_found_hash(tmp_path):
    found = "0123456789abcdef" + "0" * 48
    text = _not_found("myrun", "deadbeefdeadbeef", None, {found: "c" * 64}, [], 15.0)
    assert text.startswith(
        "the swarm has no run 'myrun' with hash deadbeefdeadbeef (--run myrun@deadbeefdeadbeef)"
    )
    assert "it has 'myrun' only with hash 0123456789abcdef…" in text and " and :" not in text, text
    both = _not_found("myrun", "deadbeefdeadbeef", "ab" * 8, {found: "c" * 64}, [], 15.0)
    assert "hash deadbeefdeadbeef (--run myrun@deadbeefdeadbeef) and creator abababababababab" in both, both
    # a manifest file of another hash than the pin says both
    record = sign_manifest(RunManifest(name="myrun"), RSAPrivateKey())
    save_record(record, tmp_path / "m.json")
    with pytest.raises(ConfigError) as err:
        load_verified_manifest(tmp_path / "m.json", "myrun", "deadbeefdeadbeef")
    assert f"hash {record.run_id[:16]}…, but --run pins hash deadbeefdeadbeef" in str(err.value), err.value


def test_a_demo_into_an_out_folder_of_an_earlier_demo_is_refused_before_anything_starts(tmp_path):
    from peer.cli.demo import run_demo

    before = _saved(tmp_path / "peer0", "demo")
    with pytest.raises(ConfigError, match=f"--out {tmp_path} holds an earlier demo's checkpoints"):
        run_demo(2, 1, 5, 4, tmp_path, 60.0)
    assert [info.path for info in list_checkpoints(tmp_path / "peer0")] == before


# --- 2 and 4 with real peers: the commands a newcomer runs ---------------------------------------


def _peer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "peer", "peer", *args], capture_output=True, text=True,
                          timeout=150, cwd=REPO)  # fmt: skip


@pytest.mark.swarm
@pytest.mark.timeout(400)
def test_peers_refuse_a_data_copy_unlike_the_runs_and_a_used_checkpoint_dir_until_resume(
    tmp_path, monkeypatch
):
    manifest = _text_run(tmp_path, monkeypatch)
    save_record(sign_manifest(manifest, RSAPrivateKey()), tmp_path / "r.json")
    copy = tmp_path / "volunteer" / "corpus"
    copy.mkdir(parents=True)
    for part in ("part-00000.txt", "part-00001.txt"):
        (copy / part).write_bytes((tmp_path / "corpus" / part).read_bytes())
    (copy / "part-00000.txt").write_text("".join((copy / "part-00000.txt").read_text().splitlines(True)[:7]))
    ckpt = tmp_path / "ckpt"
    common = ["--run", "r", "--new_swarm", "--manifest_path", str(tmp_path / "r.json"),
              "--checkpoint_dir", str(ckpt), "--host_maddrs", "/ip4/127.0.0.1/tcp/0",
              "--torch_threads", "1", "--batch_size", "2"]  # fmt: skip

    def refused(proc: subprocess.CompletedProcess) -> str:
        lines = [line for line in proc.stderr.splitlines() if line.startswith("pathswarm ")]
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[
            -3000:
        ]
        return lines[0]

    cut = refused(_peer(*common, "--data_root", str(tmp_path / "volunteer"), "--max_steps", "2"))
    assert f"{copy / 'part-00000.txt'} is not the run's corpus/part-00000.txt: it has 7 lines" in cut, cut
    assert not list_checkpoints(ckpt)
    trained = _peer(*common, "--data_root", str(tmp_path), "--max_steps", "2")
    assert trained.returncode == 0, trained.stderr[-3000:]
    before = [info.path for info in list_checkpoints(ckpt)]
    assert before, trained.stderr[-3000:]
    again = refused(_peer(*common, "--data_root", str(tmp_path), "--max_steps", "4"))
    assert f"--checkpoint_dir {ckpt} already holds checkpoints of run r up to step 2" in again, again
    assert "pass --resume" in again and [info.path for info in list_checkpoints(ckpt)] == before
    resumed = _peer(*common, "--data_root", str(tmp_path), "--max_steps", "4", "--resume")
    assert resumed.returncode == 0 and "resumed from checkpoint at step 2" in resumed.stderr, resumed.stderr[
        -3000:
    ]
