"""`pathswarm export --format hf`: transformers loads the folder with no custom code, computes the
path's logits, cuts text into the run's ids and generates greedily what `pathswarm generate` does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peer.cli.main import main
from peer.config import RunManifest
from peer.model.grid import ModelConfig, parse_path
from peer.model.tokenizer import ByteTokenizer, load_tokenizer
from peer.model.transformer import GridModel, PathModel
from peer.offline.grid_checkpoints import assemble_grid
from peer.offline.hf_export import export_hf
from peer.offline.inference import generate
from tests.test_cli_model import build_trained_run
from tests.test_data import _train_file_tokenizer

pytestmark = pytest.mark.swarm

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is a dev dependency (pip install -e '.[dev]'); the hf export test needs it",
)

# ASCII, multi-byte UTF-8, control bytes, and the special tokens' names written as plain text
TEXTS = [
    "count: 1, 2, 3",
    "def add(a, b):\n\treturn a + b  # ok",
    "héllo wörld — 中文字符, emoji 🙂🚀, \x00\x7f",
    "<|bos|> <|eos|><|pad|><|unused_259|> <s></s><|endoftext|>",
    "",
]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Nothing may reach the network: every load below is of a local folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import (before this fixture ran)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True, raising=False)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    return build_trained_run(tmp_path_factory.mktemp("run"))


def _load(out):
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # fp32, as written
    return model, transformers.AutoTokenizer.from_pretrained(out)


def _logit_diffs(path_model: PathModel, out, tokens: torch.Tensor) -> dict[str, float]:
    """Max |logit difference| under transformers' sdpa attention and its eager one: equal logits come
    from the mapping, not from a shared attention kernel."""
    diffs = {}
    with torch.no_grad():
        ours = path_model.eval()(tokens)
        for impl in ("sdpa", "eager"):
            model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation=impl).eval()
            diffs[impl] = (ours - model(input_ids=tokens).logits).abs().max().item()
    print("max |logit diff|:", ", ".join(f"{d:.3g} ({impl})" for impl, d in diffs.items()))
    return diffs


def _check_tokenizer(hf_tok, tok) -> None:
    assert isinstance(hf_tok, transformers.PreTrainedTokenizerFast)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (
        tok.bos_id,
        tok.eos_id,
        tok.pad_id,
    )
    for text in TEXTS:
        ids = tok.encode(text)
        assert hf_tok(text)["input_ids"] == [tok.bos_id, *ids], text  # BOS first, as documents start
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids, text
        assert hf_tok.decode([tok.bos_id, *ids, tok.eos_id], skip_special_tokens=True) == tok.decode(ids)


def test_hf_export_computes_what_the_path_computes(trained_run, tmp_path, capsys):
    manifest, record_file, dirs, _ = trained_run
    out = tmp_path / "hf"
    argv = ["export", "--manifest_path", str(record_file), "--checkpoints", *dirs, "--path", "1,0"]
    assert main([*argv, "--out", str(out), "--format", "hf"]) == 0
    assert f"to {out}" in capsys.readouterr().out
    model, hf_tok = _load(out)
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.pathswarm["path"] == [1, 0]
    path_model = assemble_grid(manifest, dirs).path_model(parse_path(manifest.model, "1,0"))

    tok = ByteTokenizer()
    _check_tokenizer(hf_tok, tok)
    # the full trained window, special ids included
    tokens = torch.randint(
        0, manifest.model.vocab_size, (3, manifest.seq_len), generator=torch.Generator().manual_seed(0)
    )
    tokens[:, 0] = tok.bos_id
    assert max(_logit_diffs(path_model, out, tokens).values()) < 1e-4

    for prompt in ("count: 1, 2, ", "def add(a, b):"):
        ours = generate(
            path_model, None, tok, prompt, max_new_tokens=12, temperature=0, context_len=manifest.seq_len
        )
        enc = hf_tok(prompt, return_tensors="pt")
        theirs = model.generate(**enc, max_new_tokens=12, do_sample=False)[
            0, enc["input_ids"].shape[1] :
        ].tolist()
        if theirs and theirs[-1] == tok.eos_id:  # ours stops before EOS, transformers keeps it
            theirs = theirs[:-1]
        assert theirs == ours.tokens, prompt
        assert hf_tok.decode(theirs, skip_special_tokens=True) == ours.text


@pytest.mark.parametrize("specials", [["<s>", "</s>", "<pad>"], [], ["<|endoftext|>"]])
def test_hf_export_of_a_run_with_a_tokenizer_file(tmp_path, specials):
    """The run's tokenizer.json: BOS/EOS/PAD found in it, appended after it, or one token for two roles."""
    _train_file_tokenizer(tmp_path / "tokenizer.json", specials)
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, d_model=32, n_heads=2, d_ff=64, max_seq_len=64, private_blocks_per_path=1
    )
    manifest = RunManifest(
        name="hf-file-tok",
        model=cfg,
        seq_len=32,
        tokenizer=str(tmp_path / "tokenizer.json"),
        tokenizer_fingerprint=tok.fingerprint,
    )
    grid = GridModel(cfg, seed=7)
    # Far from the initialisation: every tensor's place matters, and pre-activations of a few units
    # make exact and tanh GELU differ (a trained tiny model's logits barely feel that difference).
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in grid.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    out = export_hf(grid, 3, tmp_path / "hf", manifest)
    model, hf_tok = _load(out)
    assert model.config.n_layer == cfg.blocks_per_path  # the grid's blocks, then the private one
    _check_tokenizer(hf_tok, tok)
    tokens = torch.randint(
        0, tok.vocab_size, (2, manifest.seq_len), generator=torch.Generator().manual_seed(1)
    )
    assert max(_logit_diffs(grid.path_model((1, 1)), out, tokens).values()) < 1e-4


def test_hf_export_refuses_a_used_folder_and_an_untrained_path(trained_run, tmp_path, capsys):
    _, record_file, dirs, _ = trained_run
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("keep me")
    argv = ["export", "--manifest_path", str(record_file), "--format", "hf"]
    assert main([*argv, "--checkpoints", *dirs, "--path", "0", "--out", str(used)]) == 2
    err = capsys.readouterr().err
    assert "exists and is not empty" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in used.iterdir()) == ["notes.txt"]
    (used / "notes.txt").unlink()  # an empty folder is filled
    assert main([*argv, "--checkpoints", *dirs, "--path", "0", "--out", str(used)]) == 0
    assert (used / "model.safetensors").is_file() and (used / "tokenizer.json").is_file()
    # the peers of paths 0, 1 and 2 hold every module of path 3 (1,1), but nobody trained it as a path
    untrained = [*argv, "--checkpoints", *dirs[:3], "--path", "1,1", "--out", str(tmp_path / "x")]
    assert main(untrained) == 2
    assert "--allow_untrained" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main([*untrained, "--allow_untrained"]) == 0 and (tmp_path / "x" / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def test_the_export_itself_does_not_import_transformers():
    code = (
        "import sys, peer.cli.model_commands, peer.offline.hf_export; "
        "assert 'transformers' not in sys.modules, 'the export imported transformers'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=Path(__file__).parents[1])
