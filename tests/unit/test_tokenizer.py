"""Tests for the tokenizer package: debug BPE, SentencePiece and tiktoken back ends."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path

import pytest

from tokenizer import DEBUG_TOKENIZER_PATH, LLAMA3_SPECIAL_TOKENS, Tokenizer, build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
VAL_CORPUS = ROOT / "trainer" / "data" / "sample" / "shakespeare_val.jsonl"

TEXTS = [
    "To be, or not to be: that is the question.",
    "HAMLET.\nWhether 'tis nobler in the mind to suffer\n  The slings and arrows of outrageous fortune,\n",
    " leading space, double  spaces, tabs\tand trailing newlines\n\n",
    "Numbers 1234567 and symbols: {}[]()<>!?@#$%^&*_-+=~`|\\/",
    "",
]


def corpus_sample(n_chars: int) -> str:
    with open(VAL_CORPUS, encoding="utf-8") as f:
        return "\n".join(json.loads(line)["text"] for line in f)[:n_chars]


def check_separators(tok: Tokenizer, text: str) -> None:
    """BOS/EOS appear exactly where asked, once, and never come from the text itself."""
    plain = tok.encode(text)
    assert tok.bos_id not in plain and tok.eos_id not in plain
    for bos in (False, True):
        for eos in (False, True):
            ids = tok.encode(text, bos=bos, eos=eos)
            assert ids == [tok.bos_id] * bos + plain + [tok.eos_id] * eos
            assert ids.count(tok.bos_id) == bos and ids.count(tok.eos_id) == eos
            assert tok.decode(ids) == text  # special tokens are dropped by decode


# --- debug tokenizer (HF tokenizers) ---------------------------------------------------


@pytest.fixture(scope="module")
def debug_tok() -> Tokenizer:
    return build_tokenizer(DEBUG_TOKENIZER_PATH)


def test_debug_tokenizer_ids(debug_tok):
    assert isinstance(debug_tok, Tokenizer)
    assert debug_tok.vocab_size == 2048
    assert (debug_tok.bos_id, debug_tok.eos_id, debug_tok.pad_id) == (0, 1, 2)


@pytest.mark.parametrize("text", TEXTS)
def test_debug_tokenizer_round_trip(debug_tok, text):
    ids = debug_tok.encode(text)
    assert all(0 <= i < debug_tok.vocab_size for i in ids)
    assert debug_tok.decode(ids) == text


def test_debug_tokenizer_round_trips_corpus_and_compresses(debug_tok):
    text = corpus_sample(20_000)
    ids = debug_tok.encode(text)
    assert debug_tok.decode(ids) == text
    assert len(text) / len(ids) > 2.0  # a trained BPE, not bytes


@pytest.mark.parametrize("text", TEXTS[:2])
def test_debug_tokenizer_separators(debug_tok, text):
    check_separators(debug_tok, text)


def test_special_token_strings_in_text_are_plain_text(debug_tok):
    text = "<|begin_of_text|>Exeunt.<|end_of_text|><|pad|>"
    ids = debug_tok.encode(text, bos=True, eos=True)
    assert ids.count(debug_tok.bos_id) == 1 and ids.count(debug_tok.eos_id) == 1
    assert debug_tok.pad_id not in ids
    assert debug_tok.decode(ids) == text


def test_debug_tokenizer_json_adds_no_specials_itself():
    from tokenizers import Tokenizer as HFRaw

    assert json.loads(DEBUG_TOKENIZER_PATH.read_text())["post_processor"] is None
    raw = HFRaw.from_file(str(DEBUG_TOKENIZER_PATH))
    assert raw.encode("hello", add_special_tokens=True).ids == raw.encode("hello", add_special_tokens=False).ids


def test_debug_tokenizer_hf_configs():
    folder = DEBUG_TOKENIZER_PATH.parent
    expected = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"}
    assert json.loads((folder / "special_tokens_map.json").read_text()) == expected
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert {k: config[k] for k in expected} == expected
    assert {int(i): t["content"] for i, t in config["added_tokens_decoder"].items()} == {
        0: "<|begin_of_text|>", 1: "<|end_of_text|>", 2: "<|pad|>"
    }


def test_debug_tokenizer_loads_in_transformers():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(DEBUG_TOKENIZER_PATH.parent))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    ours = build_tokenizer(DEBUG_TOKENIZER_PATH)
    assert hf("Good night, sweet prince")["input_ids"] == ours.encode("Good night, sweet prince")


def test_folder_path_and_config_precedence(tmp_path):
    # A folder resolves to its tokenizer.json.
    assert build_tokenizer(DEBUG_TOKENIZER_PATH.parent).vocab_size == 2048
    # Without tokenizer_config.json the specials are found by name...
    shutil.copy(DEBUG_TOKENIZER_PATH, tmp_path / "tokenizer.json")
    tok = build_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    # ...and a tokenizer_config.json next to it takes precedence.
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|pad|>"}, "eos_token": "<|end_of_text|>", "pad_token": None})
    )
    tok = build_tokenizer(tmp_path / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 1, 2)


# --- SentencePiece (Llama 2 style) ----------------------------------------------------


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_sample(8_000).splitlines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,  # as Llama 2: unseen characters become byte tokens
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


def test_sentencepiece(sp_model):
    tok = build_tokenizer(sp_model)
    assert type(tok).__name__ == "SentencePieceTokenizer" and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 400
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, None)  # SentencePiece defaults, as Llama 2
    for text in TEXTS[:2] + ["Unseen: Zoë, ß, 東京"]:
        assert tok.decode(tok.encode(text)) == text
        check_separators(tok, text)
    assert build_tokenizer(sp_model.parent).vocab_size == 400  # via the folder's tokenizer.model


# --- tiktoken (Llama 3 style) ---------------------------------------------------------

MERGES = [b"th", b"the", b" t", b" the", b"er", b"in", b"  ", b"    "]


@pytest.fixture(scope="module")
def tiktoken_model(tmp_path_factory) -> Path:
    pytest.importorskip("tiktoken")
    tokens = [bytes([b]) for b in range(256)] + MERGES
    # Named like Llama 3's file: it must be recognised by content, not by name.
    path = tmp_path_factory.mktemp("tiktoken") / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


def test_tiktoken(tiktoken_model):
    tok = build_tokenizer(tiktoken_model)
    n_base = 256 + len(MERGES)
    assert type(tok).__name__ == "TiktokenTokenizer" and isinstance(tok, Tokenizer)
    assert len(LLAMA3_SPECIAL_TOKENS) == 256
    assert tok.vocab_size == n_base + 256
    assert (tok.bos_id, tok.eos_id) == (n_base, n_base + 1)
    assert tok.pad_id == n_base + LLAMA3_SPECIAL_TOKENS.index("<|finetune_right_pad_id|>")
    assert tok.encode(" the") == [256 + MERGES.index(b" the")]  # merges are applied
    for text in TEXTS + ["Unicode: Zoë, 東京", "<|begin_of_text|>literal<|eot_id|>"]:
        assert tok.decode(tok.encode(text)) == text
        check_separators(tok, text)
    assert build_tokenizer(tiktoken_model.parent).vocab_size == n_base + 256


def test_tiktoken_long_whitespace_run(tiktoken_model):
    # tiktoken's regex alone fails with "Max stack size exceeded" on this input.
    tok = build_tokenizer(tiktoken_model)
    text = "a" + " " * 1_000_000 + "b"
    assert tok.decode(tok.encode(text)) == text


# --- errors ---------------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match="nope.*tokenizer.json"):
        build_tokenizer(missing)


def test_folder_without_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer.model"):
        build_tokenizer(tmp_path)


@pytest.mark.parametrize(
    "name, content",
    [
        ("vocab.txt", b"hello world\n"),  # unknown kind of file
        ("tokenizer.model", b"\x00\x01 not a protobuf"),  # neither SentencePiece nor tiktoken
        ("tokenizer.json", b"{\"not\": \"a tokenizer\"}"),
        ("ranks.tiktoken", b"IQ== 0\nnot base64 at all\n"),  # starts like tiktoken, then breaks
    ],
)
def test_unrecognised_or_broken_files(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match="expected a Hugging Face 'tokenizer.json'") as err:
        build_tokenizer(path)
    assert str(path) in str(err.value)


def test_missing_bos_is_a_clear_error(tmp_path):
    renamed = DEBUG_TOKENIZER_PATH.read_text().replace("<|begin_of_text|>", "<|something_else|>")
    (tmp_path / "tokenizer.json").write_text(renamed)
    tok = build_tokenizer(tmp_path)
    assert tok.bos_id is None
    assert tok.encode("hi")  # plain encoding still works
    with pytest.raises(ValueError, match="no BOS token"):
        tok.encode("hi", bos=True)
