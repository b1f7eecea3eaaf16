"""Test data: a fast byte tokenizer, synthetic corpora (also in the layout of a local C4 copy), configs."""

from __future__ import annotations

import gzip
import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Sequence

from trainer.config import load_config, validate


class ByteTokenizer:
    """Token = UTF-8 byte (ids 0-255); BOS 256, EOS 257, pad 258. With add_bos / add_eos it adds them on
    every encode, like tokenizers whose post-processor inserts specials (the loader must remove them)."""

    vocab_size = 259
    bos_id, eos_id, pad_id = 256, 257, 258

    def __init__(self, add_bos: bool = False, add_eos: bool = False):
        self.add_bos, self.add_eos = add_bos, add_eos

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if bos or self.add_bos:
            ids = [self.bos_id] + ids
        if eos or self.add_eos:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def synthetic_texts(n: int, *, seed: int = 0, min_len: int = 5, max_len: int = 120, prefix: str = "") -> list[str]:
    """n distinct random texts (lowercase words) of min_len..max_len characters."""
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        length = rng.randint(min_len, max_len)
        words = [prefix + f"d{i}"]
        while sum(len(w) + 1 for w in words) < length:
            words.append("".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 7))))
        texts.append(" ".join(words)[:length])
    return texts


def write_jsonl(path: str | Path, texts: Iterable[str]) -> Path:
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, "text": t}) + "\n")
    return path


def make_config(**overrides):
    """A JobConfig from {"training.seq_len": 32, ...} (dots as in the command line), no environment."""
    argv: list[str] = []
    for key, value in overrides.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, (list, tuple)):
            value = json.dumps(list(value))
        argv += [f"--{key}", str(value)]
    config = load_config(argv, env={})
    validate(config)
    return config


def token_map(batches: Iterable[dict]) -> dict[int, dict[int, int]]:
    """{document id: {position: token}} from batches made with data.debug_doc_ids."""
    docs: dict[int, dict[int, int]] = defaultdict(dict)
    for b in batches:
        tokens = b["input"].new_empty((b["input"].shape[0], b["input"].shape[1] + 1))
        tokens[:, :-1], tokens[:, -1] = b["input"], b["labels"][:, -1]
        for row_t, row_d, row_p in zip(tokens.tolist(), b["doc_ids"].tolist(), b["doc_positions"].tolist()):
            for t, d, p in zip(row_t, row_d, row_p):
                docs[d][p] = t
    return docs


def token_pairs(batches: Iterable[dict]) -> list[tuple[int, int]]:
    """(document id, position) of every token of every window, in order (with repetitions)."""
    out = []
    for b in batches:
        for row_d, row_p in zip(b["doc_ids"].tolist(), b["doc_positions"].tolist()):
            out.extend(zip(row_d, row_p))
    return out


WORDS = ("the quick brown fox jumps over the lazy dog while seven wizards quietly hum old songs about rivers "
         "mountains and the sea").split()


def make_c4(folder: Path, docs: int = 400, gz: bool = True) -> Path:
    """allenai/c4's layout: en/c4-{train,validation}.NNNNN-of-NNNNN.json.gz, rows {text, timestamp, url}."""
    rng = random.Random(0)
    (folder / "en").mkdir(parents=True, exist_ok=True)
    for split in ("train", "validation"):
        name = folder / "en" / f"c4-{split}.00000-of-00001.json{'.gz' if gz else ''}"
        with (gzip.open if gz else open)(name, "wt", encoding="utf-8") as f:
            for i in range(docs):
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 300)))
                f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z", "url": f"https://e.x/{i}"}) + "\n")
    return folder
