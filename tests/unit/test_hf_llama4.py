"""Llama 4 from Hugging Face: a tiny ``Llama4ForCausalLM`` saved by transformers, with every part of Llama 4's
text model at work (NoPE blocks, QK norm, chunked attention and temperature tuning over the 40 tokens compared,
interleaved MoE blocks with a shared expert), imports with its logits (``trainer import``, the loader behind
``checkpoint.initial_load_in_hf``, the text model of a multimodal ``Llama4ForConditionalGeneration`` folder),
and trains from the printed keys in this process. Layouts of blocks this model cannot hold are refused in one
line."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os

import pytest
import torch

from tests.support.hf import assert_import_refused, import_toml_args
from tests.support.launch import train_in_process
from torchtitan_ext.hf import main as export_main
from torchtitan_ext.hf_import import main as import_main
from trainer.errors import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

# Chunks of 8 and a floor scale of 16: a sequence of 40 tokens crosses chunk boundaries and reaches temperatures
# above 1 (Llama 4's are 8192 both). Every other block has NoPE and every other one an MoE, offset so that each
# kind meets each. initializer_range 0.1: routing and logits far from uniform.
LLAMA4 = dict(vocab_size=2048, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
              interleave_moe_layer_step=2, no_rope_layer_interval=2, use_qk_norm=True, attention_chunk_size=8,
              attn_temperature_tuning=True, floor_scale=16, attn_scale=0.1, max_position_embeddings=64,
              rms_norm_eps=1e-5, initializer_range=0.1,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 1.0, "original_max_position_embeddings": 32})


def _tokens(n: int = 40) -> torch.Tensor:
    return torch.randint(0, LLAMA4["vocab_size"], (2, n), generator=torch.Generator().manual_seed(0))


def _logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """A tiny Llama 4 text model saved by transformers (sharded, with an index), and the model itself."""
    torch.manual_seed(0)
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' notes on the small RoPE parameters
        config = transformers.Llama4TextConfig(**LLAMA4)
    model = transformers.Llama4ForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("llama4") / "hf"
    model.save_pretrained(str(folder), max_shard_size="200KB")
    return folder, model


def test_config_reads_as_llama4_attention_and_experts(llama4):
    from trainer.models.llama.hf_adapter import read_hf_args

    args = read_hf_args(llama4[0])
    assert (args.no_rope_layer_interval, args.attention_chunk_size, args.use_qk_norm, args.attn_temperature_tuning,
            args.floor_scale, args.attn_scale) == (2, 8, True, True, 16, 0.1)
    assert [args.uses_rope(i) for i in range(4)] == [True, False, True, False]
    assert [args.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert (args.ffn_hidden_dim, args.expert_hidden_dim, args.head_dim) == (96, 32, 16)
    moe = args.moe
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.score_func, moe.route_norm,
            moe.score_before_experts, moe.load_balance_coeff) == (4, 1, 1, "sigmoid", False, True, None)


def test_weights_load_with_the_logits_of_transformers(llama4):
    """Both readers (the whole state dict; the in-place loader of a model built from the run's config) give
    transformers' logits, chunk boundaries and temperatures included; so does decoding from our KV cache."""
    from torchtitan_ext.native import build_model
    from trainer.models.llama.hf_adapter import load_hf_into, load_hf_state_dict, read_hf_args
    from trainer.models.llama.model import Transformer

    folder, hf_model = llama4
    sd, _ = load_hf_state_dict(folder)
    args = read_hf_args(folder)
    expected = _logits(hf_model, _tokens())
    ours = build_model(args, sd)
    assert (_logits(ours, _tokens()) - expected).abs().max().item() <= 1e-5
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(args, max_seq_len=48))
    model.to_empty(device="cpu")
    model.init_weights()
    load_hf_into(model, folder)
    assert (_logits(model, _tokens()) - expected).abs().max().item() <= 1e-5
    model.setup_kv_cache(2, 48)
    with torch.no_grad():
        steps = [model(_tokens()[:, :20], input_pos=torch.arange(20))]
        steps += [model(_tokens()[:, t:t + 1], input_pos=torch.tensor([t])) for t in range(20, 40)]
    assert (torch.cat(steps, dim=1) - expected).abs().max().item() <= 1e-5


def test_multimodal_folder_imports_its_text_model(llama4, tmp_path):
    """A Llama4ForConditionalGeneration folder (transformers' own, with a small vision tower): its text model's
    weights are read from under language_model., the vision weights left out."""
    from torchtitan_ext.native import build_model
    from trainer.models.llama.hf_adapter import load_hf_state_dict

    folder, hf_text = llama4
    with contextlib.redirect_stderr(io.StringIO()):
        config = transformers.Llama4Config(
            text_config=LLAMA4, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                   num_attention_heads=2, image_size=28, patch_size=14,
                                                   vision_output_dim=32, projector_input_dim=32,
                                                   projector_output_dim=32))
    multimodal = transformers.Llama4ForConditionalGeneration(config).eval()
    multimodal.language_model.load_state_dict(hf_text.state_dict())
    multimodal.save_pretrained(str(tmp_path / "mm"))
    assert json.loads((tmp_path / "mm" / "config.json").read_text())["model_type"] == "llama4"
    sd, _ = load_hf_state_dict(tmp_path / "mm")
    assert not any("vision" in name for name in sd)
    expected = _logits(multimodal.language_model, _tokens())  # its own forward needs images in this transformers
    assert (_logits(build_model(_args_of(tmp_path / "mm"), sd), _tokens()) - expected).abs().max().item() <= 1e-5


def _args_of(folder):
    from trainer.models.llama.hf_adapter import read_hf_args

    return read_hf_args(folder)


def test_import_prints_keys_that_train_and_export_back(llama4, tmp_path):
    """`trainer import` writes a seed with transformers' logits and prints [model] keys that describe the
    folder exactly; three training steps from those keys run here (the chunked and the temperature-tuned
    attention at seq_len 32 included), and `trainer export` writes a Llama 4 folder that transformers loads
    with the trained model's logits."""
    from torchtitan_ext.native import build_model
    from trainer.checkpoint.offline import load_checkpoint_state_dict
    from trainer.config import load_config
    from trainer.models.config import resolve_model_args
    from trainer.models.llama.hf_adapter import read_hf_args

    folder, hf_model = llama4
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert import_main(["--hf", str(folder), "--output", str(tmp_path / "import")]) == 0
    toml = (tmp_path / "import" / "import.toml").read_text()
    assert toml in printed.getvalue() and "Llama 4's routing" in toml
    args = read_hf_args(folder)
    seed = build_model(args, load_checkpoint_state_dict(tmp_path / "import" / "checkpoint" / "step-0"))
    assert (_logits(seed, _tokens()) - _logits(hf_model, _tokens())).abs().max().item() <= 1e-5
    config = load_config(import_toml_args(toml), env={})
    assert resolve_model_args(config, None) == dataclasses.replace(args, max_seq_len=config.training.seq_len)
    with pytest.MonkeyPatch.context() as mp:
        rc, out = train_in_process(tmp_path / "run", *import_toml_args(toml), "--training.seq_len", "32",
                                   "--training.steps", "3", "--optimizer.lr", "1e-3", "--checkpoint.enable",
                                   "--checkpoint.interval", "3", monkeypatch=mp)
    assert rc == 0, out[-3000:]
    from torchtitan_ext.native import load_native

    assert export_main(["--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "export"),
                        "--dtype", "fp32"]) == 0
    with contextlib.redirect_stderr(io.StringIO()):
        reloaded, info = transformers.Llama4ForCausalLM.from_pretrained(str(tmp_path / "export"),
                                                                        dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for field in ("no_rope_layers", "moe_layers", "layer_types", "use_qk_norm", "attention_chunk_size",
                  "attn_temperature_tuning", "floor_scale", "attn_scale", "intermediate_size_mlp", "head_dim"):
        assert getattr(reloaded.config, field) == getattr(hf_model.config, field), field
    trained = load_native(tmp_path / "run").model
    ours = _logits(trained, _tokens())
    assert (_logits(reloaded, _tokens()) - ours).abs().max().item() <= 1e-5
    assert (_logits(hf_model, _tokens()) - ours).abs().max().item() > 1e-3  # the export is the trained model


@pytest.mark.parametrize("change,named", [
    (dict(no_rope_layers=[1, 0, 0, 1]), "no_rope_layers=[1, 0, 0, 1] is not every no_rope_layer_interval-th"),
    (dict(moe_layers=[0, 1]), "moe_layers=[0, 1] is not every interleave_moe_layer_step-th"),
    (dict(layer_types=["full_attention"] * 4), "layer_types="),
    (dict(attention_bias=True), "attention_bias=true"),
])
def test_layouts_this_model_cannot_hold_are_refused_in_one_line(llama4, tmp_path, capsys, change, named):
    assert_import_refused(llama4[0], tmp_path, change, named, capsys)


def test_sequences_split_over_ranks_refuse_chunked_attention_and_temperature(llama4):
    """Tensor and context parallel hold parts of a sequence; what needs the whole one is refused when the
    training sequences reach it, and allowed when they do not."""
    from trainer.config import load_config, validate

    folder, _ = llama4
    printed = io.StringIO()
    keys = import_toml_args(_import_toml(folder, printed))
    tp = [*keys, "--parallelism.tensor_parallel_degree", "2"]
    with pytest.raises(ConfigError, match=r"chunked attention \(training.seq_len 32 > model.attention_chunk_size 8\)"):
        validate(load_config([*tp, "--training.seq_len", "32"], env={}), world_size=2, files=False)
    with pytest.raises(ConfigError, match=r"temperature tuning \(training.seq_len 16 >= model.floor_scale 16\)"):
        validate(load_config([*tp, "--training.seq_len", "16", "--model.attention_chunk_size", "0"], env={}),
                 world_size=2, files=False)
    validate(load_config([*tp, "--training.seq_len", "8"], env={}), world_size=2, files=False)


def _import_toml(folder, sink) -> str:
    from torchtitan_ext.hf_import import import_toml
    from trainer.models.llama.hf_adapter import read_hf_args

    with contextlib.redirect_stdout(sink):
        return import_toml(read_hf_args(folder), folder / "step-0", folder)


def test_llama4_routing_without_its_attention_exports_as_llama4(tmp_path):
    """torchtitan's llama4 shape (Llama 4's routing, every other block an MoE, RoPE everywhere, no QK norm)
    has no Mixtral layout: it is written as Llama 4 (every block rotating, no chunks), with our logits."""
    from tests.support.models import fast_model
    from torchtitan_ext.hf import hf_format, write_hf_folder
    from trainer.models.llama.args import LlamaModelArgs, MoEArgs

    args = LlamaModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=2048, ffn_dim=96, moe_hidden_dim=32,
                          max_seq_len=64, rope_theta=500000.0, interleave_moe_layer_step=2,
                          moe=MoEArgs(num_experts=4, top_k=1, num_shared_experts=1, load_balance_coeff=None))
    assert hf_format(args, "this model") == "llama4"
    model = fast_model(args, 0)
    write_hf_folder(model.state_dict(), args, tmp_path / "hf", dtype="fp32", max_position_embeddings=64)
    reloaded = transformers.Llama4ForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert reloaded.config.no_rope_layers == [1, 1, 1, 1] and reloaded.config.moe_layers == [1, 3]
    assert (_logits(reloaded, _tokens()) - _logits(model, _tokens())).abs().max().item() <= 1e-5
