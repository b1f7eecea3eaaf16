"""Helpers shared by the tokenizer implementations."""

from __future__ import annotations


def add_specials(ids: list[int], tok, bos: bool, eos: bool) -> list[int]:
    """Prepend `tok.bos_id` / append `tok.eos_id` once each, as asked; fail clearly if missing."""
    if bos:
        if tok.bos_id is None:
            raise ValueError(f"tokenizer {tok.path} has no BOS token")
        ids = [tok.bos_id, *ids]
    if eos:
        if tok.eos_id is None:
            raise ValueError(f"tokenizer {tok.path} has no EOS token")
        ids = [*ids, tok.eos_id]
    return ids
