"""trainer plan: its parameter and FLOP numbers are the model's own, and its memory arithmetic is checked by
hand on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.config import load_config
from trainer.models.llama.args import LlamaModelArgs
from trainer.models.llama.flops import count_params, flops_per_token, model_num_params
from trainer.models.llama.model import Transformer
from trainer.tools.plan.cli import main, model_args_for_plan, plan
from trainer.tools.plan.memory import (Layout, Precision, Shape, checkpoint_staging_bytes, layer_bytes, memory_estimate,
                                       search_layouts)
from trainer.models.config import resolve_model_args
from trainer.data.tokenizer import load_tokenizer

from tests.support.launch import ROOT

CONFIGS = {
    "debug_gqa": ROOT / "train_configs" / "debug_model.toml",
    "llama3_8b": ROOT / "train_configs" / "llama3_8b.toml",
}


@pytest.mark.parametrize("flavor", ["debug_gqa", "llama3_8b", "llama2_7b"])
def test_plan_counts_match_model(flavor, capsys):
    config_file = CONFIGS.get(flavor, CONFIGS["debug_gqa"])
    overrides = [] if flavor in CONFIGS else ["--model.name", "llama2", "--model.flavor", flavor]
    config = load_config(["--job.config_file", str(config_file), *overrides], env={})
    args, _ = model_args_for_plan(config)
    tokenizer_vocab = load_tokenizer(config).vocab_size if config.model.tokenizer_path == "" else None
    expected_args = resolve_model_args(config, tokenizer_vocab)
    assert args == expected_args
    with torch.device("meta"):
        meta = model_num_params(Transformer(args))

    result = plan(config, ngpu=8, gpu="H100")
    m = result["model"]
    assert m["params"] == count_params(args) == meta
    assert m["params_meta_model"] == meta
    assert m["params_non_embedding"] == count_params(args, exclude_embedding=True)
    assert m["flops_per_token"] == flops_per_token(args, config.training.seq_len)
    if flavor == "llama3_8b":
        assert m["params"] == 8_030_261_248  # the published Llama 3.1 8B size
    if flavor == "llama2_7b":
        assert m["params"] == 6_738_415_616  # the published Llama 2 7B size

    # The CLI prints the same numbers (text and JSON).
    assert main(["--config", str(config_file), "--ngpu", "8", *overrides]) == 0
    text = capsys.readouterr().out
    assert f"{m['params']:,}" in text and f"{m['flops_per_token']:,}" in text
    assert main(["--config", str(config_file), "--ngpu", "8", "--json", *overrides]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["params"] == m["params"] and out["model"]["flops_per_token"] == m["flops_per_token"]


# A tiny model whose numbers can be checked by hand:
# dim 64, 2 layers, 4 heads of 16 (2 kv heads -> kv width 32), vocab 128, SwiGLU hidden
# int(2 * 4 * 64 / 3) = 170 rounded up to a multiple of 64 = 192.
TINY = LlamaModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=64, max_seq_len=8)


def test_tiny_shape_by_hand():
    s = Shape.from_args(TINY)
    assert (s.dim, s.kv_dim, s.ffn, s.vocab) == (64, 32, 192, 128)
    # per layer: wq 64*64 + wk 64*32 + wv 64*32 + wo 64*64 = 12288; w1, w2, w3 3*64*192 = 36864
    assert s.layer_matrices == 12288 + 36864 == 49152
    assert s.layer_norms == 128
    # embedding 128*64 + 2 layers * 49280 + final norm 64 + output 128*64
    assert s.total_params() == 8192 + 2 * 49280 + 64 + 8192 == 115008 == count_params(TINY)


def test_tiny_memory_single_gpu_autocast_by_hand():
    """One GPU, bf16 autocast (fp32 weights and residual stream: r = 4, c = 2), batch 2 x 8 = 16 tokens."""
    s = Shape.from_args(TINY)
    est = memory_estimate(s, Layout(1, 1, 1, 1, local_batch_size=2, seq_len=8, ac="none"))
    assert est["precision"] == "autocast-bf16"
    assert est["params"] == 4 * 115008 == 460032
    assert est["grads"] == 460032
    assert est["optimizer"] == 8 * 115008 == 920064
    # autocast's bf16 copies of the matmul weights: 2 bytes x (2 layers x 49152 + output 128*64)
    assert est["weight_copies"] == 2 * (2 * 49152 + 8192) == 212992
    # per token per layer (fused RMSNorm, as on a GPU):
    #   attention_norm: fp32 input 4*64 + 1/rms 4 + 3 bf16 casts 3*2*64 = 644
    #   ffn_norm:       4*64 + 4 + 2 casts 2*2*64 = 516
    #   attention:      q, SDPA out 2*2*64 + k, v 2*2*32 (2 kv heads, not repeated) + logsumexp 4*4 heads = 400
    #   MLP:            4*2*192 = 1536
    assert layer_bytes(s, Precision("autocast-bf16", 4, 2, False)) == 644 + 516 + 400 + 1536 == 3096
    assert est["activations"] == 3096 * 16 * 2 == 99072
    assert est["recompute"] == 0
    # final norm (one consumer): 4*64 + 4 + 2*64 = 388 per token; loss 12 * 128 = 1536 per token (the logits are freed before backward)
    assert est["final_norm"] == 388 * 16 == 6208
    assert est["loss"] == 1536 * 16 == 24576
    assert est["sum"] == 460032 + 460032 + 920064 + 212992 + 99072 + 6208 + 24576 == 2182976
    # the step's largest moment: backward through the blocks once the gradients (larger than the activations
    # they replace) are all there: params + optimizer + weight casts + gradients
    assert est["total"] == 460032 + 920064 + 212992 + 460032 == 2053120


def test_tiny_memory_fsdp_and_ac_by_hand():
    """FSDP over 2 GPUs (bf16 parameters: r = c = 2), batch 1 x 8 tokens."""
    s = Shape.from_args(TINY)
    est = memory_estimate(s, Layout(1, 2, 1, 1, local_batch_size=1, seq_len=8, ac="none"))
    assert est["precision"] == "fsdp-bf16"
    assert est["params"] == 4 * 115008 / 2
    assert est["optimizer"] == 8 * 115008 / 2
    # two gathered bf16 blocks (4 B/param) + one block's bf16 gradient and fp32 reduce-scatter copy (6 B/param)
    # of a 49280-parameter block, plus the gathered root (embedding + output + final norm) in bf16
    assert est["weight_copies"] == 10 * 49280 + 2 * (8192 + 8192 + 64)
    # per token per layer 12h + 4kv + 8F + 4 n_heads + 8 = 12*64 + 4*32 + 8*192 + 16 + 8 = 2456
    assert layer_bytes(s, Precision("fsdp-bf16", 2, 2, True)) == 2456
    assert est["activations"] == 2456 * 8 * 2
    # full AC: each layer keeps its bf16 input (2*64 per token); one layer is recomputed in backward
    full = memory_estimate(s, Layout(1, 2, 1, 1, 1, 8, ac="full"))
    assert full["activations"] == 2 * 64 * 8 * 2
    assert full["recompute"] == 2456 * 8
    # selective op: input 2h + wq 2h + wv 2*32 + w1 2*192 + w2 2h + SDPA out 2h + logsumexp 4*4
    op = memory_estimate(s, Layout(1, 2, 1, 1, 1, 8, ac="selective_op"))
    assert op["activations"] == (2 * 64 + 2 * 64 + 2 * 32 + 2 * 192 + 2 * 64 + 2 * 64 + 16) * 8 * 2
    # every 2nd block checkpointed: block 0 keeps its input, block 1 everything
    sel2 = memory_estimate(s, Layout(1, 2, 1, 1, 1, 8, ac="selective_2"))
    assert sel2["activations"] == (2 * 64 + 2456) * 8
    # tensor parallel 2 (no FSDP: autocast): matrices halve, norms are replicated
    tp = memory_estimate(s, Layout(1, 1, 2, 1, 1, 8, ac="none"))
    mats = 8192 + 2 * 49152 + 8192
    norms = 2 * 128 + 64
    assert tp["params"] == 4 * (mats / 2 + norms)
    # autocast with full AC: checkpointed blocks do not keep weight casts, the output does
    ac = memory_estimate(s, Layout(1, 1, 1, 1, 1, 8, ac="full"))
    assert ac["weight_copies"] == 2 * 8192


class _Alive:
    """Records every tensor an op creates; afterwards, the bytes still alive (what autograd kept)."""

    def __init__(self):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        made = self.made = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        made[st.data_ptr()] = (StorageWeakRef(st), st.nbytes(), tuple(t.shape))
                return out

        self.mode = Mode()

    def alive_bytes(self, exclude_storages: set[int], exclude_shapes: set[tuple]) -> int:
        return sum(n for ptr, (ref, n, shape) in self.made.items()
                   if not ref.expired() and ptr not in exclude_storages and shape not in exclude_shapes)


@pytest.mark.parametrize("regime", ["float32", "autocast-bf16", "fsdp-bf16"])
@pytest.mark.parametrize("ac", ["none", "selective_op", "full"])
def test_activation_formula_matches_autograd(regime, ac):
    """The per-layer activation bytes of the plan equal what autograd keeps alive after one block's forward
    on CPU (the model's real code), to the byte."""
    import contextlib
    import gc

    from torch.utils.checkpoint import checkpoint

    from trainer.models.llama.model import TransformerBlock, precompute_rope_cache
    from trainer.parallel.parallelize import _op_policy
    from trainer.tools.plan.memory import layer_bytes_selective_op

    args = LlamaModelArgs(dim=128, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=256, multiple_of=128,
                          max_seq_len=32)
    batch, seq = 2, 32
    r, c = {"float32": (4, 4), "autocast-bf16": (4, 2), "fsdp-bf16": (2, 2)}[regime]
    dtype = torch.bfloat16 if regime == "fsdp-bf16" else torch.float32  # FSDP's bf16 parameters
    block = TransformerBlock(0, args).to(dtype)
    rope = precompute_rope_cache(args.head_dim, seq, args.rope_theta)
    x = torch.randn(batch, seq, args.dim, dtype=dtype, requires_grad=True)
    exclude = {p.untyped_storage().data_ptr() for p in block.parameters()} | {rope.untyped_storage().data_ptr()}
    weight_shapes = {tuple(p.shape) for p in block.parameters()} | {tuple(p.shape[::-1]) for p in block.parameters()}
    if ac == "none":
        run = lambda: block(x, rope)  # noqa: E731
    elif ac == "full":
        run = lambda: checkpoint(block, x, rope, use_reentrant=False)  # noqa: E731
    else:
        run = lambda: checkpoint(block, x, rope, use_reentrant=False, context_fn=_op_policy())  # noqa: E731
    tracker = _Alive()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if regime == "autocast-bf16" else contextlib.nullcontext()
    with tracker.mode, autocast:
        out = run()
    gc.collect()
    exclude.add(out.untyped_storage().data_ptr())
    # Autocast's weight casts (and views of weights) are the plan's weight_copies, not activations. No
    # activation here has a weight's shape (batch x seq = 64 rows; weights have 128, 32 or 384).
    kept = tracker.alive_bytes(exclude, weight_shapes)
    # The block input was made outside the tracked region: it is kept when the block saves it as is (a
    # float32 residual stream, whose float32 "upcast" is the input itself) or when the block is checkpointed.
    if r == 4 or ac != "none":
        kept += x.numel() * x.element_size()
    s = Shape.from_args(args)
    p = Precision(regime, r, c, regime == "fsdp-bf16", fused_norm=False)  # CPU: torch's composite rms_norm
    expected = {"none": layer_bytes(s, p), "selective_op": layer_bytes_selective_op(s, p), "full": r * s.dim}[ac]
    assert kept == expected * batch * seq


def test_search_prefers_fitting_fsdp_without_recompute():
    s = Shape.from_args(TINY)
    rows = search_layouts(s, 4, seq_len=8, capacity_bytes=1 << 30, max_local_batch=4)
    assert all(r["fits"] for r in rows)
    best = rows[0]["layout"]
    assert (best.tp, best.dp_shard, best.ac, best.local_batch_size) == (1, 4, "none", 4)
    # with too little memory nothing fits, and the rows say so
    rows = search_layouts(s, 4, seq_len=8, capacity_bytes=1000, max_local_batch=2)
    assert not any(r["fits"] for r in rows)


def test_plan_8b_on_one_gpu_does_not_fit(capsys):
    assert main(["--config", str(CONFIGS["llama3_8b"]), "--ngpu", "1", "--gpu", "H100",
                 "--parallelism.data_parallel_shard_degree", "1"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "no layout of 1 GPU(s) fits H100" in out


def test_checkpoint_staging_host_memory(capsys):
    """A background save's staging copy: the rank's fp32 weights and two moments, 12 bytes per parameter it
    holds (by hand on the tiny model), and the line `trainer plan` prints for the configured mode."""
    s = Shape.from_args(TINY)
    assert checkpoint_staging_bytes(s, Layout(1, 2, 1, 1, 1, 8)) == 12 * s.total_params() / 2
    # Pipeline stages: the larger stage's share (the tied or untied output layer on the last stage).
    stage_params = max(memory_estimate(s, Layout(1, 1, 1, 2, 2, 8), stage=st)["params"] for st in ("first", "last"))
    assert checkpoint_staging_bytes(s, Layout(1, 1, 1, 2, 2, 8)) == 3 * stage_params
    assert main(["--config", str(CONFIGS["debug_gqa"]), "--ngpu", "2", "--checkpoint.async_mode",
                 "async_with_pinned_mem"]) == 0
    out = capsys.readouterr().out
    config = load_config(["--job.config_file", str(CONFIGS["debug_gqa"])], env={})
    gib = 12 * count_params(model_args_for_plan(config)[0]) / 2 / 2**30
    assert (f"host memory per rank: checkpoint staging {gib:.3f} GiB (checkpoint.async_mode async_with_pinned_mem: "
            "kept for the whole run, pinned on CUDA)") in out, out


def test_context_parallel_divides_activations_and_adds_its_own_terms(capsys):
    """CP 4 holds a quarter of each sequence per rank (the same activations as a quarter-length sequence)
    plus, with allgather, the other ranks' keys and values and the dense mask; the parameters are sharded
    over dp_shard x cp. The plan reports the collectives per block and warns below 4096 tokens per rank."""
    s = Shape(dim=64, n_layers=2, n_heads=4, kv_dim=32, ffn=128, vocab=256, tied=False)
    quarter = memory_estimate(s, Layout(1, 4, 1, 1, 1, 2048, "none"))
    for method in ("allgather", "alltoall"):
        cp = memory_estimate(s, Layout(1, 1, 1, 1, 1, 8192, "none", cp=4, cp_method=method))
        assert cp["params"] == quarter["params"] and cp["final_norm"] == quarter["final_norm"]
        gathered = 2 * 3 * 2048 * 2 * 2 * 32 if method == "allgather" else 0  # layers x (cp-1) x local x k,v x bf16
        # An additive bf16 mask on CUDA (none on CPU, whose chunked kernel needs none); causal alltoall: none
        # (SDPA's own causal kernel).
        mask = 2048 * 8192 * 2 if method == "allgather" else 0
        assert cp["activations"] == quarter["activations"] + gathered + mask
        on_cpu = memory_estimate(s, Layout(1, 1, 1, 1, 1, 8192, "none", cp=4, cp_method=method, device="cpu"))
        quarter_on_cpu = memory_estimate(s, Layout(1, 4, 1, 1, 1, 2048, "none", device="cpu"))
        assert on_cpu["activations"] == quarter_on_cpu["activations"] + gathered
    # block_causal: a mask per sequence; without CP, a dense one on CPU only (CUDA runs FlexAttention).
    for method, rows in (("allgather", 2048), ("alltoall", 8192)):
        block = memory_estimate(s, Layout(1, 1, 1, 1, 2, 8192, "none", cp=4, cp_method=method, block_causal=True))
        causal = memory_estimate(s, Layout(1, 1, 1, 1, 2, 8192, "none", cp=4, cp_method=method))
        per_sequence = 2 * rows * 8192 * 2  # two sequences' masks, bf16
        causal_mask = rows * 8192 * 2 if method == "allgather" else 0  # causal: one for the batch
        assert block["activations"] - causal["activations"] == per_sequence - causal_mask
    for device, mask in (("cuda", 0), ("cpu", 2 * 8192 * 8192 * 2)):
        block = memory_estimate(s, Layout(1, 1, 1, 1, 2, 8192, "none", block_causal=True, device=device))
        causal = memory_estimate(s, Layout(1, 1, 1, 1, 2, 8192, "none", device=device))
        assert block["activations"] - causal["activations"] == mask
    # On CPU, RMSNorm is torch's composite op (it saves more than CUDA's fused kernel: the block test above).
    assert [Precision.for_layout(Layout(1, 1, 1, 1, 1, 8, device=d), "float32").fused_norm
            for d in ("cuda", "cpu")] == [True, False]
    config = load_config(["--job.config_file", str(CONFIGS["llama3_8b"]), "--parallelism.context_parallel_degree", "4",
                          "--training.seq_len", "8192", "--parallelism.data_parallel_shard_degree", "2"], env={})
    short = plan(config, ngpu=8, gpu="H100")
    assert short["context_parallel"]["tokens_per_rank_per_sequence"] == 2048
    assert any("leaves 2048 tokens of each sequence per rank, under 4096" in n for n in short["notes"])
    traffic = short["context_parallel"]["collective_gib_per_block"]
    # One sequence: the gathered keys and values, 4 x 2048 tokens x 2 x 1024 wide in bf16, each way.
    assert traffic["forward"] == traffic["backward"] == round(4 * 2048 * 2 * 1024 * 2 / 2**30, 4)
    config.training.seq_len = 32768
    assert not any("under 4096" in n for n in plan(config, ngpu=8, gpu="H100")["notes"])
