"""Helpers shared by the tokenizer implementations."""

from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: Path) -> dict:
    """A JSON object file such as tokenizer_config.json; {} when the file is absent or holds no object."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


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
