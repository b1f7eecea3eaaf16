"""Tokenizers for the trainer: one small interface over HF `tokenizers`, SentencePiece and tiktoken.

    tok = build_tokenizer(DEBUG_TOKENIZER_PATH)      # or a Llama 2 / Llama 3 tokenizer.model
    ids = tok.encode("To be, or not to be", bos=True, eos=True)

`encode` never relies on the underlying library to add special tokens: it encodes plain
text and then adds exactly one BOS/EOS when asked. Special-token strings occurring in the
text itself are encoded as ordinary text, never as BOS/EOS. `decode` drops special tokens.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

from tokenizer._hf import HFTokenizer
from tokenizer._sentencepiece import SentencePieceTokenizer
from tokenizer._tiktoken import LLAMA3_PATTERN, LLAMA3_SPECIAL_TOKENS, TiktokenTokenizer, load_ranks

__all__ = [
    "DEBUG_TOKENIZER_PATH",
    "HFTokenizer",
    "LLAMA3_PATTERN",
    "LLAMA3_SPECIAL_TOKENS",
    "SentencePieceTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "build_tokenizer",
    "load_ranks",
    "vocabulary_digest",
]

DEBUG_TOKENIZER_PATH = Path(__file__).resolve().parent / "assets" / "debug_bpe" / "tokenizer.json"

ACCEPTED_FORMATS = (
    "a Hugging Face 'tokenizer.json' (or a folder containing one), a SentencePiece '*.model' file "
    "(Llama 2), or a tiktoken BPE ranks file (Llama 3 'tokenizer.model': lines of '<base64 token> <rank>')"
)
# First line of a tiktoken ranks file: "<base64 token> <rank>".
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} \d+\r?$")


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer."""

    vocab_size: int  # number of ids the model's embedding must cover (max id + 1)
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text`, with exactly one BOS/EOS prepended/appended when asked."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens (BOS/EOS/pad/...) are dropped."""
        ...


def build_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer, choosing the implementation from the file.

    - ``tokenizer.json`` (any ``*.json``), or a folder containing ``tokenizer.json``: HF `tokenizers`;
    - a tiktoken BPE ranks file (detected by content, e.g. Llama 3's ``tokenizer.model``): tiktoken,
      with Llama 3's split pattern and 256 special tokens;
    - any other ``*.model`` file: SentencePiece (e.g. Llama 2).
    A folder without ``tokenizer.json`` is searched for ``tokenizer.model``.

    Raises FileNotFoundError if nothing is at `path`, ValueError if the format is not recognised.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"tokenizer not found: {path}; expected {ACCEPTED_FORMATS}")
    if path.is_dir():
        candidates = [path / "tokenizer.json", path / "tokenizer.model"]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise FileNotFoundError(
                f"no tokenizer.json or tokenizer.model in folder {path}; expected {ACCEPTED_FORMATS}"
            )
        path = found
    if path.suffix == ".json":
        impl = HFTokenizer
    else:
        with open(path, "rb") as f:
            first_line = f.readline(4096).rstrip(b"\n")
        if _TIKTOKEN_LINE.match(first_line):
            impl = TiktokenTokenizer
        elif path.suffix == ".model":
            impl = SentencePieceTokenizer
        else:
            raise ValueError(f"unrecognised tokenizer file {path}; expected {ACCEPTED_FORMATS}")
    try:
        return impl(path)
    except ValueError as e:  # a file of the right kind by name/content that fails to load
        raise ValueError(f"{e}; expected {ACCEPTED_FORMATS}") from e


def vocabulary_digest(tok: Tokenizer) -> str:
    """A short hash of the token of every id (``tok.vocabulary()``: HF tokens, SentencePiece pieces, tiktoken
    bytes and special tokens), so two tokenizers whose vocabularies differ in a single id differ here. A
    tokenizer object without ``vocabulary()`` is hashed through ``decode`` of each id."""
    tokens = tok.vocabulary() if hasattr(tok, "vocabulary") else [tok.decode([i]) for i in range(tok.vocab_size)]
    h = hashlib.sha256()
    for i, token in enumerate(tokens):
        h.update(f"{i}\x00".encode() + (token if isinstance(token, bytes) else str(token).encode()) + b"\x01")
    return h.hexdigest()[:16]
