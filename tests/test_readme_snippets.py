"""The Python snippets of the docs run as written: docs/researcher.md's "A path as a Hugging Face
model" loads an exported path with plain transformers and generates, for prompts up to the model's
context, stopping at that context with a message (it used to index past the position table for any
prompt over 24 bytes). In-process and fast: the export is a seeded grid's, nothing is trained."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from peer.config import RunManifest
from peer.model.grid import ModelConfig
from peer.model.transformer import GridModel
from peer.offline.hf_export import export_hf

ROOT = Path(__file__).resolve().parents[1]
HF_HEADING = "## A path as a Hugging Face model"
#: the folder and the prompt the snippet names
SNIPPET_FOLDER, SNIPPET_PROMPT = '"path0-hf"', '"def add(a, b):"'


def python_block(page: Path, heading: str) -> str:
    """The first ```python block under `heading` of a markdown page."""
    text = page.read_text()
    section = text[text.index(heading) :]
    block = section[section.index("```python\n") + len("```python\n") :]
    return block[: block.index("```")]


def hf_snippet(folder: Path, prompt: str) -> str:
    """The researcher page's transformers snippet with its folder and prompt replaced, as code."""
    code = python_block(ROOT / "docs" / "researcher.md", HF_HEADING)
    assert SNIPPET_FOLDER in code and SNIPPET_PROMPT in code, code
    return code.replace(SNIPPET_FOLDER, repr(str(folder))).replace(SNIPPET_PROMPT, repr(prompt))


def run_hf_snippet(folder: Path, prompt: str) -> str:
    """Runs the snippet here, in this process; returns what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(hf_snippet(folder, prompt), "docs/researcher.md", "exec"), {})  # noqa: S102
    return printed.getvalue()


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True, raising=False)


@pytest.mark.parametrize("prompt_bytes", [25, 40, 62])
def test_the_transformers_snippet_generates_to_the_context_for_prompts_up_to_it(
    tmp_path, offline, prompt_bytes
):
    pytest.importorskip("transformers", reason="transformers is a dev dependency (pip install -e '.[dev]')")
    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=64, max_seq_len=65)  # trains windows of seq_len + 1
    manifest = RunManifest(name="snippet", model=cfg, seq_len=64)  # n_positions 64, as the tiny preset's
    out = export_hf(GridModel(cfg, seed=1), 0, tmp_path / "path0-hf", manifest)
    prompt = ("count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17")[:prompt_bytes]
    assert len(prompt) == prompt_bytes
    printed = run_hf_snippet(out, prompt)
    assert printed.startswith(prompt), printed
    # BOS + the prompt + what it generated fill the 64 positions; the snippet says it stopped there
    assert re.search(r"^\[stopped at the model's context: 64 tokens", printed, re.M), printed
