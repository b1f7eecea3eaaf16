"""Hugging Face `tokenizers` implementation (tokenizer.json)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from tokenizer._common import add_specials, read_json_object

# Names tried, in order, when tokenizer_config.json does not name the special tokens.
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")
EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")  # the last: GPT-2's end-of-text
PAD_CANDIDATES = ("<|pad|>", "<pad>", "<|finetune_right_pad_id|>")


class HFTokenizer:
    """A `tokenizer.json` loaded with HF `tokenizers`.

    BOS/EOS/pad come from a `tokenizer_config.json` next to the file if it names them,
    else from the usual token names (`<|begin_of_text|>`/`<s>`/`<bos>`, ...). As torchtitan does, the
    special tokens that file declares (its bos/eos/pad/unk/... keys and `added_tokens_decoder`) are added
    to the tokenizer when `tokenizer.json` lacks them, so a folder whose BOS/EOS exist only there works.
    A post-processor in `tokenizer.json` never adds tokens: `encode` adds exactly the BOS/EOS asked for.
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
        config = self._config()
        self._add_declared_specials(config)
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        names = self._config_token_names(config)
        self.bos_id = self._find_id(names.get("bos_token"), BOS_CANDIDATES)
        self.eos_id = self._find_id(names.get("eos_token"), EOS_CANDIDATES)
        self.pad_id = self._find_id(names.get("pad_token"), PAD_CANDIDATES)

    def vocabulary(self) -> list[str | None]:
        """The token of every id (None where no token has that id), added tokens included."""
        tokens: list[str | None] = [None] * self.vocab_size
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            tokens[i] = token
        return tokens

    def _config(self) -> dict:
        return read_json_object(self.path.parent / "tokenizer_config.json")

    def _add_declared_specials(self, cfg: dict) -> None:
        """Add the special tokens tokenizer_config.json declares (ids: the tokenizer's next free ones when
        tokenizer.json lacks them, as with torchtitan's loader)."""
        from tokenizers import AddedToken

        declared = []
        for key in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token"):
            value = cfg.get(key)
            declared.append(value if isinstance(value, dict) else {"content": value})
        declared += [v for v in (cfg.get("added_tokens_decoder") or {}).values() if isinstance(v, dict)]
        tokens = [AddedToken(d["content"], single_word=d.get("single_word", False), lstrip=d.get("lstrip", False),
                             rstrip=d.get("rstrip", False), normalized=d.get("normalized", False), special=True)
                  for d in declared if isinstance(d.get("content"), str) and self._tok.token_to_id(d["content"]) is None]
        if tokens:
            self._tok.add_special_tokens(tokens)

    def _config_token_names(self, cfg: dict) -> dict[str, str]:
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

