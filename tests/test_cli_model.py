"""`pathswarm eval | generate | export` on checkpoints written like a swarm's peers write them."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from peer.checkpoint import save_checkpoint
from peer.cli.model_commands import register
from peer.config import InnerOptimizerConfig, RunManifest, SyncConfig
from peer.data.sources import DatasetSpec, load_documents, split_of
from peer.model.grid import ModelConfig, path_from_index, path_module_ids
from peer.model.tokenizer import ByteTokenizer
from peer.model.transformer import GridModel
from peer.offline.experiment import shard
from peer.offline.grid_checkpoints import assemble_grid
from peer.offline.inference import export_path, load_exported
from peer.offline.simulate import DipacoSim, SimConfig
from peer.run.create import build_manifest
from peer.run.rebuild import make_route
from peer.run.record import save_record, sign_manifest


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    return build_trained_run(tmp_path_factory.mktemp("run"))


def build_trained_run(root):
    """A signed manifest and one checkpoint folder per path, after a few DiPaCo rounds."""
    model = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64)
    dataset = DatasetSpec(kind="builtin", builtin_docs=300, eval_fraction=0.1)
    manifest = build_manifest(
        "cli-test",
        model,
        dataset,
        seq_len=32,
        inner=InnerOptimizerConfig(lr=3e-3, warmup_steps=2, total_steps=10),
        sync=SyncConfig(inner_steps=5),
        router_docs=200,
    )
    record_file = root / "manifest.json"
    save_record(sign_manifest(manifest, RSAPrivateKey()), record_file)
    tok = ByteTokenizer()
    train = [t for t in load_documents(dataset) if split_of(t, dataset) == "train"]
    shards = shard(train, make_route(manifest), tok, model.n_paths)
    sim = DipacoSim(SimConfig.from_manifest(manifest, batch_size=4), shards, tok, 10, progress=False)
    sim.train(10)
    state = sim.global_state()
    dirs = []
    for index in range(model.n_paths):
        path = path_from_index(model, index)
        mids = path_module_ids(model, path)
        tensors = {k: v for k, v in state.items() if k.split("/")[0] in mids}
        meta = dict(step=10, outer_round=2, run_id=manifest.run_id, path=list(path), tokens_total=10 * 4 * 32)
        save_checkpoint(root / f"peer{index}", tensors, meta)
        dirs.append(str(root / f"peer{index}"))
    return manifest, record_file, dirs, sim


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    handlers = register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return handlers[args.command](args)


def test_eval_prints_a_table_and_writes_json(trained_run, tmp_path, capsys):
    manifest, record_file, dirs, sim = trained_run
    out = tmp_path / "eval.json"
    argv = ["eval", "--manifest_path", str(record_file), "--checkpoints", *dirs, "--max_docs", "8"]
    assert _run(argv + ["--baseline_steps", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "composite / dense perplexity" in printed and "all" in printed
    result = json.loads(out.read_text())
    assert result["run_id"] == manifest.run_id and result["baseline_steps"] == 4
    assert result["composite"]["docs"] == 8 and result["dense"]["tokens"] == result["composite"]["tokens"]
    # The grid the CLI assembled is the simulation's global copy.
    grid, expected = assemble_grid(manifest, dirs), sim.grid()
    for a, b in zip(grid.parameters(), expected.parameters(), strict=True):
        assert torch.equal(a, b)
    assert _run(argv + ["--baseline_steps", "0", "--swarm_baseline_steps", "0"]) == 0
    assert "composite / dense" not in capsys.readouterr().out


def test_eval_says_its_units_and_compares_with_dense_at_one_paths_and_at_the_swarms_steps(
    trained_run, tmp_path, capsys
):
    """Perplexity per byte (the byte tokenizer) and bits per byte, against a dense path-size model at
    one path's steps (10) and at the swarm's, all 4 paths' steps together (40): as many tokens as the
    swarm trained on."""
    _, record_file, dirs, _ = trained_run
    out = tmp_path / "eval.json"
    argv = ["eval", "--manifest_path", str(record_file), "--checkpoints", *dirs, "--max_docs", "8"]
    assert _run([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "dipaco ppl/byte" in printed and "dense ppl/byte (10 steps)" in printed, printed
    assert "dense ppl/byte (40 steps)" in printed, printed
    assert "perplexity is per byte" in printed and "bits per byte" in printed, printed
    assert "dense baseline: 10 steps, one path's steps" in printed, printed
    assert "dense baseline: 40 steps, the swarm's steps" in printed, printed
    report = json.loads(out.read_text())
    assert report["unit"] == "byte" and (report["baseline_steps"], report["swarm_baseline_steps"]) == (10, 40)
    composite, one, swarm = report["composite"], report["dense"], report["dense_swarm_steps"]
    assert 0 < composite["bits_per_byte"] < 8 and composite["text_bytes"] < composite["tokens"]
    # bits per byte is the same NLL over the text's bytes (every document's end-of-text has none)
    nll = math.log(composite["ppl"]) * composite["tokens"]
    assert composite["bits_per_byte"] == pytest.approx(nll / math.log(2) / composite["text_bytes"])
    assert swarm["ppl"] < one["ppl"]  # 4x the steps, on the same schedule
    assert report["ratio_swarm_steps"] == pytest.approx(composite["ppl"] / swarm["ppl"])


def test_export_then_generate_from_the_export_and_from_checkpoints(trained_run, tmp_path, capsys):
    manifest, record_file, dirs, _ = trained_run
    out = tmp_path / "export"
    assert (
        _run(
            [
                "export",
                "--manifest_path",
                str(record_file),
                "--checkpoints",
                dirs[1],
                "--path",
                "0,1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert load_exported(out).path == (0, 1)
    capsys.readouterr()
    sampling = ["--prompt", "count: 1, 2, 3", "--max_new_tokens", "12", "--seed", "3"]
    assert _run(["generate", "--exported", str(out), *sampling]) == 0
    assert capsys.readouterr().out.startswith("[path 1 0,1]")
    assert _run(["generate", "--manifest_path", str(record_file), "--checkpoints", *dirs, *sampling]) == 0
    assert "count: 1, 2, 3" in capsys.readouterr().out


def test_user_errors_are_one_line_value_errors(trained_run, tmp_path):
    _, record_file, dirs, _ = trained_run
    with pytest.raises(ValueError, match="no checkpoint holds module"):
        _run(
            [
                "export",
                "--manifest_path",
                str(record_file),
                "--checkpoints",
                dirs[0],
                "--path",
                "3",
                "--out",
                str(tmp_path / "x"),
            ]
        )
    with pytest.raises(ValueError, match="cannot read manifest file"):
        _run(["eval", "--manifest_path", str(tmp_path / "missing.json"), "--checkpoints", *dirs])
    with pytest.raises(ValueError, match="or --exported"):
        _run(["generate", "--prompt", "hi"])
    with pytest.raises(ValueError, match="no valid checkpoint"):
        _run(["eval", "--manifest_path", str(record_file), "--checkpoints", str(tmp_path)])


def test_eval_reports_steps_and_share_per_path(trained_run, tmp_path):
    _, record_file, dirs, _ = trained_run
    out = tmp_path / "eval.json"
    argv = ["eval", "--manifest_path", str(record_file), "--checkpoints", *dirs, "--baseline_steps", "0"]
    assert _run(argv + ["--swarm_baseline_steps", "0", "--json", str(out)]) == 0
    per_path = json.loads(out.read_text())["composite"]["per_path"]
    assert sorted(per_path) == ["0", "1", "2", "3"]  # every path, also one no document went to
    assert all(entry["steps"] == 10 for entry in per_path.values())
    assert sum(entry["share"] for entry in per_path.values()) == pytest.approx(1.0)


def test_a_path_no_peer_trained_is_refused_unless_allowed(trained_run, tmp_path, capsys):
    _, record_file, dirs, _ = trained_run
    # the peers of paths 0, 1 and 2 hold every module of path 3 (1,1), but nobody trained it as a path
    three = dirs[:3]
    eval_argv = [
        "eval",
        "--manifest_path",
        str(record_file),
        "--checkpoints",
        *three,
        "--baseline_steps",
        "0",
        "--swarm_baseline_steps",
        "0",
    ]
    with pytest.raises(ValueError, match=r"no checkpoint's peer trained: 3 \(1,1: \d+%\)"):
        _run(eval_argv)
    out = tmp_path / "eval.json"
    assert _run([*eval_argv, "--allow_untrained", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["composite"]["per_path"]["3"]["steps"] == 0
    export = ["export", "--manifest_path", str(record_file), "--checkpoints", *three, "--path", "1,1"]
    with pytest.raises(ValueError, match="--allow_untrained"):
        _run([*export, "--out", str(tmp_path / "x")])
    assert _run([*export, "--out", str(tmp_path / "x"), "--allow_untrained"]) == 0


def _export_predicting(tmp_path, token: int):
    """An exported path whose every next token is `token` (its embedding row dominates the tied head)."""
    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=64)
    grid = GridModel(cfg, seed=0)
    trunk = grid.path_model((0, 0)).parts["trunk"]
    with torch.no_grad():
        trunk.ln_f.weight.zero_()
        trunk.tok_emb.weight[token] *= 100
        trunk.ln_f.bias.copy_(trunk.tok_emb.weight[token])
    manifest = RunManifest(name="gen-why", model=cfg, seq_len=32)
    return export_path(grid, (0, 0), tmp_path / f"predicts-{token}", manifest)


def test_generate_says_why_it_printed_nothing_after_the_prompt(tmp_path, capsys):
    """A prompt printed alone is explained: the model ended the text at once (and --min_new_tokens
    goes past it), or what it generated is only whitespace (an undertrained model's spaces)."""
    tok = ByteTokenizer()
    ends = _export_predicting(tmp_path, tok.eos_id)
    assert _run(["generate", "--exported", str(ends), "--prompt", "hello"]) == 0
    said = capsys.readouterr()
    assert said.out.splitlines()[-1] == "hello"
    assert "nothing generated" in said.err and "end-of-text" in said.err and "--min_new_tokens" in said.err
    assert _run(["generate", "--exported", str(ends), "--prompt", "hello", "--min_new_tokens", "5"]) == 0
    said = capsys.readouterr()
    assert "stopped at the model's end-of-text token" in said.err and said.err.startswith("[5 new tokens")

    spaces = _export_predicting(tmp_path, ord(" "))
    assert _run(["generate", "--exported", str(spaces), "--prompt", "hello", "--max_new_tokens", "40"]) == 0
    said = capsys.readouterr()
    assert said.out.splitlines()[-1] == "hello" + " " * 40
    assert "40 new tokens, stopped at --max_new_tokens" in said.err and "only whitespace" in said.err
    assert "context of 32 tokens the window slid on" in said.err  # 1 + 5 + 40 tokens > 32
