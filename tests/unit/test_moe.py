"""The mixture-of-experts layer against a per-token loop written from the definition, its kernels, its balancing
(auxiliary loss and expert bias), the llama4 and debug_moe flavors, the [model.moe] keys, and short in-process
runs: balancing over 100 steps, exact resume. (Parallel layouts: tests/distributed/test_moe.py.)"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.support.launch import FULL_WIDTH, read_metrics, train_in_process
from trainer.config import ConfigError, load_config, validate
from trainer.models.config import config_model_args, get_model_args
from trainer.models.llama.args import LlamaModelArgs, MoEArgs, RopeScaling
from trainer.models.llama.flops import count_params, flops_per_token
from trainer.models.llama.model import FeedForward, Transformer
from trainer.models.moe import MoE, balance_experts, moe_layers, moe_metrics, set_aux_loss_scale

DIM, HIDDEN = 32, 48


def _layer(seed: int = 0, shared: int = 0, **kw) -> MoE:
    args = MoEArgs(**{"num_experts": 4, "top_k": 2, "num_shared_experts": shared, **kw})
    torch.manual_seed(seed)
    layer = MoE(args, DIM, HIDDEN, FeedForward(DIM, HIDDEN * shared) if shared else None)
    layer.init_weights(0.05)
    if layer.expert_bias is not None:  # a bias that changes the choice, so that using it is tested
        layer.expert_bias.copy_(torch.randn(args.num_experts) * 0.1)
    return layer


def _reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer written out token by token: route, run each chosen expert, weight, add; the capacity keeps
    an expert's first copies in token order."""
    a = layer.args
    flat = x.reshape(-1, x.shape[-1])
    logits = (flat @ layer.router.gate.weight.T).float()
    scores = torch.softmax(logits, -1) if a.score_func == "softmax" else torch.sigmoid(logits)
    choice = scores if layer.expert_bias is None else scores + layer.expert_bias
    e = layer.experts
    taken = [0] * a.num_experts
    capacity = math.ceil(a.capacity_factor * flat.shape[0] * a.top_k / a.num_experts) if a.capacity_factor else None
    rows = []
    for t in range(flat.shape[0]):
        chosen = torch.topk(choice[t], a.top_k).indices
        weights = scores[t, chosen]
        if a.route_norm:
            weights = weights / weights.sum()
        weights = weights * a.route_scale
        out = torch.zeros(flat.shape[1])
        for w, i in zip(weights, chosen.tolist()):
            taken[i] += 1
            if capacity is not None and taken[i] > capacity:
                continue
            inp = flat[t] * w if a.score_before_experts else flat[t]
            y = e.w2[i] @ (F.silu(e.w1[i] @ inp) * (e.w3[i] @ inp))
            out = out + (y if a.score_before_experts else y * w)
        if layer.shared_experts is not None:
            out = out + layer.shared_experts(flat[t])
        rows.append(out)
    return torch.stack(rows).view_as(x)


CASES = {
    "sigmoid_before_bias": dict(),
    "softmax_after_norm": dict(score_func="softmax", score_before_experts=False, route_norm=True,
                               load_balance_coeff=None),
    "top1_shared_scaled": dict(top_k=1, route_scale=2.5, shared=1),
    "capacity": dict(capacity_factor=0.5, score_before_experts=False),
    "capacity_before": dict(capacity_factor=0.5),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_layer_equals_the_per_token_reference_forward_and_backward(case, grouped):
    layer = _layer(**{**CASES[case], "use_grouped_mm": grouped})
    assert layer.experts.use_grouped_mm is grouped
    x = torch.randn(3, 5, DIM, requires_grad=True)
    g = torch.randn(3, 5, DIM)
    out = layer(x)
    grads = torch.autograd.grad((out * g).sum(), [x, *layer.parameters()])
    ref = _reference(layer, x)
    ref_grads = torch.autograd.grad((ref * g).sum(), [x, *layer.parameters()])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if case.startswith("capacity"):  # 15 tokens x 2 copies over 4 experts, 4 each at most: 14 or more dropped
        assert 14 <= int(layer.dropped_tokens) < 30
    assert int(layer.tokens_per_expert.sum()) == 15 * layer.top_k


def test_grouped_mm_and_loop_give_the_same_numbers():
    grouped, loop = _layer(shared=1), _layer(shared=1, use_grouped_mm=False)
    loop.load_state_dict(grouped.state_dict())
    x = torch.randn(4, 16, DIM)
    torch.testing.assert_close(grouped(x), loop(x), rtol=0, atol=1e-6)


def test_one_expert_top1_is_the_dense_feed_forward():
    layer = _layer(num_experts=1, top_k=1, score_func="softmax", load_balance_coeff=None)
    dense = FeedForward(DIM, HIDDEN)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(dense, name).weight.copy_(getattr(layer.experts, name)[0])
    x = torch.randn(2, 7, DIM, requires_grad=True)
    out, ref = layer(x), dense(x)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    (gx,) = torch.autograd.grad(out.sum(), x)
    (rx,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(gx, rx, rtol=1e-6, atol=1e-6)


def _sequence_aux(layer: MoE, x: torch.Tensor, coeff: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, summed over the sequences, from its definition."""
    a, (bsz, seq, _) = layer.args, x.shape
    total = 0.0
    for b in range(bsz):
        scores = torch.sigmoid((x[b] @ layer.router.gate.weight.T).float())
        chosen = torch.topk(scores + layer.expert_bias, a.top_k).indices
        f = torch.stack([(chosen == i).sum() for i in range(a.num_experts)]) * a.num_experts / (a.top_k * seq)
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        total = total + (f * p).sum()
    return coeff * total


def test_auxiliary_loss_trains_as_a_term_of_the_loss_and_is_per_sequence():
    """Through the layer's output the router gets the gradient of ``loss + scale * aux`` (aux summed over the
    sequences' tokens); the recorded value is that sum, so two halves of a batch add up to the whole."""
    layer = _layer(aux_loss_coeff=0.1)
    plain = _layer(aux_loss_coeff=0.0)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(4, 6, DIM)
    scale = 1 / x.shape[:2].numel()
    set_aux_loss_scale([layer], scale)
    (got,) = torch.autograd.grad(layer(x).square().sum(), layer.router.gate.weight)
    aux = _sequence_aux(plain, x, 0.1)
    (want,) = torch.autograd.grad(plain(x).square().sum() + scale * aux * x.shape[1], plain.router.gate.weight)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(layer.aux_loss_sum, (aux * x.shape[1]).detach(), rtol=1e-5, atol=0)
    halves = _layer(aux_loss_coeff=0.1)
    halves.load_state_dict(layer.state_dict())
    halves(x[:2]), halves(x[2:])
    torch.testing.assert_close(halves.aux_loss_sum, layer.aux_loss_sum, rtol=1e-6, atol=0)


def test_nothing_is_counted_without_gradients():
    layer = _layer(aux_loss_coeff=0.1, capacity_factor=0.5)
    with torch.no_grad():
        layer(torch.randn(2, 8, DIM))
    assert int(layer.tokens_per_expert.sum()) == int(layer.dropped_tokens) == 0 and float(layer.aux_loss_sum) == 0


def test_expert_bias_moves_toward_an_even_load_and_counts_are_reset():
    layer = _layer(load_balance_coeff=0.01)
    layer.expert_bias.zero_()
    layer.tokens_per_expert.copy_(torch.tensor([30, 2, 8, 0]))
    layer.dropped_tokens.fill_(3)
    stats = balance_experts([layer], None, 1)
    assert stats[0].tolist() == [30, 2, 8, 0, 3, 0]
    # sign(mean 10 - load) = [-1, 1, 1, 1] times 0.01, centred: the overloaded expert down, the others up.
    assert layer.expert_bias.tolist() == pytest.approx([-0.015, 0.005, 0.005, 0.005], abs=1e-7)
    assert int(layer.tokens_per_expert.sum()) == int(layer.dropped_tokens) == 0
    # The log's view of it: counts scaled to one step's copies (a recomputed micro-batch counted twice).
    record = moe_metrics(stats * 2, top_k=2, tokens=20, device=torch.device("cpu"))
    assert (record["moe_tokens_per_expert_min"], record["moe_tokens_per_expert_max"]) == (0, 30)
    assert record["moe_load_imbalance"] == pytest.approx(30 / 10) and record["moe_dropped_tokens"] == 3


# torchtitan v0.2.2's llama4 flavors (torchtitan/models/llama4/__init__.py, model/args.py, models/moe/moe.py),
# every field that shapes the model, defaults written out: vocab 202048 unless given, multiple_of 256,
# MoEArgs() = 8 experts, 1 shared, sigmoid, no route norm, scale 1, scores before the experts, top-1, bias
# update 1e-3; interleave_moe_layer_step 2, auto_scale_hidden_dim; RoPEScalingArgs() = (16, 1, 1, 8192).
_TT_MOE = dict(num_shared_experts=1, score_func="sigmoid", route_norm=False, route_scale=1.0,
               score_before_experts=True, top_k=1, load_balance_coeff=1e-3)
_TT_SCALING = RopeScaling(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0, original_max_position_embeddings=8192)
TORCHTITAN_V022_LLAMA4 = {
    "debugmodel": (dict(dim=256, n_layers=6, n_heads=16, num_kv_heads=16, vocab_size=2048, multiple_of=256,
                        ffn_dim_multiplier=None, rope_theta=500000.0, max_seq_len=1048576,
                        interleave_moe_layer_step=2, rope_scaling=_TT_SCALING), 8),
    "17bx16e": (dict(dim=5120, n_layers=48, n_heads=40, num_kv_heads=8, vocab_size=202048, multiple_of=2048,
                     ffn_dim_multiplier=1.2, rope_theta=500000.0, max_seq_len=10485760, interleave_moe_layer_step=1,
                     rope_scaling=_TT_SCALING), 16),
    "17bx128e": (dict(dim=5120, n_layers=48, n_heads=40, num_kv_heads=8, vocab_size=202048, multiple_of=2048,
                      ffn_dim_multiplier=1.2, rope_theta=500000.0, max_seq_len=1048576, interleave_moe_layer_step=2,
                      rope_scaling=None), 128),
}


@pytest.mark.parametrize("flavor", sorted(TORCHTITAN_V022_LLAMA4))
def test_llama4_flavors_are_torchtitans(flavor):
    args = get_model_args("llama4", flavor)
    fields, experts = TORCHTITAN_V022_LLAMA4[flavor]
    assert {k: getattr(args, k) for k in fields} == fields
    assert args.moe == MoEArgs(num_experts=experts, **_TT_MOE)
    assert args.auto_scale_hidden_dim and args.norm_eps == 1e-5


def test_llama4_scout_and_maverick_sizes():
    """Published sizes: Scout 109B total / 17B active (text: 107.8B), Maverick 400B / 17B; the experts'
    hidden size is Hugging Face's intermediate_size 8192, the dense blocks' 16384."""
    scout, maverick = get_model_args("llama4", "17bx16e"), get_model_args("llama4", "17bx128e")
    assert (scout.expert_hidden_dim, maverick.expert_hidden_dim, maverick.ffn_hidden_dim) == (8192, 8192, 16384)
    assert round(count_params(scout) / 1e9, 1) == 107.8 and round(count_params(scout, active=True) / 1e9, 1) == 17.2
    assert round(count_params(maverick) / 1e9) == 401 and round(count_params(maverick, active=True) / 1e9, 1) == 17.2
    assert flops_per_token(scout, 8192) < flops_per_token(get_model_args("llama3", "llama3_70b"), 8192) / 3


def test_parameter_counts_of_a_built_moe_model():
    args = dataclasses.replace(get_model_args("llama3", "debug_moe"), vocab_size=512, max_seq_len=32,
                               interleave_moe_layer_step=2)
    with torch.device("meta"):
        model = Transformer(args)
    assert count_params(args) == sum(p.numel() for p in model.parameters())
    assert [b.moe_enabled for b in model.layers.values()] == [False, True] * 3
    active = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." not in n)
    active += sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n) * 2 // 8
    assert count_params(args, active=True) == active


def _config(*args: str):
    config = load_config(["--job.config_file", "train_configs/debug_model.toml", *args])
    validate(config, world_size=1)
    return config


def test_model_moe_keys_override_the_flavor_and_make_a_dense_flavor_moe():
    args = config_model_args(_config("--model.flavor", "debug_moe", "--model.moe.top_k", "1",
                                     "--model.moe.load_balance_coeff", "0", "--model.moe.capacity_factor", "1.5",
                                     "--model.moe.score_func", "softmax", "--model.moe.hidden_dim", "64"))
    assert (args.moe.top_k, args.moe.load_balance_coeff, args.moe.capacity_factor) == (1, None, 1.5)
    assert (args.moe.score_func, args.expert_hidden_dim, args.moe.num_experts) == ("softmax", 64, 8)
    dense = config_model_args(_config("--model.moe.num_experts", "4", "--model.moe.interleave_moe_layer_step", "3"))
    assert dense.moe == MoEArgs(num_experts=4) and dense.n_moe_layers == 2
    assert config_model_args(_config("--model.flavor", "debug_moe", "--model.moe.num_experts", "0")).moe is None


@pytest.mark.parametrize("args, message", [
    (["--model.moe.top_k", "2"], "model.moe.top_k is set but the model has no experts"),
    (["--model.flavor", "debug_moe", "--model.moe.top_k", "9"], "top_k must be in 1..num_experts (8)"),
    (["--model.flavor", "debug_moe", "--model.moe.aux_loss_coeff", "-1"], "must be >= 0"),
    (["--model.flavor", "debug_moe", "--model.moe.hidden_dim", "99", "--parallelism.tensor_parallel_degree", "2"],
     "must divide the experts' hidden size (99)"),
    (["--model.flavor", "debug_moe", "--parallelism.tensor_parallel_degree", "2", "--model.converters",
      "quantize.linear.float8"], "does not convert a mixture of experts' shared experts"),
    (["--model.flavor", "debug_moe", "--model.moe.aux_loss_coeff", "0.01",
      "--parallelism.context_parallel_degree", "2"], "per-sequence loss"),
    (["--model.flavor", "debug_moe", "--parallelism.expert_parallel_degree", "3"], "must divide the number of experts"),
    (["--model.flavor", "debug_moe", "--parallelism.expert_parallel_degree", "4"], "must divide data_parallel_shard"),
    (["--parallelism.expert_parallel_degree", "2"], "has none"),
    (["--model.flavor", "debug_moe", "--parallelism.expert_tensor_parallel_degree", "2"],
     "expert_tensor_parallel_degree (2) must be 1 or tensor_parallel_degree (1)"),
    (["--model.flavor", "debug_moe", "--model.converters", "quantize.grouped_mm.float8",
      "--quantize.grouped_mm.float8.fqns", "experts"], 'quantize.grouped_mm.float8.fqns = ["experts"]'),
])
def test_config_refusals(args, message):
    config = load_config(["--job.config_file", "train_configs/debug_model.toml", *args])
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(config, world_size=2)


def test_expert_parallel_with_tensor_parallel_splits_the_experts_over_tp():
    """With both, each rank's experts are split over the TP ranks (torchtitan's ETP = TP); its default ETP = 1,
    which lends the TP ranks to expert parallel instead, is refused rather than run as the other layout."""
    layout = ["--job.config_file", "train_configs/debug_model.toml", "--model.flavor", "debug_moe",
              "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"]
    with pytest.raises(ConfigError, match=re.escape("expert_tensor_parallel_degree (1) must equal tensor_parallel")):
        validate(load_config(layout), world_size=4)
    validate(load_config([*layout, "--parallelism.expert_tensor_parallel_degree", "2"]), world_size=4)
    with pytest.raises(ConfigError, match="expert parallel with both context and tensor parallel"):
        validate(load_config([*layout, "--parallelism.expert_tensor_parallel_degree", "2", "--model.moe.aux_loss_coeff",
                              "0", "--parallelism.context_parallel_degree", "2"]), world_size=8)
    validate(load_config(layout[:-2]), world_size=2)  # TP alone splits the experts whatever ETP says


def test_a_misspelt_choice_gets_a_suggestion():
    with pytest.raises(ConfigError, match=re.escape("got 'softmx' (did you mean 'softmax'?)")):
        load_config(["--model.flavor", "debug_moe", "--model.moe.score_func", "softmx"])


def _imbalance(records, steps) -> float:
    return sum(records[s]["moe_load_imbalance"] for s in steps) / len(steps)


@pytest.mark.slow
def test_expert_bias_evens_the_load_over_100_steps(tmp_path, monkeypatch, capsys):
    """debug_moe (one block at its full width, 4 x 32 tokens a step) for 100 steps with and without the expert
    bias: with it the load ends closer to even than where it started, and than without it."""
    runs = {}
    for name, coeff in (("bias", "0.01"), ("none", "0")):
        rc, _ = train_in_process(tmp_path / name, "--model.flavor", "debug_moe", "--training.steps", "100",
                                 "--model.moe.load_balance_coeff", coeff, "--checkpoint.enable", "false",
                                 "--lr_scheduler.decay_type", "constant", "--model.n_layers", "1", *FULL_WIDTH,
                                 "--training.seq_len", "32", "--metrics.log_freq", "5", monkeypatch=monkeypatch)
        assert rc == 0
        runs[name] = {r["step"]: r for r in read_metrics(tmp_path / name)}
    first, last = (1, 5), range(80, 101, 5)
    before, after, unbalanced = (_imbalance(runs["bias"], first), _imbalance(runs["bias"], last),
                                 _imbalance(runs["none"], last))
    with capsys.disabled():
        print(f"\nload imbalance (max/mean): steps 1, 5 {before:.3f}; steps 80-100 {after:.3f} with the bias, "
              f"{unbalanced:.3f} without")
    assert after < before and after < unbalanced


def test_exact_resume_restores_the_expert_bias(tmp_path, monkeypatch):
    """Step 3's checkpoint resumed to step 6 gives the straight run's losses and MoE counts bit for bit (the
    expert bias is in the checkpoint)."""
    common = ["--model.flavor", "debug_moe", "--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval",
              "3", "--checkpoint.last_save_model_only", "false", "--lr_scheduler.decay_type", "constant",
              "--model.moe.aux_loss_coeff", "0.01", "--model.moe.load_balance_coeff", "0.01"]
    assert train_in_process(tmp_path / "straight", *common, monkeypatch=monkeypatch)[0] == 0
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-3", tmp_path / "resumed" / "checkpoint" / "step-3")
    rc, log = train_in_process(tmp_path / "resumed", *common, monkeypatch=monkeypatch)
    assert rc == 0 and "step-3 loaded" in log
    straight = {r["step"]: r for r in read_metrics(tmp_path / "straight")}
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "resumed")}
    keys = ("loss", "grad_norm", "moe_aux_loss", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max")
    for step in (4, 5, 6):
        assert {k: resumed[step][k] for k in keys} == {k: straight[step][k] for k in keys}, step
    assert straight[6]["moe_aux_loss"] > 0


def test_plan_says_active_and_total_parameters_and_what_expert_parallel_changes():
    """Scout's shape on 64 GPUs: total and active parameters; under EP 8 a block's all-gather holds 2 of the 16
    experts (less gathered memory) and the all-to-alls are counted."""
    from trainer.tools.plan.cli import format_report, plan

    def planned(*args):
        config = load_config(["--job.config_file", "train_configs/llama4_17bx16e.toml", *args], env={})
        return plan(config, 64)

    fsdp, ep = planned(), planned("--parallelism.expert_parallel_degree", "8")
    m = fsdp["model"]
    assert (m["params"], m["params_active"]) == (107_769_861_120, 17_172_894_720)
    assert "active per token 17,172,894,720" in format_report(fsdp)
    gathered = fsdp["configured"]["estimate_gib"]["weight_copies"], ep["configured"]["estimate_gib"]["weight_copies"]
    assert gathered[1] < gathered[0] / 2
    assert ep["expert_parallel"]["experts_per_rank"] == 2 and "expert_parallel" not in fsdp
    assert ep["expert_parallel"]["all_to_all_gib_per_block"]["forward"] > 0
