"""Mixtral-style Hugging Face interop: a tiny ``MixtralForCausalLM`` saved by transformers imports with its
logits (``trainer import``, ``checkpoint.initial_load_in_hf``'s loader, the fused layout of transformers 5),
trains from the printed keys in this process, and exports back to a folder transformers loads with our
logits; the MoEs Mixtral cannot hold are refused in one line with nothing written."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

from tests.support.hf import assert_import_refused, import_toml_args
from tests.support.launch import train_in_process
from torchtitan_ext.hf import main as export_main, write_hf_folder
from torchtitan_ext.hf_import import main as import_main
from trainer.errors import ConfigError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STEPS = 3
# Dimensions multiples of 8 (the grouped kernel's rows); vocabulary as large as the bundled debug tokenizer's,
# on which the run trains. initializer_range 0.1: routing and logits far from uniform, so that a wrong
# permutation, expert order or routing rule moves the logits by far more than the tolerance.
MIXTRAL = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               num_local_experts=4, num_experts_per_tok=2, vocab_size=2048, max_position_embeddings=256,
               initializer_range=0.1)
FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "num_local_experts", "num_experts_per_tok", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
          "max_position_embeddings", "rope_parameters", "hidden_act", "sliding_window")


def _tokens(n: int = 40) -> torch.Tensor:
    return torch.randint(0, MIXTRAL["vocab_size"], (2, n), generator=torch.Generator().manual_seed(0))


def _hf_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens).logits


def _ours(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral saved by transformers (sharded, with an index), and the model itself."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL)).eval()
    folder = tmp_path_factory.mktemp("mixtral") / "hf"
    model.save_pretrained(str(folder), max_shard_size="100KB")
    return folder, model


@pytest.fixture(scope="module")
def round_trip(mixtral, tmp_path_factory):
    """`trainer import`, a few training steps from the keys it printed (this process), `trainer export`."""
    import contextlib
    import io

    folder, _ = mixtral
    tmp = tmp_path_factory.mktemp("mixtral_run")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert import_main(["--hf", str(folder), "--output", str(tmp / "import")]) == 0
    toml = (tmp / "import" / "import.toml").read_text()
    assert toml in printed.getvalue()
    dump = tmp / "run"
    with pytest.MonkeyPatch.context() as mp:
        rc, out = train_in_process(dump, *import_toml_args(toml), "--training.seq_len", "32",
                                   "--training.steps", str(STEPS), "--optimizer.lr", "1e-3", "--checkpoint.enable",
                                   "--checkpoint.interval", str(STEPS), monkeypatch=mp)
    assert rc == 0, out[-3000:]
    export = tmp / "export"
    assert export_main(["--checkpoint", str(dump), "--output", str(export), "--dtype", "fp32"]) == 0
    return {"printed": toml, "seed": tmp / "import" / "checkpoint" / "step-0", "run": dump,
            "export": export}


def test_import_prints_mixtral_routing_and_keeps_the_logits(mixtral, round_trip):
    from torchtitan_ext.native import build_model
    from trainer.checkpoint.offline import load_checkpoint_state_dict
    from trainer.models.llama.hf_adapter import read_hf_args

    folder, hf_model = mixtral
    keys = tomllib.loads(round_trip["printed"])
    assert keys["model"]["moe"] == {
        "num_experts": 4, "top_k": 2, "num_shared_experts": 0, "hidden_dim": 32, "interleave_moe_layer_step": 1,
        "score_func": "softmax", "route_norm": True, "route_scale": 1.0, "score_before_experts": False,
        "load_balance_coeff": 0.0, "aux_loss_coeff": 0.0, "capacity_factor": 0.0}
    args = read_hf_args(folder)
    seed = build_model(args, load_checkpoint_state_dict(round_trip["seed"]))
    diff = (_ours(seed, _tokens()) - _hf_logits(hf_model, _tokens())).abs().max().item()
    assert diff <= 1e-5, diff


def test_printed_keys_describe_the_folder_exactly(mixtral, round_trip):
    from trainer.config import load_config
    from trainer.models.config import resolve_model_args
    from trainer.models.llama.hf_adapter import read_hf_args

    config = load_config(import_toml_args(round_trip["printed"]), env={})
    assert resolve_model_args(config, None) == dataclasses.replace(read_hf_args(mixtral[0]),
                                                                   max_seq_len=config.training.seq_len)


def test_trained_export_loads_in_transformers_with_our_logits(mixtral, round_trip):
    from torchtitan_ext.native import load_native

    folder, hf_model = mixtral
    export = round_trip["export"]
    reloaded, info = transformers.MixtralForCausalLM.from_pretrained(str(export), dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for field in FIELDS:
        assert getattr(reloaded.config, field) == getattr(hf_model.config, field), field
    assert reloaded.config.head_dim == MIXTRAL["hidden_size"] // MIXTRAL["num_attention_heads"]  # explicit (was null)
    index = json.loads((export / "model.safetensors.index.json").read_text())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in index["weight_map"]  # the Hub's layout
    native = load_native(round_trip["run"])
    assert native.checkpoint.name.endswith(f"step-{STEPS}")
    ours = _ours(native.model, _tokens())
    diff = (_hf_logits(reloaded, _tokens()) - ours).abs().max().item()
    moved = (_hf_logits(hf_model, _tokens()) - ours).abs().max().item()
    assert diff <= 1e-5, diff
    assert moved > 1e-3, moved  # the steps changed the model: the export is the trained one


def _model(args, seed: int):
    """Random weights (tests/support/models.py) and the MoE buffers as the trainer initialises them: zero."""
    from tests.support.models import fast_model

    model = fast_model(args, seed)
    for name, buffer in model.named_buffers():
        if ".moe." in name:
            buffer.zero_()
    return model


def _fused_folder(hf_model, folder):
    """The same model in transformers 5's in-memory layout (fused experts, mlp.gate), as safetensors."""
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, str(folder / "model.safetensors"))
    hf_model.config.save_pretrained(str(folder))
    return folder


def test_fused_layout_and_initial_load_in_hf_read_the_same_weights(mixtral, tmp_path):
    """transformers 5's fused experts import as the per-expert files do; the loader behind
    checkpoint.initial_load_in_hf fills a model that balances with the expert bias (left at zero)."""
    from safetensors import safe_open

    from torchtitan_ext.native import build_model
    from trainer.models.llama.hf_adapter import load_hf_into, load_hf_state_dict, read_hf_args
    from trainer.models.llama.model import Transformer

    folder, hf_model = mixtral
    per_expert, _ = load_hf_state_dict(folder)
    fused_folder = _fused_folder(hf_model, tmp_path / "fused")
    with safe_open(str(fused_folder / "model.safetensors"), "pt") as st:
        assert "model.layers.0.mlp.experts.gate_up_proj" in st.keys()
    fused, _ = load_hf_state_dict(fused_folder)
    assert sorted(fused) == sorted(per_expert)
    for name, tensor in per_expert.items():
        assert torch.equal(fused[name], tensor), name
    assert import_main(["--hf", str(fused_folder), "--output", str(tmp_path / "seed")]) == 0

    args = read_hf_args(folder)
    balanced = dataclasses.replace(args, moe=dataclasses.replace(args.moe, load_balance_coeff=1e-3), max_seq_len=64)
    model = _model(balanced, seed=3)
    load_hf_into(model, fused_folder)
    assert all(float(b.abs().max()) == 0 for n, b in model.named_buffers() if n.endswith("expert_bias"))
    diff = (_ours(model, _tokens()) - _hf_logits(hf_model, _tokens())).abs().max().item()
    assert diff <= 1e-5, diff
    assert (_ours(build_model(args, per_expert), _tokens()) - _ours(model, _tokens())).abs().max().item() <= 1e-6

    with torch.device("meta"):  # a model routing otherwise is refused before any data is read
        sigmoid = Transformer(dataclasses.replace(balanced, moe=dataclasses.replace(balanced.moe,
                                                                                    score_func="sigmoid")))
    with pytest.raises(ConfigError, match="moe.score_func softmax != sigmoid"):
        load_hf_into(sigmoid, folder)


@pytest.mark.parametrize("change,named", [
    (dict(sliding_window=16), "sliding_window=16"),
    (dict(model_type="qwen3_moe"), "model_type 'qwen3_moe' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_unrepresentable_mixtral_refused_in_one_line(mixtral, tmp_path, capsys, change, named):
    assert_import_refused(mixtral[0], tmp_path, change, named, capsys)


def test_sliding_window_as_long_as_the_sequences_is_accepted(mixtral):
    from trainer.models.llama.hf_adapter import hf_config_to_args

    cfg = {**json.loads((mixtral[0] / "config.json").read_text()), "sliding_window": 128}
    with pytest.raises(ConfigError, match="max_position_embeddings 256"):
        hf_config_to_args(cfg)
    assert hf_config_to_args(cfg, seq_len=128).moe.num_experts == 4  # initial_load_in_hf at training.seq_len 128
    with pytest.raises(ConfigError, match="shorter than training.seq_len 129"):
        hf_config_to_args(cfg, seq_len=129)


def _moe_args(**routing):
    from trainer.models.llama.args import LlamaModelArgs, MoEArgs

    layout = {k: routing.pop(k) for k in ("interleave_moe_layer_step",) if k in routing}
    moe = MoEArgs(**{**dict(num_experts=4, top_k=2, num_shared_experts=0, score_func="softmax", route_norm=True,
                            score_before_experts=False, load_balance_coeff=None), **routing})
    return LlamaModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048, moe_hidden_dim=32,
                          max_seq_len=64, moe=moe, **layout)


def _debug_run(tmp_path, args, seed=0):
    """A run folder (config.toml with the [model.moe] keys of ``args``, checkpoint/step-1)."""
    from trainer.config import load_config
    from trainer.models.config import model_config_keys
    from trainer.tools.checkpoint_model import save_native_checkpoint

    keys = model_config_keys(args)
    moe = keys.pop("moe")
    flags = [f"--model.{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in keys.items()]
    flags += [f"--model.moe.{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in moe.items()]
    config = load_config(flags, env={})
    model = _model(args, seed)
    dump = tmp_path / "run"
    save_native_checkpoint(model.state_dict(), dump, step=1, config=config)
    return dump, model


@pytest.mark.parametrize("routing,named", [
    (dict(score_func="sigmoid"), "score_func sigmoid"),
    (dict(num_shared_experts=1), "num_shared_experts 1"),
    (dict(interleave_moe_layer_step=2), "interleave_moe_layer_step 2"),
    (dict(score_before_experts=True), "score_before_experts true"),
    (dict(route_norm=False), "route_norm false"),
])
def test_export_refuses_an_moe_mixtral_cannot_hold(tmp_path, capsys, routing, named):
    dump, _ = _debug_run(tmp_path, _moe_args(**routing))
    out = tmp_path / "export"
    assert export_main(["--checkpoint", str(dump), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and "Mixtral" in err, err
    assert not out.exists()


def test_export_refuses_a_trained_expert_bias_unless_dropped(tmp_path, capsys):
    args = _moe_args(load_balance_coeff=1e-3)
    dump, model = _debug_run(tmp_path, args)
    out = tmp_path / "export"
    # The bias at zero (as initialised) routes as Mixtral does: exported, and transformers gives our logits.
    assert export_main(["--checkpoint", str(dump), "--output", str(out), "--dtype", "fp32"]) == 0
    reloaded = transformers.MixtralForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert (_hf_logits(reloaded, _tokens()) - _ours(model, _tokens())).abs().max().item() <= 1e-5

    with torch.no_grad():
        model.layers["1"].moe.expert_bias.copy_(torch.tensor([0.5, -0.5, 0.0, 0.0]))
    from trainer.tools.checkpoint_model import save_native_checkpoint
    save_native_checkpoint(model.state_dict(), dump, step=2)
    capsys.readouterr()
    assert export_main(["--checkpoint", str(dump), "--output", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "layers.1.moe.expert_bias" in err and "--drop_expert_bias" in err, err
    assert not (tmp_path / "refused").exists()
    with pytest.raises(ValueError, match="--drop_expert_bias"):
        write_hf_folder(model.state_dict(), args, tmp_path / "refused", max_position_embeddings=64)
    assert not (tmp_path / "refused").exists()
    assert export_main(["--checkpoint", str(dump), "--output", str(tmp_path / "dropped"), "--dtype", "fp32",
                        "--drop_expert_bias"]) == 0
    dropped = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "dropped"), dtype=torch.float32)
    with_bias = _ours(model, _tokens())
    with torch.no_grad():
        model.layers["1"].moe.expert_bias.zero_()
    assert (_hf_logits(dropped, _tokens()) - _ours(model, _tokens())).abs().max().item() <= 1e-5
    assert (with_bias - _ours(model, _tokens())).abs().max().item() > 1e-4  # the bias did route otherwise
