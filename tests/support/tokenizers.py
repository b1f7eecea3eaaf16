"""Tokenizer folders for tests: a Hugging Face folder as torchtitan users have one."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tests.support.launch import ROOT

TORCHTITAN_ASSETS = ROOT / "tests" / "assets" / "torchtitan"


@functools.lru_cache(maxsize=None)
def _trained() -> tuple[str, int]:
    """(tokenizer.json text, its vocabulary size before the special tokens): trained once per process (about a
    CPU-second each time) and written out by every call below."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (ROOT / "trainer" / "data" / "sample" / "shakespeare_train.jsonl").read_text().splitlines()
    tok.train_from_iterator((json.loads(line)["text"] for line in text),
                            trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    n = tok.get_vocab_size()
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", n)])
    return tok.to_str(pretty=True), n


def make_tokenizer_folder(folder: Path) -> Path:
    """A byte-level BPE whose tokenizer.json knows no special token (its post-processor still adds a BOS);
    BOS and EOS are declared only in tokenizer_config.json, as in many Hugging Face folders."""
    folder.mkdir(parents=True, exist_ok=True)
    text, n = _trained()
    (folder / "tokenizer.json").write_text(text)
    special = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "add_bos_token": True, "add_eos_token": False,
        "added_tokens_decoder": {str(n): {"content": "<|begin_of_text|>", **special},
                                 str(n + 1): {"content": "<|end_of_text|>", **special}},
    }))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return folder
