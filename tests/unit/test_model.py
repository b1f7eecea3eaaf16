"""Tests of trainer.models (Llama transformer, flavors, parameter and FLOP counts)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.support.models import seeded_model
from trainer.models.config import get_model_args
from trainer.models.llama.args import LlamaModelArgs
from trainer.models.llama.flavors import LLAMA_FLAVORS
from trainer.models.llama.flops import count_params, flops_per_token, model_num_params
from trainer.models.llama.model import Transformer, build_llama
from trainer.models.llama.args import RopeScaling
from trainer.models.llama.model import Attention, apply_rotary_emb, precompute_rope_cache

EXPECTED_FLAVORS = {
    "debug_gqa",
    "debugmodel",
    "llama2_7b",
    "llama2_13b",
    "llama2_70b",
    "llama3_1b",
    "llama3_3b",
    "llama3_8b",
    "llama3_70b",
    "llama3_405b",
    "debug_moe",
    "llama4_debugmodel",
    "llama4_17bx16e",
    "llama4_17bx128e",
}


def tiny_args(**overrides) -> LlamaModelArgs:
    base = dict(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=128,
        multiple_of=32,
        rope_theta=10000.0,
        max_seq_len=64,
    )
    base.update(overrides)
    return LlamaModelArgs(**base)


# ----------------------------------------------------------------------------- forward


def test_forward_shape_and_parameter_names():
    args = get_model_args("llama", "debug_gqa")
    args = dataclasses.replace(args, vocab_size=2048)
    model = seeded_model(args)
    tokens = torch.randint(0, 2048, (2, 32))
    logits = model(tokens)
    assert logits.shape == (2, 32, 2048)
    assert logits.dtype == model.output.weight.dtype
    assert torch.isfinite(logits).all()

    names = set(dict(model.named_parameters()))
    for expected in [
        "tok_embeddings.weight",
        "layers.0.attention_norm.weight",
        "layers.3.attention.wq.weight",
        "layers.3.attention.wk.weight",
        "layers.3.attention.wv.weight",
        "layers.3.attention.wo.weight",
        "layers.5.ffn_norm.weight",
        "layers.3.feed_forward.w1.weight",
        "layers.3.feed_forward.w2.weight",
        "layers.3.feed_forward.w3.weight",
        "norm.weight",
        "output.weight",
    ]:
        assert expected in names, expected
    assert isinstance(model.layers, torch.nn.ModuleDict)
    assert list(model.layers.keys()) == [str(i) for i in range(6)]
    # The RoPE table is a non-persistent buffer: never checkpointed.
    assert not any("rope" in k for k in model.state_dict())
    assert model.rope_cache.shape == (args.max_seq_len, args.head_dim // 2, 2)
    assert model.layers["0"].attention.wk.weight.shape == (4 * 16, 256)
    assert model.layers["0"].feed_forward.w1.weight.shape == (768, 256)


def test_backward_gives_finite_grads_everywhere():
    model = seeded_model(tiny_args())
    tokens = torch.randint(0, 128, (2, 16))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_causality():
    model = seeded_model(tiny_args())
    tokens = torch.randint(0, 128, (2, 24))
    t = 10
    changed = tokens.clone()
    changed[:, t] = (tokens[:, t] + 1) % 128
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    # ...while position t and later do change.
    assert (a[:, t] - b[:, t]).abs().max() > 1e-3
    assert (a[:, -1] - b[:, -1]).abs().max() > 1e-3


def test_gqa_matches_mha_with_repeated_kv_heads():
    """A GQA model equals an MHA model whose k/v heads are the GQA heads repeated, with query
    head h using kv head h // (n_heads // n_kv_heads)."""
    gqa_args = tiny_args(n_heads=8, n_kv_heads=2)
    gqa = seeded_model(gqa_args)
    mha = seeded_model(dataclasses.replace(gqa_args, n_kv_heads=None))
    n_rep, hd = 4, gqa_args.head_dim
    sd = gqa.state_dict()
    for key, value in sd.items():
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            heads = value.view(2, hd, -1)
            sd[key] = heads.repeat_interleave(n_rep, dim=0).reshape(8 * hd, -1)
    mha.load_state_dict(sd)
    assert gqa.layers["0"].attention.wk.weight.shape == (2 * hd, 64)
    assert mha.layers["0"].attention.wk.weight.shape == (8 * hd, 64)
    tokens = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_attention_works_with_tensor_parallel_sharded_heads():
    """Split heads over two 'ranks' like a colwise/rowwise TP plan: each local module holds
    half of the q and kv heads (and the matching columns of wo); the partial outputs sum to
    the full output. The module must infer its local head counts from the weight shapes."""
    args = tiny_args(n_heads=4, n_kv_heads=2)
    torch.manual_seed(0)
    full = Attention(args)
    full.init_weights()
    hd = args.head_dim
    x = torch.randn(2, 12, args.dim)
    rope = precompute_rope_cache(hd, args.max_seq_len, args.rope_theta)
    with torch.no_grad():
        expected = full(x, rope)
        total = torch.zeros_like(expected)
        for rank in range(2):
            local = Attention(args)
            q_rows = slice(rank * 2 * hd, (rank + 1) * 2 * hd)
            kv_rows = slice(rank * hd, (rank + 1) * hd)
            local.wq.weight = torch.nn.Parameter(full.wq.weight[q_rows].clone())
            local.wk.weight = torch.nn.Parameter(full.wk.weight[kv_rows].clone())
            local.wv.weight = torch.nn.Parameter(full.wv.weight[kv_rows].clone())
            local.wo.weight = torch.nn.Parameter(full.wo.weight[:, q_rows].clone())
            total += local(x, rope)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_pipeline_stages_compose_to_full_model():
    args = tiny_args(n_layers=4)
    full = seeded_model(args)
    stage0 = seeded_model(args)
    stage1 = seeded_model(args)
    for i in ("2", "3"):
        del stage0.layers[i]
    stage0.norm = None
    stage0.output = None
    for i in ("0", "1"):
        del stage1.layers[i]
    stage1.tok_embeddings = None
    # Surviving parameter names are unchanged.
    assert "layers.3.attention.wq.weight" in dict(stage1.named_parameters())
    assert "layers.0.attention.wq.weight" not in dict(stage1.named_parameters())
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        hidden = stage0(tokens)
        assert hidden.shape == (2, 16, args.dim)
        torch.testing.assert_close(stage1(hidden), full(tokens))
    # Each stage can initialise what it holds.
    stage0.init_weights()
    stage1.init_weights()
    assert model_num_params(stage0) + model_num_params(stage1) == count_params(args)


# ----------------------------------------------------------------------------- KV cache


def test_kv_cache_incremental_forward_equals_training_forward():
    """Prompt at positions 0..9, then one token at a time from the cache: the training forward's logits."""
    model = seeded_model(tiny_args()).eval()
    tokens = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        ref = model(tokens)
        model.setup_kv_cache(2, 24)
        parts = [model(tokens[:, :10], input_pos=torch.arange(10))]
        for t in range(10, 24):
            parts.append(model(tokens[:, t:t + 1], input_pos=torch.tensor([t])))
    torch.testing.assert_close(torch.cat(parts, dim=1), ref, rtol=1e-5, atol=1e-5)


def test_kv_cache_rows_at_their_own_positions():
    """With per-row positions ([B, S]) each row decodes as if it were alone; padding slots past a row's
    end are overwritten before any query can see them."""
    model = seeded_model(tiny_args()).eval()
    short, long = torch.randint(0, 128, (1, 9)), torch.randint(0, 128, (1, 14))
    batch = torch.zeros(2, 14, dtype=torch.long)
    batch[0, :6], batch[1] = short[0, :6], long[0]  # row 0: a 6-token prompt, right-padded
    with torch.no_grad():
        model.setup_kv_cache(2, 17)
        model(batch, input_pos=torch.arange(14))
        pos = torch.tensor([[6], [14]])
        for step in range(3):  # row 0 continues with its own tokens 6, 7, 8 over the padding slots
            step_tokens = torch.stack([short[0, 6 + step], long[0, 13]])[:, None]
            logits = model(step_tokens, input_pos=pos + step)
        model.clear_kv_cache()
        torch.testing.assert_close(logits[0, -1], model(short)[0, -1], rtol=1e-5, atol=1e-5)


def test_kv_cache_is_absent_unless_set_up():
    model = seeded_model(tiny_args())
    keys = set(model.state_dict())
    buffers = {name for name, _ in model.named_buffers()}
    assert all(layer.attention.kv_cache is None for layer in model.layers.values())
    model.setup_kv_cache(3, 32)
    cache = model.layers["0"].attention.kv_cache
    assert cache.k.shape == (3, 32, 2, 16) and cache.k.dtype == torch.float32
    assert set(model.state_dict()) == keys  # never in a checkpoint
    model.clear_kv_cache()
    assert {name for name, _ in model.named_buffers()} == buffers
    with pytest.raises(RuntimeError, match="setup_kv_cache"):
        model(torch.zeros(1, 4, dtype=torch.long), input_pos=torch.arange(4))
    with pytest.raises(ValueError, match="RoPE table"):
        model.setup_kv_cache(1, 65)


# ----------------------------------------------------------------------------- init


def test_meta_build_materialises_deterministically():
    args = tiny_args(n_layers=3)
    with torch.device("meta"):
        meta_model = Transformer(args)
    assert meta_model.layers["0"].attention.wq.weight.is_meta
    assert model_num_params(meta_model) == count_params(args)
    meta_model.to_empty(device="cpu")
    torch.manual_seed(1234)
    meta_model.init_weights(buffer_device=None)

    cpu_model = Transformer(args)
    torch.manual_seed(1234)
    cpu_model.init_weights()

    sd_a, sd_b = meta_model.state_dict(), cpu_model.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for key in sd_a:
        assert torch.equal(sd_a[key], sd_b[key]), key
    assert meta_model.rope_cache.device.type == "cpu"
    torch.testing.assert_close(meta_model.rope_cache, cpu_model.rope_cache, rtol=0, atol=0)

    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        out = meta_model(tokens)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, cpu_model(tokens).detach(), rtol=0, atol=0)

    # A different seed gives different weights.
    torch.manual_seed(4321)
    cpu_model.init_weights()
    assert not torch.equal(cpu_model.layers["0"].attention.wq.weight, sd_a["layers.0.attention.wq.weight"])


def test_init_statistics():
    args = dataclasses.replace(LLAMA_FLAVORS["debug_gqa"], vocab_size=2048)
    model = seeded_model(args)
    std = lambda t: t.detach().float().std().item()  # noqa: E731
    assert std(model.tok_embeddings.weight) == pytest.approx(1.0, rel=0.02)
    assert std(model.layers["0"].attention.wq.weight) == pytest.approx(0.02, rel=0.05)
    assert std(model.layers["0"].feed_forward.w1.weight) == pytest.approx(0.02, rel=0.05)
    for layer_id in (0, 5):
        depth_std = 0.02 / math.sqrt(2 * (layer_id + 1))
        layer = model.layers[str(layer_id)]
        assert std(layer.attention.wo.weight) == pytest.approx(depth_std, rel=0.05)
        assert std(layer.feed_forward.w2.weight) == pytest.approx(depth_std, rel=0.05)
        assert layer.attention.wo.weight.abs().max() <= 3 * depth_std + 1e-7
    out_std = args.dim**-0.5
    assert std(model.output.weight) == pytest.approx(out_std, rel=0.05)
    assert model.output.weight.abs().max() <= 3 * out_std + 1e-7
    assert torch.equal(model.norm.weight, torch.ones(args.dim))
    assert torch.equal(model.layers["2"].ffn_norm.weight, torch.ones(args.dim))


def test_to_bfloat16_keeps_float32_rope_table():
    model = seeded_model(tiny_args())
    expected = model.rope_cache.clone()
    model.to(torch.bfloat16)
    assert model.layers["0"].attention.wq.weight.dtype == torch.bfloat16
    assert model.rope_cache.dtype == torch.float32
    torch.testing.assert_close(model.rope_cache, expected, rtol=0, atol=0)
    assert model(torch.randint(0, 128, (1, 8))).dtype == torch.bfloat16


# ----------------------------------------------------------------------------- tying


def test_tied_embeddings_share_storage():
    args = tiny_args(tie_word_embeddings=True)
    model = seeded_model(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert model_num_params(model) == count_params(args)
    assert count_params(args) == count_params(tiny_args()) - args.vocab_size * args.dim
    # Shared init follows the output layer (std dim**-0.5), not the std-1 embedding.
    assert model.tok_embeddings.weight.std().item() == pytest.approx(args.dim**-0.5, rel=0.1)

    # An update through one module is seen by the other.
    with torch.no_grad():
        model.tok_embeddings.weight[3].fill_(7.0)
    assert torch.all(model.output.weight[3] == 7.0)

    # Gradients from both uses accumulate into the single parameter.
    model.zero_grad()
    tokens = torch.randint(0, 128, (2, 8))
    model(tokens).sum().backward()
    assert model.output.weight.grad is model.tok_embeddings.weight.grad

    # The tie survives a meta build + to_empty.
    with torch.device("meta"):
        meta_model = Transformer(args)
    meta_model.to_empty(device="cpu")
    assert meta_model.output.weight is meta_model.tok_embeddings.weight
    meta_model.init_weights()
    assert meta_model.output.weight.data_ptr() == meta_model.tok_embeddings.weight.data_ptr()


# ----------------------------------------------------------------------------- RoPE


def test_rope_follows_interleaved_pair_convention():
    """Compare with Meta's complex formulation: pairs (2i, 2i+1) are complex numbers
    multiplied by exp(1j * p * theta**(-2i/d))."""
    head_dim, seqlen, theta = 16, 12, 10000.0
    x = torch.randn(2, seqlen, 3, head_dim, dtype=torch.float64)
    cache = precompute_rope_cache(head_dim, 32, theta)
    got = apply_rotary_emb(x.float(), cache).double()

    freqs = torch.tensor([theta ** (-2 * i / head_dim) for i in range(head_dim // 2)], dtype=torch.float64)
    angles = torch.arange(seqlen, dtype=torch.float64)[:, None] * freqs[None, :]
    rot = torch.polar(torch.ones_like(angles), angles)  # [seq, d/2]
    xc = torch.view_as_complex(x.reshape(2, seqlen, 3, head_dim // 2, 2).contiguous())
    expected = torch.view_as_real(xc * rot[None, :, None, :]).reshape(2, seqlen, 3, head_dim)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Position 0 is the identity; pair (0, 1) at position 1 rotates by exactly 1 radian.
    torch.testing.assert_close(got[:, 0], x[:, 0].float().double(), rtol=0, atol=1e-6)
    assert cache[1, 0, 0].item() == pytest.approx(math.cos(1.0), abs=1e-7)
    assert cache[1, 0, 1].item() == pytest.approx(math.sin(1.0), abs=1e-7)


def test_rope_llama31_scaling_each_band():
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    head_dim, theta, pos = 128, 500000.0, 5000
    cache = precompute_rope_cache(head_dim, pos + 1, theta, scaling)
    unscaled = precompute_rope_cache(head_dim, pos + 1, theta, None)

    seen = set()
    for i in range(head_dim // 2):
        f = theta ** (-2 * i / head_dim)
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:  # high frequency: unchanged
            band, expected_f = "high", f
        elif wavelen > 8192 / 1.0:  # low frequency: divided by the factor
            band, expected_f = "low", f / 8.0
        else:  # in between: interpolate with weight (8192/wavelen - 1) / (4 - 1)
            w = (8192 / wavelen - 1.0) / 3.0
            band, expected_f = "medium", (1 - w) * f / 8.0 + w * f
        seen.add(band)
        tol = _f32_angle_error(pos * expected_f)
        assert cache[pos, i, 0].item() == pytest.approx(math.cos(pos * expected_f), abs=tol), (i, band)
        assert cache[pos, i, 1].item() == pytest.approx(math.sin(pos * expected_f), abs=tol), (i, band)
    assert seen == {"low", "medium", "high"}

    # Spot values, hand-computed: i = 0 (f = 1, high band), i = 63 (low band) and i = 32
    # (f = 500000**-0.5, wavelength 4442.9, medium band).
    assert cache[pos, 0, 1].item() == pytest.approx(math.sin(5000.0), abs=_f32_angle_error(5000.0))
    f63 = 500000.0 ** (-126 / 128)
    assert cache[pos, 63, 1].item() == pytest.approx(math.sin(5000 * f63 / 8), abs=2e-6)
    f32 = 500000.0**-0.5
    w = (8192 * f32 / (2 * math.pi) - 1) / 3
    assert 0 < w < 1
    assert cache[pos, 32, 0].item() == pytest.approx(math.cos(5000 * f32 * (w + (1 - w) / 8)), abs=2e-6)
    # The scaling really changed the low/medium bands and left the high band alone (up to float32 angles).
    torch.testing.assert_close(cache[:, :20], unscaled[:, :20], rtol=0, atol=_f32_angle_error(pos))
    assert not torch.allclose(cache[pos, 40:], unscaled[pos, 40:])


def _f32_angle_error(angle: float) -> float:
    """Bound on the error of cos/sin of a float32 angle ``p * f`` (a scaled table's, as torchtitan computes
    it): ``f`` and the product are each rounded to float32 (2**-24 relative each), plus the cos/sin rounding."""
    return abs(angle) * 2**-22 + 1e-6


def test_flavor_rope_scaling():
    assert LLAMA_FLAVORS["llama3_8b"].rope_scaling.factor == 8.0
    assert LLAMA_FLAVORS["llama3_1b"].rope_scaling.factor == 32.0
    assert LLAMA_FLAVORS["llama3_3b"].rope_scaling.factor == 32.0
    assert LLAMA_FLAVORS["llama2_7b"].rope_scaling is None
    assert LLAMA_FLAVORS["llama3_8b"].rope_theta == 500000.0


# torchtitan v0.2.2's llama3 flavors (torchtitan/models/llama3/__init__.py and model/args.py), every field
# that shapes the model, with its TransformerModelArgs defaults written out: vocab_size 128256,
# multiple_of 256, norm_eps 1e-5, RoPEScalingArgs() = (8, 1, 4, 8192) applied to every flavor, max_seq_len
# 131072 (replaced by training.seq_len at run time, in both trainers).
TORCHTITAN_V022_LLAMA3 = {
    "debugmodel": dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048, multiple_of=256,
                       ffn_dim_multiplier=None, rope_theta=500000.0),
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
               ffn_dim_multiplier=1.3, rope_theta=500000.0),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                ffn_dim_multiplier=1.3, rope_theta=500000.0),
    "405B": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, multiple_of=4096,
                 ffn_dim_multiplier=1.2, rope_theta=500000.0),
}


@pytest.mark.parametrize("flavor", sorted(TORCHTITAN_V022_LLAMA3))
def test_torchtitan_named_flavors_are_torchtitans_models(flavor):
    """A flavor under a torchtitan name is torchtitan's model key for key, RoPE scaling included."""
    args = get_model_args("llama3", flavor)
    theirs = TORCHTITAN_V022_LLAMA3[flavor]
    ours = {k: getattr(args, k) for k in theirs if k != "n_kv_heads"} | {"n_kv_heads": args.num_kv_heads}
    assert ours == theirs
    assert (args.norm_eps, args.max_seq_len, args.tie_word_embeddings, args.ffn_dim) == (1e-5, 131072, False, None)
    assert args.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=8192)


def test_debugmodel_rope_table_is_torchtitans_scaled_one():
    """torchtitan's debugmodel (head_dim 16, theta 5e5) scales its four slowest frequencies: the RoPE table
    differs from the unscaled debug_gqa's there, and equals the independent Llama 3.1 formula."""
    tt, ours = LLAMA_FLAVORS["debugmodel"], LLAMA_FLAVORS["debug_gqa"]
    assert ours.rope_scaling is None and ours.num_kv_heads == 4  # this trainer's debug model is unchanged
    scaled = precompute_rope_cache(tt.head_dim, 4096, tt.rope_theta, tt.rope_scaling)
    plain = precompute_rope_cache(ours.head_dim, 4096, ours.rope_theta, ours.rope_scaling)
    pos = 4095
    for i in range(8):
        f = 500000.0 ** (-2 * i / 16)
        w = (8192 * f / (2 * math.pi) - 1) / 3  # 1 or more: high band; 0 or less: low band
        expected = f if w >= 1 else f / 8 if w <= 0 else (1 - w) * f / 8 + w * f
        assert scaled[pos, i, 1].item() == pytest.approx(math.sin(pos * expected), abs=_f32_angle_error(pos)), i
    torch.testing.assert_close(scaled[:, :4], plain[:, :4], rtol=0, atol=_f32_angle_error(pos))
    assert not torch.allclose(scaled[:, 4:], plain[:, 4:])


@pytest.mark.parametrize("flavor", ["debugmodel", "llama3_8b"])
def test_scaled_rope_table_equals_torchtitans_float32_formula_bit_for_bit(flavor):
    """torchtitan v0.2.2's ``precompute_freqs_cis`` (and Meta's reference), written out here: frequencies,
    Llama 3.1 scaling and angles in float32, cos + i sin by ``torch.polar``. A scaled table equals it bit for
    bit, which is what makes torchtitan's flavors train to torchtitan's losses bit for bit."""
    args = LLAMA_FLAVORS[flavor]
    s, d, n = args.rope_scaling, args.head_dim, 2048
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2)[: d // 2].float() / d))
    wavelen = 2 * math.pi / freqs
    low = s.original_max_position_embeddings / s.low_freq_factor  # longer wavelengths: divided by the factor
    high = s.original_max_position_embeddings / s.high_freq_factor  # shorter ones: unchanged
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    freqs = torch.where(wavelen > low, freqs / s.factor, freqs)
    freqs = torch.where((wavelen >= high) & (wavelen <= low), (1 - smooth) * freqs / s.factor + smooth * freqs, freqs)
    angles = torch.outer(torch.arange(n), freqs)
    assert angles.dtype == torch.float32
    expected = torch.view_as_real(torch.polar(torch.ones_like(angles), angles))
    assert torch.equal(precompute_rope_cache(d, n, args.rope_theta, s), expected)
    # The test can tell: the same formula with float64 angles, rounded once, differs in many entries.
    wide = torch.outer(torch.arange(n, dtype=torch.float64), freqs.double())
    assert (torch.stack((wide.cos(), wide.sin()), dim=-1).float() != expected).float().mean() > 0.1


# ----------------------------------------------------------------------------- counts


def test_flavor_names_and_debug_gqa_tp_float8_friendly():
    assert set(LLAMA_FLAVORS) == EXPECTED_FLAVORS
    dbg = LLAMA_FLAVORS["debug_gqa"]
    assert dbg.vocab_size == -1  # from the tokenizer
    assert dbg.n_heads % 4 == 0 and dbg.num_kv_heads % 4 == 0 and dbg.n_heads > dbg.num_kv_heads
    for d in (dbg.dim, dbg.n_heads * dbg.head_dim, dbg.num_kv_heads * dbg.head_dim, dbg.ffn_hidden_dim):
        assert d % (16 * 4) == 0, d  # divisible by 16 even after TP-4 sharding


@pytest.mark.parametrize(
    "flavor, ffn_hidden",
    [
        ("llama2_7b", 11008),
        ("llama2_13b", 13824),
        ("llama2_70b", 28672),
        ("llama3_1b", 8192),
        ("llama3_3b", 8192),
        ("llama3_8b", 14336),
        ("llama3_70b", 28672),
        ("llama3_405b", 53248),
    ],
)
def test_published_ffn_hidden_dims(flavor, ffn_hidden):
    assert LLAMA_FLAVORS[flavor].ffn_hidden_dim == ffn_hidden


def test_count_params_exact():
    assert count_params(LLAMA_FLAVORS["llama2_7b"]) == 6_738_415_616
    assert count_params(LLAMA_FLAVORS["llama3_8b"]) == 8_030_261_248


@pytest.mark.parametrize(
    "flavor, published",
    [
        ("llama2_13b", 13_015_864_320),
        ("llama2_70b", 68_976_648_192),
        ("llama3_1b", 1_235_814_400),
        ("llama3_3b", 3_212_749_824),
        ("llama3_70b", 70_553_706_496),
        ("llama3_405b", 405_853_388_800),
    ],
)
def test_count_params_close_to_published(flavor, published):
    assert count_params(LLAMA_FLAVORS[flavor]) == pytest.approx(published, rel=1e-3)


@pytest.mark.parametrize("flavor", sorted(EXPECTED_FLAVORS - {"debug_gqa", "debug_moe"}))
def test_model_num_params_on_meta_matches_formula(flavor):
    args = dataclasses.replace(LLAMA_FLAVORS[flavor], max_seq_len=16)
    with torch.device("meta"):
        model = Transformer(args)
    assert model_num_params(model) == count_params(args)
    assert model_num_params(model, exclude_embedding=True) == count_params(args, exclude_embedding=True)


def test_exclude_embedding():
    args = LLAMA_FLAVORS["llama3_8b"]
    assert count_params(args) - count_params(args, exclude_embedding=True) == 128256 * 4096
    tied = LLAMA_FLAVORS["llama3_1b"]  # the shared matrix is the output projection
    assert count_params(tied, exclude_embedding=True) == count_params(tied)


def test_flops_per_token_by_hand():
    # Llama 3.1 8B at seq_len 8192. Non-embedding params: total minus the input embedding,
    # keeping the 4096 x 128256 output projection.
    n = 8_030_261_248 - 128_256 * 4_096
    assert n == 7_504_924_672
    attention = 12 * 32 * 32 * 128 * 8192  # 12 * L * H * Q * T
    assert flops_per_token(LLAMA_FLAVORS["llama3_8b"], 8192) == 6 * n + attention == 57_914_449_920
    # Debug model with a 2048-token vocabulary at seq_len 256, from the shapes directly.
    dbg = dataclasses.replace(LLAMA_FLAVORS["debug_gqa"], vocab_size=2048)
    per_layer = 256 * 256 * 2 + 256 * 64 * 2 + 3 * 256 * 768 + 2 * 256
    n_dbg = 6 * per_layer + 256 + 2048 * 256
    assert flops_per_token(dbg, 256) == 6 * n_dbg + 12 * 6 * 16 * 16 * 256


# ----------------------------------------------------------------------------- registry


def test_get_model_args_and_errors():
    args = get_model_args("llama3", "8b")
    assert args == LLAMA_FLAVORS["llama3_8b"]
    args.dim = 1  # a copy: the registry is untouched
    assert LLAMA_FLAVORS["llama3_8b"].dim == 4096
    assert get_model_args("llama", "debug_gqa").dim == 256
    with pytest.raises(ValueError, match="llama3_8b"):
        get_model_args("llama", "llama3_9b")
    with pytest.raises(ValueError, match="valid models"):
        get_model_args("gpt", "debug_gqa")
    with pytest.raises(ValueError, match="vocab_size"):
        build_llama("debug_gqa")  # vocab -1 must come from the tokenizer
    assert build_llama("debug_gqa", vocab_size=64, max_seq_len=32).output.weight.shape == (64, 256)
    with pytest.raises(ValueError):
        LlamaModelArgs(dim=64, n_heads=4, n_kv_heads=3)


def test_fewer_layer_flavor_is_a_new_args_object():
    before = dict(LLAMA_FLAVORS)
    args = get_model_args("llama3", "8b_4l")
    assert args == dataclasses.replace(LLAMA_FLAVORS["llama3_8b"], n_layers=4)
    assert get_model_args("llama", "llama3_8b_4l") == args
    assert LLAMA_FLAVORS == before and LLAMA_FLAVORS["llama3_8b"].n_layers == 32  # the table is never changed
    with pytest.raises(ValueError, match="<flavor>_<N>l"):
        get_model_args("llama", "nope_4l")


def _config(*argv):
    from trainer.config import load_config

    return load_config(list(argv), env={})


def test_resolve_model_args_vocab_and_seq_len():
    from trainer.errors import ConfigError
    from trainer.models.config import resolve_model_args

    # debug_gqa: vocabulary from the tokenizer, rounded up to a multiple of 64; RoPE table at seq_len.
    args = resolve_model_args(_config("--model.flavor", "debug_gqa", "--training.seq_len", "128"), 2000)
    assert args == dataclasses.replace(LLAMA_FLAVORS["debug_gqa"], vocab_size=2048, max_seq_len=128)
    # A published flavor keeps its vocabulary; model.vocab_size overrides both.
    assert resolve_model_args(_config("--model.flavor", "llama3_8b"), None).vocab_size == 128256
    assert resolve_model_args(_config("--model.flavor", "llama3_8b", "--model.vocab_size", "130000"),
                              128256).vocab_size == 130000
    assert resolve_model_args(_config("--model.flavor", "llama3_8b_2l"), None).n_layers == 2
    for argv, vocab, match in [
        (["--model.flavor", "llama3_9b"], None, "model.flavor: unknown flavor 'llama3_9b'"),
        (["--model.flavor", "debug_gqa"], None, "takes its vocabulary size from the tokenizer"),
        (["--model.flavor", "llama2_7b", "--model.name", "llama2"], 128256, "32000 embedding rows"),
    ]:
        with pytest.raises(ConfigError, match=match):
            resolve_model_args(_config(*argv), vocab)
