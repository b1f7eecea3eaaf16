"""Hugging Face export/import (torchtitan_ext.hf) in-process: key mapping, RoPE permutation, logits parity
with transformers.LlamaForCausalLM, dtype/sharding, tokenizer files, import round trip, checkpoint lookup."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from torchtitan_ext.hf import (
    hf_config_to_args,
    hf_to_native_key,
    load_hf_into,
    load_hf_state_dict,
    main as export_main,
    native_to_hf_key,
    permute_for_hf,
    unpermute_from_hf,
    write_hf_folder,
)
from torchtitan_ext.native import CheckpointNotFound, find_checkpoint, load_native, save_native_checkpoint
from trainer.config import load_config
from trainer.models.llama.args import LlamaModelArgs, RopeScaling
from trainer.models.llama.model import Transformer
from trainer.models.config import resolve_model_args
from trainer.data.tokenizer import load_tokenizer
from tests.support.models import fast_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

SEQ = 48


def debug_run(tmp_path, seed: int = 0):
    """A debug_gqa 'run': config.toml + checkpoint/step-2 (random weights), like a real dump folder."""
    config = load_config(["--model.flavor", "debug_gqa", "--training.seq_len", "64"], env={})
    tok = load_tokenizer(config)
    model = fast_model(resolve_model_args(config, tok.vocab_size), seed)
    dump = tmp_path / "run"
    save_native_checkpoint(model.state_dict(), dump, step=2, config=config)
    return dump, model, tok


def hf_logits(folder, tokens, dtype=torch.float32):
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model(tokens).logits


def test_rope_permutation_is_the_documented_reordering_and_invertible():
    n_heads, head_dim, dim = 3, 8, 5
    w = torch.randn(n_heads * head_dim, dim)
    p = permute_for_hf(w, n_heads)
    for h in range(n_heads):
        for i in range(head_dim // 2):
            for j in range(2):  # interleaved row 2i+j -> rotate-half row j*head_dim/2 + i
                assert torch.equal(p[h * head_dim + j * head_dim // 2 + i], w[h * head_dim + 2 * i + j])
    assert torch.equal(unpermute_from_hf(p, n_heads), w)


def test_key_mapping_round_trips():
    names = ["tok_embeddings.weight", "norm.weight", "output.weight"] + [
        f"layers.7.{k}" for k in ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                                  "attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
                                  "feed_forward.w3.weight", "attention_norm.weight", "ffn_norm.weight")]
    for name in names:
        assert hf_to_native_key(native_to_hf_key(name)) == name
    assert native_to_hf_key("layers.7.feed_forward.w1.weight") == "model.layers.7.mlp.gate_proj.weight"
    assert native_to_hf_key("layers.7.feed_forward.w3.weight") == "model.layers.7.mlp.up_proj.weight"
    with pytest.raises(KeyError):
        native_to_hf_key("layers.0.attention.bias")


def test_export_debug_checkpoint_matches_transformers_logits(tmp_path):
    dump, model, tok = debug_run(tmp_path)
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(dump), "--output", str(out), "--dtype", "fp32"]) == 0
    files = sorted(p.name for p in out.iterdir())
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert name in files
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 4
    assert cfg["torch_dtype"] == "float32" and cfg["tie_word_embeddings"] is False and cfg["rope_scaling"] is None
    assert cfg["max_position_embeddings"] == 2048  # the flavor's context, not the training seq_len
    tokens = torch.randint(0, tok.vocab_size, (2, SEQ))
    with torch.no_grad():
        ours = model(tokens)
    assert (hf_logits(out, tokens) - ours).abs().max().item() <= 1e-4
    # The exported tokenizer encodes like ours, with the BOS training put before every document.
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "First Citizen: Before we proceed any further, hear me speak."
    assert hf_tok.encode(text) == tok.encode(text, bos=True)


@pytest.mark.parametrize("tied", [False, True])
def test_export_rope_scaling_tied_and_odd_ffn_match_transformers(tmp_path, tied):
    """Llama 3.1 rope scaling -> rope_scaling {"rope_type": "llama3"}; tied embeddings -> no lm_head."""
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    args = LlamaModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, multiple_of=48,
                          ffn_dim_multiplier=1.3, rope_theta=500000.0, rope_scaling=scaling, max_seq_len=256,
                          tie_word_embeddings=tied)
    model = fast_model(args, seed=1)
    out = write_hf_folder(model.state_dict(), args, tmp_path / "hf", dtype="fp32", max_position_embeddings=256)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    assert cfg["tie_word_embeddings"] is tied
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    tokens = torch.randint(0, 96, (2, 200))  # past original_max_position_embeddings: scaling matters
    with torch.no_grad():
        ours = model(tokens)
    assert (hf_logits(out, tokens) - ours).abs().max().item() <= 1e-4
    # Import: config.json -> the same args (FFN size and scaling preserved) and exactly the same weights.
    back = hf_config_to_args(cfg)
    assert back.ffn_hidden_dim == args.ffn_hidden_dim and back.rope_scaling == scaling
    assert back.tie_word_embeddings is tied
    fresh = fast_model(args, seed=2)
    load_hf_into(fresh, out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_export_bf16_sharded_and_import_round_trip(tmp_path):
    dump, model, _ = debug_run(tmp_path)
    out = tmp_path / "hf_bf16"
    assert export_main(["--checkpoint", str(dump / "checkpoint"), "--output", str(out), "--dtype", "bf16",
                        "--max_shard_size", "4MB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    sd, _ = load_hf_state_dict(out)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    for name, tensor in model.state_dict().items():
        assert torch.equal(sd[name], tensor.to(torch.bfloat16)), name  # permutation undone exactly
    # Refuses to overwrite unless asked.
    assert export_main(["--checkpoint", str(dump), "--output", str(out)]) == 2
    assert export_main(["--checkpoint", str(dump), "--output", str(out), "--overwrite", "--dtype", "fp32"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert len(set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values())) == 1
    assert len(list(out.glob("model-*.safetensors"))) == 1  # stale shards removed


def test_find_checkpoint_picks_latest_complete(tmp_path):
    dump, model, _ = debug_run(tmp_path)
    sd = model.state_dict()
    save_native_checkpoint(sd, dump, step=10)
    (dump / "checkpoint" / "step-20").mkdir()  # an interrupted save: no .metadata
    (dump / "checkpoint" / "step-30.tmp").mkdir()  # a save in progress
    assert find_checkpoint(dump).name == "step-10"
    assert find_checkpoint(dump / "checkpoint").name == "step-10"
    assert find_checkpoint(dump / "checkpoint" / "step-2").name == "step-2"
    assert find_checkpoint(dump, step=2).name == "step-2"
    with pytest.raises(CheckpointNotFound, match="incomplete"):
        find_checkpoint(dump, step=20)
    with pytest.raises(CheckpointNotFound, match="no step-5"):
        find_checkpoint(dump, step=5)
    with pytest.raises(CheckpointNotFound, match="does not exist"):
        find_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFound, match="no checkpoint found"):
        find_checkpoint(tmp_path / "empty")
    # A config.toml from another trainer version (keys added or removed since) still identifies the model.
    cfg = dump / "config.toml"
    cfg.write_text(cfg.read_text().replace("[model]\n", "[model]\nfuture_key = 1\n") + "\n[future]\nx = 2\n")
    loaded = load_native(dump)
    assert loaded.checkpoint.name == "step-10" and loaded.config.model.flavor == "debug_gqa"


def test_export_errors_say_what_is_missing(tmp_path, capsys):
    assert export_main(["--checkpoint", str(tmp_path / "missing"), "--output", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    dump, model, _ = debug_run(tmp_path)
    (dump / "config.toml").unlink()
    assert export_main(["--checkpoint", str(dump), "--output", str(tmp_path / "o")]) == 2
    assert "--flavor" in capsys.readouterr().err
    assert export_main(["--checkpoint", str(dump), "--output", str(tmp_path / "o"), "--flavor", "llama3_1b"]) == 2
    assert "does not match" in capsys.readouterr().err
    assert export_main(["--checkpoint", str(dump), "--output", str(tmp_path / "o2"), "--flavor", "debug_gqa"]) == 0


def test_load_hf_into_rejects_mismatched_model(tmp_path):
    dump, model, _ = debug_run(tmp_path)
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(dump), "--output", str(out), "--dtype", "fp32"]) == 0
    with torch.device("meta"):  # the checks fail before any data is copied
        other = Transformer(dataclasses.replace(model.args, n_layers=2))
        bigger_vocab = Transformer(dataclasses.replace(model.args, vocab_size=model.args.vocab_size + 64))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_hf_into(other, out)
    with pytest.raises(ValueError, match="vocab_size"):
        load_hf_into(bigger_vocab, out)


TEXTS = ["Hello there, friend.", "First Citizen:\nBefore we proceed any further, hear me speak.",
         "the other thing  in  multiple   spaces\n\n new", "Numbers 1234567 and symbols: {}[]()!?"]


def test_exported_sentencepiece_tokenizer_loads_in_transformers(tmp_path):
    """A Llama 2 style SentencePiece tokenizer.model -> LlamaTokenizer config (BOS added, as Llama 2's)."""
    import io
    from pathlib import Path

    from tokenizer import build_tokenizer
    from torchtitan_ext.hf import write_tokenizer_files

    spm = pytest.importorskip("sentencepiece")
    corpus = Path(__file__).resolve().parents[2] / "trainer" / "data" / "sample" / "shakespeare_val.jsonl"
    text = "\n".join(json.loads(line)["text"] for line in corpus.read_text().splitlines())[:8000]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_writer=buf, model_type="bpe",
                                   vocab_size=400, byte_fallback=True, character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(buf.getvalue())
    tok = build_tokenizer(tmp_path / "sp" / "tokenizer.model")
    (tmp_path / "out").mkdir()
    write_tokenizer_files(tok, tmp_path / "sp" / "tokenizer.model", tmp_path / "out", 4096)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    for text in TEXTS:  # (strings starting with a space can differ between SentencePiece and HF's fast tokenizer)
        assert hf_tok.encode(text) == tok.encode(text, bos=True), text


def test_exported_tiktoken_tokenizer_loads_in_transformers(tmp_path):
    """A Llama 3 style tiktoken file -> tokenizer.json with the Llama 3 specials and BOS post-processor."""
    import base64

    from tokenizer import build_tokenizer
    from torchtitan_ext.hf import write_tokenizer_files

    pytest.importorskip("tiktoken")
    merges = [b"th", b"the", b" t", b" the", b"er", b"in", b"  ", b"    "]
    tokens = [bytes([b]) for b in range(256)] + merges
    (tmp_path / "tk").mkdir()
    path = tmp_path / "tk" / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    tok = build_tokenizer(path)
    (tmp_path / "out").mkdir()
    write_tokenizer_files(tok, path, tmp_path / "out", 8192)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert hf_tok.convert_tokens_to_ids("<|end_of_text|>") == tok.eos_id
    for text in TEXTS + ["Zoë 東京"]:
        assert hf_tok.encode(text) == tok.encode(text, bos=True), text
    assert hf_tok.decode(tok.encode(TEXTS[1]), skip_special_tokens=True) == TEXTS[1]
