"""Tokenizers a peer can train with: raw UTF-8 bytes, or a Hugging Face `tokenizer.json` file.

Every peer of a run must cut text into the same ids, so each tokenizer carries a `fingerprint`
(a sha256 hex digest) that goes into the run manifest and is compared when peers meet.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol, runtime_checkable

import tokenizers

from peer.errors import ConfigError


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the model need of a tokenizer; `fingerprint` identifies its ids."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; BOS, EOS and PAD follow. 260 matches ModelConfig's default vocab
    (id 259 is spare, which keeps the vocabulary a multiple of 4)."""

    vocab_size = 260
    bos_id = 256
    eos_id = 257
    pad_id = 258
    # Changing the id layout must change the fingerprint, so the layout is what gets hashed.
    fingerprint = hashlib.sha256(
        b"pathswarm-bytes-v1:bytes=0..255,bos=256,eos=257,pad=258,vocab=260"
    ).hexdigest()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # Special ids have no bytes; a window may also cut a multi-byte character, hence "replace".
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# Spellings used by common tokenizer families, most specific first.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "<|endoftext|>", "[CLS]")
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[EOS]", "[SEP]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")


class FileTokenizer:
    """A `tokenizers` JSON file. Missing BOS/EOS/PAD tokens get ids appended after the vocabulary."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read tokenizer file {self.path}: {e.strerror or e}") from e
        try:
            # Parse the very bytes we hash, so the fingerprint always describes what was loaded.
            self._tok = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers raises plain Exception subclasses from Rust
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"{self.path} is not a valid tokenizer.json file: {reason}") from e
        self.fingerprint = hashlib.sha256(data).hexdigest()

        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._base_size = self._tok.get_vocab_size(with_added_tokens=True)
        next_id = self._base_size

        def pick(names: tuple[str, ...]) -> int:
            nonlocal next_id
            for name in names:
                if name in vocab:
                    return vocab[name]
            next_id += 1
            return next_id - 1

        self.bos_id = pick(_BOS_NAMES)
        self.eos_id = pick(_EOS_NAMES)
        self.pad_id = pick(_PAD_NAMES)
        self.vocab_size = next_id
        self._special = {self.bos_id, self.eos_id, self.pad_id}

    def encode(self, text: str) -> list[int]:
        # BOS/EOS are added by the data pipeline, not by the tokenizer's post-processor.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        kept = [i for i in ids if i < self._base_size and i not in self._special]
        return self._tok.decode(kept, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"FileTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(spec: str) -> Tokenizer:
    """ "bytes" gives the byte tokenizer; anything else is a tokenizer.json path (or its folder)."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"tokenizer {spec!r}: expected 'bytes' or the path of a tokenizer.json file, found no file"
        )
    return FileTokenizer(path)
