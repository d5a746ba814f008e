"""One path of a grid as a Hugging Face folder: `AutoModelForCausalLM` and `AutoTokenizer` load it with
no custom code (`pathswarm export --format hf`).

A path is exactly a GPT-2 (`GPT2LMHeadModel`): pre-norm blocks with LayerNorm (eps 1e-5), fused
causal self-attention scaled by 1/sqrt(head_dim) with biases, an exact (erf) GELU MLP with biases,
learned positions, a final LayerNorm and an LM head tied to the embedding; our blocks have no dropout.
The path's blocks (one module per level, then its private blocks) become GPT-2's layers in forward
order. Only two things change on the way: torch `Linear` weights are transposed into GPT-2's
`Conv1D` layout, and the position table is cut to the run's `seq_len`, the window every path was
trained on (the rows beyond were never trained).

The tokenizer becomes a `tokenizer.json` whose ids equal the run's: the byte tokenizer as a
byte-level BPE with no merges, a run's own tokenizer file as itself, with the BOS/EOS/PAD tokens that
`FileTokenizer` appends added at the same ids. Its post-processor puts BOS first, as the run's
documents start. This module writes files with safetensors, json and tokenizers; it never imports
transformers.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from peer.config import RunManifest
from peer.errors import ConfigError
from peer.model.grid import TRUNK, check_path, path_from_index, path_index, path_module_ids
from peer.model.tokenizer import ByteTokenizer, FileTokenizer, Tokenizer
from peer.model.transformer import BlockStack, GridModel, PathModel, Trunk
from peer.run.rebuild import check_tokenizer

# Names of the byte tokenizer's special ids 256.. in the exported vocabulary.
BYTE_SPECIAL_NAMES = {256: "<|bos|>", 257: "<|eos|>", 258: "<|pad|>"}
# Names for the ids FileTokenizer appends when a tokenizer file lacks BOS/EOS/PAD; unlikely in text,
# since a file tokenizer (like ours) matches added tokens in the text it encodes.
APPENDED_NAMES = {"bos": "<|pathswarm_bos|>", "eos": "<|pathswarm_eos|>", "pad": "<|pathswarm_pad|>"}


def check_out_dir(out: Path) -> None:
    """Refuses an --out that exists and is not an empty folder: an export never overwrites."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not empty; choose a new folder")


def gpt2_config(manifest: RunManifest, path: tuple[int, ...], tok: Tokenizer) -> dict:
    cfg = manifest.model
    return dict(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        vocab_size=cfg.vocab_size,
        n_positions=manifest.seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.blocks_per_path,
        n_head=cfg.n_heads,
        n_inner=cfg.d_ff,
        activation_function="gelu",  # F.gelu's exact erf form; "gelu_new" is the tanh approximation
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default, which our blocks use
        scale_attn_weights=True,  # scaled_dot_product_attention's default 1/sqrt(head_dim)
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        # our blocks have no dropout: fine-tuning the export behaves as training a path did
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
        use_cache=True,
        torch_dtype="float32",
        # Where the weights came from; transformers keeps unknown config fields as attributes.
        pathswarm=dict(
            run_id=manifest.run_id,
            run_name=manifest.name,
            path=list(path),
            path_index=path_index(cfg, path),
            modules=path_module_ids(cfg, path),
            model=cfg.model_dump(mode="json"),
            tokenizer_fingerprint=tok.fingerprint,
        ),
    )


def gpt2_state_dict(model: PathModel, n_positions: int) -> dict[str, torch.Tensor]:
    """The path's weights under GPT-2's names; `lm_head.weight` is left out because GPT-2 ties it."""
    trunk = cast(Trunk, model.parts[TRUNK])
    out = {
        "transformer.wte.weight": trunk.tok_emb.weight,
        "transformer.wpe.weight": trunk.pos_emb.weight[:n_positions],
        "transformer.ln_f.weight": trunk.ln_f.weight,
        "transformer.ln_f.bias": trunk.ln_f.bias,
    }
    # the grid's modules, one per level, then the private blocks: GPT-2's layers in forward order
    blocks = [b for mid in model.module_ids[1:] for b in cast(BlockStack, model.parts[mid]).blocks]
    for i, b in enumerate(blocks):
        h = f"transformer.h.{i}."
        # qkv's output is [q | k | v], each split into heads: the layout c_attn splits the same way.
        out |= {
            h + "ln_1.weight": b.ln1.weight,
            h + "ln_1.bias": b.ln1.bias,
            h + "attn.c_attn.weight": b.qkv.weight.t(),  # Conv1D stores (in, out), Linear (out, in)
            h + "attn.c_attn.bias": b.qkv.bias,
            h + "attn.c_proj.weight": b.proj.weight.t(),
            h + "attn.c_proj.bias": b.proj.bias,
            h + "ln_2.weight": b.ln2.weight,
            h + "ln_2.bias": b.ln2.bias,
            h + "mlp.c_fc.weight": b.fc.weight.t(),
            h + "mlp.c_fc.bias": b.fc.bias,
            h + "mlp.c_proj.weight": b.out.weight.t(),
            h + "mlp.c_proj.bias": b.out.bias,
        }
    return {name: t.detach().float().cpu().contiguous().clone() for name, t in out.items()}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte, the alphabet of `ByteLevel`."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json(tok: ByteTokenizer) -> tuple[HFTokenizer, dict[str, str]]:
    """Byte `b` is id `b` (BPE over ByteLevel's alphabet with no merges), then the special ids."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    hf = HFTokenizer(models.BPE(vocab, [], fuse_unk=False))
    # no regex split and no prefix space: the bytes of the text, nothing more
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    names = {i: BYTE_SPECIAL_NAMES.get(i, f"<|unused_{i}|>") for i in range(256, tok.vocab_size)}
    hf.add_special_tokens([AddedToken(names[i], special=True, normalized=False) for i in sorted(names)])
    special = {"bos": names[tok.bos_id], "eos": names[tok.eos_id], "pad": names[tok.pad_id]}
    return hf, special


def file_tokenizer_json(tok: FileTokenizer) -> tuple[HFTokenizer, dict[str, str]]:
    """The run's own tokenizer file, plus the BOS/EOS/PAD tokens FileTokenizer appended."""
    hf = HFTokenizer.from_file(str(tok.path))
    special = {}
    for role in ("bos", "eos", "pad"):
        token_id = getattr(tok, f"{role}_id")
        name = hf.id_to_token(token_id)
        if name is None:  # appended after the vocabulary, in this order: adding them gives the same ids
            name = APPENDED_NAMES[role]
            hf.add_special_tokens([AddedToken(name, special=True, normalized=False)])
        special[role] = name
    return hf, special


def tokenizer_files(tok: Tokenizer, seq_len: int) -> dict[str, str | dict]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for the run's tokenizer."""
    if isinstance(tok, ByteTokenizer):
        hf, special = byte_tokenizer_json(tok)
    elif isinstance(tok, FileTokenizer):
        hf, special = file_tokenizer_json(tok)
    else:
        raise ConfigError(f"cannot export tokenizer {tok!r} for Hugging Face")
    for role, name in special.items():
        if hf.token_to_id(name) != getattr(tok, f"{role}_id"):
            raise ConfigError(f"{role} token {name!r} does not keep id {getattr(tok, f'{role}_id')}")
    # Our documents start with BOS (peer.data.batches.encode_document); EOS is a stop, not an input.
    bos = special["bos"]
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, tok.bos_id)]
    )
    tokens_map = {f"{role}_token": name for role, name in special.items()}
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=seq_len,
        clean_up_tokenization_spaces=False,
        # The byte tokenizer reads "<|bos|>" in a text as its bytes, never as the special id;
        # a tokenizer file matches its added tokens in text, so it keeps doing so.
        split_special_tokens=isinstance(tok, ByteTokenizer),
        **tokens_map,
    )
    return {
        "tokenizer.json": hf.to_str(),
        "tokenizer_config.json": config,
        "special_tokens_map.json": tokens_map,
    }


def export_hf(
    grid: GridModel,
    path: tuple[int, ...] | int,
    out_dir: str | Path,
    manifest: RunManifest,
    artifact_folders: Sequence[Path] = (),
) -> Path:
    """Writes one path as a Hugging Face GPT-2 folder; returns it. An existing non-empty `out_dir` is
    refused; the files are written beside it first and moved in once all are complete."""
    path = path_from_index(grid.cfg, path) if isinstance(path, int) else tuple(path)
    check_path(grid.cfg, path)
    if manifest.model != grid.cfg:
        raise ValueError("the grid's model config differs from the manifest's")
    out = Path(out_dir)
    check_out_dir(out)
    tok = check_tokenizer(manifest, artifact_folders)
    files = tokenizer_files(tok, manifest.seq_len)
    files["config.json"] = gpt2_config(manifest, path, tok)
    # generate() stops at EOS and pads with PAD, and stops at the context: the position table has
    # n_positions rows, and a longer sequence fails inside the model with an IndexError. (A caller's
    # max_new_tokens takes precedence, with a warning from transformers that both are set.)
    files["generation_config.json"] = dict(
        bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, max_length=manifest.seq_len
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    # a hidden sibling, so a failure half-way leaves no half-written model where --out points
    staging = out.parent / f".{out.name or 'export'}.{secrets.token_hex(4)}.partial"
    staging.mkdir()
    try:
        tensors = gpt2_state_dict(grid.path_model(path), manifest.seq_len)
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        for name, content in files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=1) + "\n"
            (staging / name).write_text(text, encoding="utf-8")
        if out.exists():  # an empty folder (checked above), perhaps the working directory: fill it
            for file in staging.iterdir():
                os.replace(file, out / file.name)
            staging.rmdir()
        else:
            os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
