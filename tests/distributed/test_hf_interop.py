"""Hugging Face models made by ``transformers`` itself, through `trainer import`, training and export.

Four models: (a) grouped-query attention; (b) rope_theta and rms_norm_eps unlike any flavor; (c) tied
embeddings with an odd vocabulary, saved sharded with an index file; (d) a shape matching no flavor, with
Llama 3.1 RoPE scaling. Each is imported to a seed checkpoint, trained 5 steps from the [model] keys the
import printed (one process, then FSDP 2 and TP 2 in one torchrun start for all four), exported, and
reloaded by transformers.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tests.support.batches import Batches, spec
from tests.support.hf import import_toml_args
from tests.support.launch import DEBUG_CONFIG, read_metrics

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

STEPS = 5
SEQ = 32
BASE = ["--job.config_file", str(DEBUG_CONFIG), "--training.seq_len", str(SEQ), "--training.steps", str(STEPS),
        "--training.global_batch_size", "4", "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "1e-3"]
LAYOUTS = {"one": ([], 1), "fsdp": (["--training.local_batch_size", "2"], 2),
           "tp": (["--parallelism.tensor_parallel_degree", "2"], 2)}

# Vocabularies at least the bundled debug tokenizer's (the runs train on it); (c)'s is odd.
MODELS = {
    "gqa": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=2048),
    "theta_eps": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=2048, rope_theta=31337.0, rms_norm_eps=2e-4),
    "tied_odd": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=2111, tie_word_embeddings=True),
    "custom": dict(hidden_size=128, intermediate_size=320, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=2080, max_position_embeddings=4096,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
}
# Weights large enough that the loss depends on every detail (transformers' default, 0.02, gives nearly
# uniform logits): with initializer_range 0.2 a flavor's rope_theta moves (b)'s first loss by ~2e-3
# (relative), and its embeddings are scaled down so that the hidden states' mean square is near
# rms_norm_eps, which then moves the loss by ~5e-3 (the tolerance is 1e-6). The deeper models get smaller
# weights: fp32 rounding grows with the logits' size, and their logits are compared to 1e-5.
INIT_RANGE = {"gqa": 0.1, "theta_eps": 0.2, "tied_odd": 0.1, "custom": 0.05}
EMBED_SCALE = {"theta_eps": 0.05}
FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "vocab_size", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "rope_parameters",
          "hidden_act", "attention_bias", "mlp_bias", "head_dim")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Make, import and train the four models; returns {name: folders}."""
    from torchtitan_ext.hf_import import main as import_main

    tmp = tmp_path_factory.mktemp("hf_interop")
    out: dict[str, dict] = {}
    names = set()
    for i, (name, kwargs) in enumerate(MODELS.items()):
        torch.manual_seed(i)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs, initializer_range=INIT_RANGE[name]))
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(EMBED_SCALE.get(name, 1.0))
        hf = tmp / name / "hf"
        shard = {"max_shard_size": "100KB"} if name == "tied_odd" else {}
        model.save_pretrained(str(hf), **shard)
        seed = tmp / name / "import"
        assert import_main(["--hf", str(hf), "--output", str(seed)]) == 0
        train_args = import_toml_args((seed / "import.toml").read_text())
        out[name] = {"hf": hf, "seed": seed, "batch": tmp / "runs" / f"hf_{name}_one.batch0.pt"}
        for layout, (extra, nproc) in LAYOUTS.items():
            run = spec(f"hf_{name}_{layout}", nproc, *BASE, *train_args, *extra, "--checkpoint.enable",
                       "--checkpoint.interval", str(STEPS), fast=False, save_batch=layout == "one")
            out[name][layout] = tmp / "runs" / run
            names.add(run)
    t0 = time.time()
    started = Batches(tmp / "runs", names)  # one torchrun start per world size for all four models
    try:
        for run in names:
            started.get(run, timeout=600)
    finally:
        started.close()
    print(f"training runs took {time.time() - t0:.1f}s")
    return out


def _losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(dump)}


@pytest.mark.parametrize("name", list(MODELS))
def test_import_first_loss_equals_transformers(runs, name):
    r = runs[name]
    hf_model = transformers.LlamaForCausalLM.from_pretrained(str(r["hf"]), dtype=torch.float32).eval()
    batch = torch.load(r["batch"])
    inputs, labels = batch["input"], batch["labels"]
    assert torch.equal(inputs[:, 1:], labels[:, :-1])  # packed: labels are the inputs shifted by one
    full = torch.cat([inputs, labels[:, -1:]], dim=1)  # transformers shifts the labels itself
    with torch.no_grad():
        theirs = hf_model(input_ids=full, labels=full).loss.item()
    ours = _losses(r["one"])[1]
    assert abs(ours - theirs) <= 1e-6 * abs(theirs), (ours, theirs)


@pytest.mark.parametrize("name", list(MODELS))
def test_parallel_imports_match_one_process(runs, name):
    one = _losses(runs[name]["one"])
    assert sorted(one) == list(range(1, STEPS + 1))
    for layout in ("fsdp", "tp"):
        other = _losses(runs[name][layout])
        assert abs(other[1] - one[1]) <= 1e-5 * abs(one[1]), (layout, other, one)
        # Later steps too: an untied copy of a tied matrix would drift from step 2 on.
        for step in range(2, STEPS + 1):
            assert abs(other[step] - one[step]) <= 1e-4 * abs(one[step]), (layout, step, other, one)


@pytest.mark.parametrize("name", list(MODELS))
def test_export_reloads_in_transformers(runs, name, tmp_path):
    from safetensors import safe_open

    from torchtitan_ext.hf import main as export_main
    from torchtitan_ext.native import load_native

    r = runs[name]
    export = tmp_path / "export"
    assert export_main(["--checkpoint", str(r["one"]), "--output", str(export), "--dtype", "fp32"]) == 0
    original = transformers.AutoConfig.from_pretrained(str(r["hf"]))
    reloaded, info = transformers.LlamaForCausalLM.from_pretrained(str(export), dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for field in FIELDS:
        assert getattr(reloaded.config, field) == getattr(original, field), field
    names = set()
    for f in export.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            names |= set(st.keys())
    assert ("lm_head.weight" in names) == (not original.tie_word_embeddings)

    native = load_native(r["one"])
    assert native.checkpoint.name in (f"step-{STEPS}", f"final-step-{STEPS}")  # the final export, when made
    if original.tie_word_embeddings:
        assert native.model.output.weight is native.model.tok_embeddings.weight
    tokens = torch.randint(0, original.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (reloaded.eval()(tokens).logits - native.model(tokens)).abs().max().item()
        moved = (transformers.LlamaForCausalLM.from_pretrained(str(r["hf"]), dtype=torch.float32).eval()(tokens).logits
                 - native.model(tokens)).abs().max().item()
    assert diff <= 1e-5, diff
    assert moved > 1e-3, moved  # the 5 steps did change the model: the export is the trained one


def test_tied_checkpoint_holds_one_matrix(runs):
    from trainer.checkpoint.offline import load_checkpoint_state_dict
    from torchtitan_ext.native import find_checkpoint

    for layout in LAYOUTS:
        sd = load_checkpoint_state_dict(find_checkpoint(runs["tied_odd"][layout]))
        assert torch.equal(sd["output.weight"], sd["tok_embeddings.weight"]), layout


@pytest.mark.parametrize("field,value,named", [
    ("mlp_bias", True, "mlp_bias"), ("attention_bias", True, "attention_bias"), ("hidden_act", "gelu", "hidden_act"),
    ("head_dim", 32, "head_dim"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64},
     "yarn"),
])
def test_unrepresentable_field_refused_in_one_line(tmp_path, capsys, field, value, named):
    from torchtitan_ext.hf_import import main as import_main

    config = transformers.LlamaConfig(**{**MODELS["gqa"], field: value})
    config.save_pretrained(str(tmp_path / "hf"))
    assert import_main(["--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
    assert not (tmp_path / "out").exists()


def test_import_holds_one_tensor_at_a_time(runs, tmp_path, monkeypatch):
    """DCP asks for each tensor as it writes it: when the importer reads a tensor from safetensors, at most
    the one written just before is still alive, never the model."""
    import weakref

    from trainer.models.llama import hf_adapter
    from torchtitan_ext.hf_import import import_hf

    alive: list[weakref.ref] = []
    most = []
    get = hf_adapter.HFReader.get

    def tracking_get(self, name):
        most.append(sum(r() is not None for r in alive))
        t = get(self, name)
        alive.append(weakref.ref(t))
        return t

    monkeypatch.setattr(hf_adapter.HFReader, "get", tracking_get)
    step = import_hf(runs["custom"]["hf"], tmp_path / "seed")
    assert len(most) == 4 * 9 + 3 and max(most) <= 1, most
    assert (step / "checkpoint.json").is_file()
