"""tiktoken implementation for Llama 3 style BPE ranks files (Llama 3's tokenizer.model)."""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path
from typing import Sequence

from tokenizer._common import add_specials

# Llama 3's pre-tokenizer split pattern.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3 special tokens, which get ids n_base, n_base + 1, ... after the BPE ranks. Names as in
# Meta's llama-models (Llama 3.1+); the first Llama 3 release called some of these slots
# <|reserved_special_token_N|>, but the ids of BOS/EOS/header/eot tokens are the same.
_NAMED_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
]
NUM_RESERVED_SPECIAL_TOKENS = 256
LLAMA3_SPECIAL_TOKENS = _NAMED_SPECIALS + [
    f"<|reserved_special_token_{i}|>" for i in range(2, 2 + NUM_RESERVED_SPECIAL_TOKENS - len(_NAMED_SPECIALS))
]

# tiktoken's regex engine overflows its backtracking stack on very long runs of
# whitespace (or of non-whitespace); such runs are cut into pieces of this many characters.
MAX_RUN_CHARS = 25_000
# Matches a maximal run of >= MAX_RUN_CHARS; the lookbehinds keep the scan linear.
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{MAX_RUN_CHARS},}}|(?<!\s)\s{{{MAX_RUN_CHARS},}}")


def split_long_runs(text: str) -> list[str]:
    """Cut `text` so that no piece holds a whitespace/non-whitespace run longer than MAX_RUN_CHARS."""
    if len(text) <= MAX_RUN_CHARS:
        return [text]
    pieces, start = [], 0
    for m in _LONG_RUN.finditer(text):
        for cut in range(m.start() + MAX_RUN_CHARS, m.end(), MAX_RUN_CHARS):
            pieces.append(text[start:cut])
            start = cut
    pieces.append(text[start:])
    return pieces


def load_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken ranks file (lines of "<base64 token> <rank>").

    Parsed here rather than with tiktoken.load.load_tiktoken_bpe, which caches files by
    path in a temp folder and can return stale ranks when a file at that path changes.
    """
    ranks = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
                except ValueError as e:
                    raise ValueError(f"{path}:{lineno}: not a tiktoken ranks line ('<base64 token> <rank>')") from e
    return ranks


class TiktokenTokenizer:
    """A tiktoken BPE ranks file with Llama 3's split pattern and 256 special tokens."""

    def __init__(self, path: str | os.PathLike):
        try:
            import tiktoken
        except ImportError as e:
            raise ImportError(
                "loading a Llama 3 (tiktoken) tokenizer.model needs the 'tiktoken' package: pip install tiktoken"
            ) from e
        self.path = Path(path)
        ranks = load_ranks(self.path)
        self.n_base = len(ranks)
        if sorted(ranks.values()) != list(range(self.n_base)):
            raise ValueError(f"{self.path}: tiktoken ranks must be 0..{self.n_base - 1} without gaps")
        self.special_tokens = {token: self.n_base + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self._enc = tiktoken.Encoding(
            name=self.path.name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self.vocab_size = self.n_base + len(self.special_tokens)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.pad_id = self.special_tokens["<|finetune_right_pad_id|>"]

    def vocabulary(self) -> list[bytes | str]:
        """The bytes of every ranked token, then the special tokens by id."""
        specials = sorted(self.special_tokens.items(), key=lambda kv: kv[1])
        return [self._enc.decode_single_token_bytes(i) for i in range(self.n_base)] + [t for t, _ in specials]

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text` (special-token strings in it are plain text), plus one BOS/EOS if asked."""
        ids = [
            i
            for piece in split_long_runs(text)
            for i in self._enc.encode(piece, allowed_special=set(), disallowed_special=())
        ]
        return add_specials(ids, self, bos, eos)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens dropped."""
        return self._enc.decode([i for i in ids if i < self.n_base])
