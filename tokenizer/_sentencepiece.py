"""SentencePiece implementation (e.g. Llama 2's tokenizer.model)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from tokenizer._common import add_specials


class SentencePieceTokenizer:
    """A SentencePiece `*.model` file; BOS/EOS/pad are the model's own control ids."""

    def __init__(self, path: str | os.PathLike):
        try:
            import sentencepiece
        except ImportError as e:
            raise ImportError(
                "loading a SentencePiece tokenizer.model needs the 'sentencepiece' package: pip install sentencepiece"
            ) from e
        self.path = Path(path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as e:
            raise ValueError(f"could not load {self.path} as a SentencePiece model: {e}") from e
        self.vocab_size = self._sp.get_piece_size()
        # SentencePiece uses -1 for "no such token".
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else None

    def vocabulary(self) -> list[str]:
        """The piece of every id."""
        return [self._sp.id_to_piece(i) for i in range(self.vocab_size)]

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text` (no automatic specials), plus one BOS/EOS if asked."""
        ids = self._sp.encode(text, out_type=int, add_bos=False, add_eos=False)
        return add_specials(ids, self, bos, eos)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; control tokens (BOS/EOS/pad) decode to nothing."""
        return self._sp.decode(list(ids))
