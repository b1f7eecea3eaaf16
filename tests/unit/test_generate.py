"""trainer generate: KV-cache generation equals the training forward; batching, sampling and the CLI. (The
model's cached forward itself is tested in test_model.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from torchtitan_ext.generate import generate, main as generate_main, sample_next
from torchtitan_ext.native import save_native_checkpoint
from trainer.config import load_config
from trainer.models.llama.args import LlamaModelArgs
from trainer.models.llama.model import Transformer
from trainer.models.config import resolve_model_args
from trainer.data.tokenizer import load_tokenizer
from tests.support.models import fast_model


@pytest.fixture(scope="module")
def model():
    args = LlamaModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64)
    return fast_model(args)


def test_greedy_generation_kv_cache_batching_and_reference_agree(model):
    prompts = [[5, 9, 3], [7, 1, 2, 8, 4, 6, 11]]
    batched = generate(model, prompts, 12)
    assert batched == generate(model, prompts, 12, use_kv_cache=False)
    assert batched == [generate(model, [p], 12)[0] for p in prompts]  # left padding changes nothing
    for prompt, new in zip(prompts, batched):  # the naive loop over the training forward
        seq = list(prompt)
        for _ in range(12):
            with torch.no_grad():
                seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        assert seq[len(prompt):] == new
    # EOS stops a row; max_new_tokens is respected.
    eos = batched[0][2]
    out = generate(model, prompts[:1], 12, eos_id=eos)
    assert out[0] == batched[0][:batched[0].index(eos)]
    assert generate(model, prompts, 3) == [b[:3] for b in batched]


def test_sampling_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    g = torch.Generator().manual_seed(0)
    assert sample_next(logits, temperature=0.0).item() == 1
    assert all(sample_next(logits, 1.0, top_k=1, generator=g).item() == 1 for _ in range(20))
    assert all(sample_next(logits, 1.0, top_p=0.01, generator=g).item() == 1 for _ in range(20))
    seen = {sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert seen == {1, 3}
    seen = {sample_next(logits, 1.0, top_p=0.95, generator=g).item() for _ in range(300)}
    assert seen <= {1, 2, 3} and {1, 3} <= seen
    a = [sample_next(logits, 0.8, generator=torch.Generator().manual_seed(3)).item() for _ in range(5)]
    b = [sample_next(logits, 0.8, generator=torch.Generator().manual_seed(3)).item() for _ in range(5)]
    assert a == b


def test_generate_cli_on_a_checkpoint(tmp_path, capsys):
    config = load_config(["--model.flavor", "debug_gqa", "--training.seq_len", "64"], env={})
    tok = load_tokenizer(config)
    m = fast_model(resolve_model_args(config, tok.vocab_size))
    save_native_checkpoint(m.state_dict(), tmp_path / "run", step=1, config=config)
    out_json = tmp_path / "samples.json"
    rc = generate_main(["--checkpoint", str(tmp_path / "run"), "--prompt", "ROMEO:", "--prompt", "JULIET: O",
                        "--max_new_tokens", "6", "--temperature", "0.7", "--top_k", "20", "--top_p", "0.9",
                        "--num_samples", "2", "--seed", "1", "--output_json", str(out_json)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert stdout.count("=== sample") == 4 and "ROMEO:" in stdout
    samples = json.loads(out_json.read_text())["samples"]
    assert len(samples) == 4 and all(0 < len(s["tokens"]) <= 6 for s in samples)
    # Greedy with and without the KV cache gives the same text.
    args = ["--checkpoint", str(tmp_path / "run"), "--prompt", "ROMEO:", "--max_new_tokens", "8",
            "--temperature", "0"]
    assert generate_main(args) == 0
    with_cache = capsys.readouterr().out
    assert generate_main(args + ["--no_kv_cache"]) == 0
    assert capsys.readouterr().out.split("=== sample 1 ===")[1] == with_cache.split("=== sample 1 ===")[1]
    # From an export (--hf): the same greedy text.
    from torchtitan_ext.hf import main as export_main

    assert export_main(["--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "hf"), "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert generate_main(["--hf", str(tmp_path / "hf")] + args[2:]) == 0
    assert capsys.readouterr().out.split("=== sample 1 ===")[1] == with_cache.split("=== sample 1 ===")[1]
    assert generate_main(["--checkpoint", str(tmp_path / "nothing"), "--prompt", "x"]) == 2


def test_generate_from_a_mixture_of_experts_checkpoint(tmp_path, capsys):
    """debug_moe with [model.moe] keys the run set (top-1, a capacity): the checkpoint's config rebuilds the same
    mixture of experts, and greedy text is the same with and without the KV cache (the expert bias loads too)."""
    keys = ["--model.flavor", "debug_moe", "--model.n_layers", "2", "--training.seq_len", "64",
            "--model.moe.top_k", "1", "--model.moe.capacity_factor", "2"]
    config = load_config(keys, env={})
    args = resolve_model_args(config, load_tokenizer(config).vocab_size)
    assert args.moe.top_k == 1 and args.moe.capacity_factor == 2
    m = fast_model(args)
    for layer in m.layers.values():
        layer.moe.expert_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    save_native_checkpoint(m.state_dict(), tmp_path / "run", step=1, config=config)
    run = ["--checkpoint", str(tmp_path / "run"), "--prompt", "ROMEO:", "--max_new_tokens", "8", "--temperature", "0"]
    assert generate_main(run) == 0
    with_cache = capsys.readouterr().out
    assert generate_main(run + ["--no_kv_cache"]) == 0
    assert capsys.readouterr().out.split("=== sample 1 ===")[1] == with_cache.split("=== sample 1 ===")[1]
