"""Hugging Face `tokenizers` implementation (tokenizer.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from tokenizer._common import add_specials

# Names tried, in order, when tokenizer_config.json does not name the special tokens.
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")
EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>")
PAD_CANDIDATES = ("<|pad|>", "<pad>", "<|finetune_right_pad_id|>")


class HFTokenizer:
    """A `tokenizer.json` loaded with HF `tokenizers`.

    BOS/EOS/pad come from a `tokenizer_config.json` next to the file if it names them,
    else from the usual token names (`<|begin_of_text|>`/`<s>`/`<bos>`, ...).
    """

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError as e:
            raise ImportError("loading a tokenizer.json needs the 'tokenizers' package: pip install tokenizers") from e
        self.path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"could not load {self.path} as a Hugging Face tokenizer.json: {e}") from e
        # Special-token strings inside documents are data: encode them as plain text.
        self._tok.encode_special_tokens = True
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        names = self._config_token_names()
        self.bos_id = self._find_id(names.get("bos_token"), BOS_CANDIDATES)
        self.eos_id = self._find_id(names.get("eos_token"), EOS_CANDIDATES)
        self.pad_id = self._find_id(names.get("pad_token"), PAD_CANDIDATES)

    def _config_token_names(self) -> dict[str, str]:
        config = self.path.parent / "tokenizer_config.json"
        if not config.is_file():
            return {}
        cfg = json.loads(config.read_text(encoding="utf-8"))
        names = {}
        for key in ("bos_token", "eos_token", "pad_token"):
            value = cfg.get(key)
            if isinstance(value, dict):  # AddedToken serialised as {"content": ..., ...}
                value = value.get("content")
            if isinstance(value, str):
                names[key] = value
        return names

    def _find_id(self, configured: str | None, candidates: Sequence[str]) -> int | None:
        for token in ((configured,) if configured else ()) + tuple(candidates):
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text` (no automatic specials), plus one BOS/EOS if asked."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return add_specials(ids, self, bos, eos)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens dropped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)

