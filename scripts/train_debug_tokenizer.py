#!/usr/bin/env python
"""Train the small byte-level BPE debug tokenizer on the bundled Shakespeare corpus.

    python scripts/train_debug_tokenizer.py

Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json to
tokenizer/assets/debug_bpe/. The tokenizer.json has no post-processor, so it never
adds BOS/EOS by itself (the trainer's wrapper adds them explicitly). Training is
deterministic: same corpus and settings give a byte-identical tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "trainer" / "data" / "sample" / "shakespeare_train.jsonl"
OUT_DIR = ROOT / "tokenizer" / "assets" / "debug_bpe"
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
VOCAB_SIZE = 2048  # including the special tokens


def read_texts(path: Path) -> list[str]:
    """Return the "text" fields of a JSON-lines corpus, in file order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def train(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE tokenizer; the special tokens get ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def write_hf_configs(out_dir: Path, tok: Tokenizer) -> None:
    """Write tokenizer_config.json / special_tokens_map.json for transformers.PreTrainedTokenizerFast."""
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True,
        }
        for t in (BOS, EOS, PAD)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
    }
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (out_dir / name).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()

    texts = read_texts(args.corpus)
    tok = train(texts, args.vocab_size)
    assert tok.get_vocab_size() == args.vocab_size, tok.get_vocab_size()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out_dir / "tokenizer.json"))
    write_hf_configs(args.out_dir, tok)

    n_tokens = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    n_chars = sum(len(t) for t in texts)
    print(f"saved {args.out_dir}: vocab {tok.get_vocab_size()}, "
          f"{n_tokens} tokens over {len(texts)} documents ({n_chars / n_tokens:.2f} chars/token)")


if __name__ == "__main__":
    main()
