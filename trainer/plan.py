"""``trainer plan``: parameters, FLOPs per token and memory per GPU for a config on N GPUs.

    trainer plan --config train_configs/llama3_8b.toml --ngpu 8 [--gpu H100] [--json [FILE]] [--section.key value ...]

It prints the model's size (``count_params``, cross-checked against a model built on the meta device) and
training FLOPs per token (``flops_per_token``, the PaLM formula), then an estimate of the memory one GPU
needs for the configured layout, whether that fits the GPU named, and the layouts (FSDP x TP degree,
activation checkpointing mode, local batch size) that fit, best first. Nothing is allocated.

Memory model (bytes per GPU; see docs/performance.md for the derivation and its checks)
---------------------------------------------------------------------------------------

Notation: ``h`` model dim, ``F`` SwiGLU hidden size, ``V`` vocabulary, ``n_h`` query heads, ``kv`` the
key/value projection width, ``L`` layers (of this pipeline stage), ``T = local_batch x seq_len`` tokens per
micro-batch, ``P`` parameters held by this rank: matrices / tp (norms are replicated by TP), then / dp_shard.

* parameters 4P (fp32 master weights), gradients 4P (fp32), AdamW state 8P (exp_avg, exp_avg_sq in fp32);
  zero on the GPU with ``training.enable_cpu_offload``.
* working copies of the weights in the compute dtype: under FSDP (data-parallel degree > 1) the all-gathered
  bf16 parameters and gradient buffers of the blocks in flight, ``10 x block_params/tp`` (two gathered blocks
  in bf16 = 4 B/param, plus one block's unsharded bf16 gradient and its fp32 reduce-scatter copy = 6 B/param),
  plus the root module (embeddings, output) kept gathered, ``2 x root_params/tp``; without FSDP, autocast's
  bf16 copies of the matmul weights that backward needs, ``2 x (layer matrices + output)/tp`` (only the
  output's and those of blocks that are not checkpointed).
* activations: the tensors autograd saves, derived from this model's own forward (trainer/models/llama/
  model.py), in the spirit of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", sbh(34 + 5as/h) for GPT) adapted to RMSNorm, RoPE, GQA, SwiGLU and SDPA flash
  attention (no s^2 term: flash attention saves only its output and a float32 logsumexp per head). With
  ``r`` the residual-stream element size and ``c`` the compute element size, per token per layer::

      norm(k consumers) = r*h (its input) + 4 (float32 1/rms)                  [fused kernel, CUDA]
                          (CPU runs torch's composite rms_norm, which also saves its float32 upcast and the
                          normalised tensor: 4h + r*h + 4 + (r*h when r != 4))
                          + [r*h  if r == c  else  k*c*h (autocast's cast copy, one per consuming Linear)]
      attention         = 2*c*h (q after RoPE, SDPA output) + 2*c*kv (k, v: SDPA's enable_gqa does not
                          repeat them) + 4*n_h (logsumexp)
      SwiGLU MLP        = 4*c*F (w1 out, silu out, w3 out, their product)
      layer             = norm(3) + attention + norm(2) + MLP

  FSDP with bf16 parameters (r = c = 2): ``12h + 4kv + 8F + 4n_h + 8``. One GPU with autocast (float32
  residual stream, r = 4, c = 2): ``22h + 4kv + 8F + 4n_h + 8``. tests/test_plan.py checks these counts
  (in their CPU form) against what autograd really keeps alive after a block's forward, in all three
  regimes and all AC modes.
  Activation checkpointing keeps per layer: ``full`` the block input ``r*h``; ``selective op`` (the policy
  in trainer/parallel/parallelize.py: every other matmul output, SDPA outputs) ``r*h + c*(h + kv + F + h + h)
  + 4n_h`` (wq, wv, w1, w2 outputs and SDPA output + logsumexp); ``selective N`` full AC on every N-th
  block. A checkpointed model also holds one layer's full activations while that layer is recomputed.
  With tensor (sequence) parallel everything is divided by tp except the all-gathered inputs of the
  attention and MLP Linears (``k*c*h`` resp. ``c*h`` per norm), which are saved whole.
  Outside the layers: the final norm (1 consumer) and the loss at its peak (start of its backward):
  ``(c + 12)*V/tp`` (logits, float32 log-softmax output, the gradient flowing into it and out of it);
  ``(c + 16)*V/tp`` under TP, whose loss-parallel backward holds one more float32 vocabulary shard.
* total = the largest of three moments of a steady-state step (gradients are ``None`` until backward
  makes them), checked against ``trainer simulate`` (the real code on fake tensors, docs/performance.md):
  the loss's backward (every block's activations, the loss at its peak, no gradients yet, FSDP holding
  the root and the last block gathered); the backward through the blocks (gradients grow as activations
  are freed: the larger of the two, plus one recomputed block, the gathered weights and, under FSDP, the
  output layer's unsharded gradient, which waits for the root's reduce-scatter); the end of backward
  (every gradient, the root's unsharded gradients and their fp32 reduce-scatter buffer, and under TP
  the embedding's gradient over the whole vocabulary, which DTensor builds on every TP rank before keeping
  its shard). With pipelining and FSDP, torch's PipelineStage defers gradient reduction to the last
  micro-batch, so each rank also holds its stage's unsharded gradients in fp32 (and, at the end, its
  gathered weights). ``sum`` adds every term as if all were alive at once (an upper bound). It fits when the
  total is at most ``usable_fraction`` (default 0.9) of the GPU's memory: the rest covers the CUDA context,
  NCCL buffers and allocator fragmentation. Compile and float8 usually need less activation memory than
  this eager estimate; it is meant as an upper bound for them.

Measured peaks (``torch.cuda.max_memory_allocated`` from ``trainer bench gpu``) go into ``MEASURED``
below or are read from a bench JSON with ``--measured FILE``; the plan then prints them next to its
estimate. None exist yet: no GPU run of this code has been recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, JobConfig, load_config, validate
from trainer.models.config import resolve_model_args
from trainer.parallel.config import resolve_degrees

logger = logging.getLogger("trainer")

GiB = 2**30

# Total device memory in GiB as the driver reports it (nvidia-smi / rocm-smi "total"), approximate; matched
# case-insensitively, longest key first. Override with --gpu-memory-gib.
GPU_MEMORY_GIB: dict[str, float] = {
    "H100": 79.6,        # H100 SXM5 / PCIe 80 GB (81559 MiB)
    "H100-NVL": 93.6,    # 94 GB
    "H800": 79.6,
    "H200": 140.4,       # 141 GB (143771 MiB)
    "GH200": 94.5,       # 96 GB HBM3 variant
    "B200": 179.1,       # 180 GB usable
    "GB200": 184.0,
    "A100": 80.0,        # A100 80 GB (81920 MiB)
    "A100-40GB": 40.0,
    "A800": 80.0,
    "L40S": 45.0,
    "L4": 22.5,
    "A10": 22.5,
    "RTX4090": 24.0,
    "MI250X": 64.0,
    "MI300X": 191.7,
    "MI325X": 255.5,
    "MI355X": 287.6,
}

# Measured peak memory (GiB, torch.cuda.max_memory_allocated) of single-GPU runs, to set against the
# estimate. Keys: (flavor, seq_len, local_batch_size, ac mode, variant). Empty until a GPU run is recorded
# (``trainer bench gpu --json F`` writes them; ``trainer plan --measured F`` reads that file directly).
MEASURED: dict[tuple[str, int, int, str, str], float] = {}

AC_MODES = ("none", "selective_op", "full")


# --------------------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """The numbers of the memory model, from LlamaModelArgs."""

    dim: int
    n_layers: int
    n_heads: int
    kv_dim: int
    ffn: int
    vocab: int
    tied: bool

    @classmethod
    def from_args(cls, args) -> "Shape":
        return cls(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                   kv_dim=args.num_kv_heads * args.head_dim, ffn=args.ffn_hidden_dim, vocab=args.vocab_size,
                   tied=args.tie_word_embeddings)

    @property
    def layer_matrices(self) -> int:
        h = self.dim
        return 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.ffn  # wq, wo, wk, wv, w1, w2, w3

    @property
    def layer_norms(self) -> int:
        return 2 * self.dim

    @property
    def embedding(self) -> int:
        return self.vocab * self.dim

    @property
    def output(self) -> int:
        """Output projection parameters not shared with the embedding."""
        return 0 if self.tied else self.vocab * self.dim

    def total_params(self) -> int:
        return self.embedding + self.n_layers * (self.layer_matrices + self.layer_norms) + self.dim + self.output


# --------------------------------------------------------------------------------------------------
# Layout and precision
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    local_batch_size: int
    seq_len: int
    ac: str = "none"  # none | selective_op | selective_N (N an integer) | full
    pp_microbatch_size: int = 1

    @property
    def ngpu(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"replicate {self.dp_replicate}")
        parts.append(f"fsdp {self.dp_shard}" if self.dp > 1 else "no data parallel (no FSDP)")
        if self.tp > 1:
            parts.append(f"tp {self.tp}")
        if self.pp > 1:
            parts.append(f"pp {self.pp}")
        parts.append(f"ac {self.ac}")
        parts.append(f"local batch {self.local_batch_size} x {self.seq_len}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Precision:
    """Element sizes: ``residual`` (the residual stream), ``compute`` (matmul inputs/outputs)."""

    name: str
    residual: int
    compute: int
    fsdp: bool
    fused_norm: bool = True  # RMSNorm as one kernel (CUDA); CPU runs torch's composite op, which saves more

    @classmethod
    def for_layout(cls, layout: Layout, compute_dtype: str) -> "Precision":
        fsdp = layout.dp > 1
        if compute_dtype == "float32":
            return cls("float32", 4, 4, fsdp)
        if fsdp:
            return cls("fsdp-bf16", 2, 2, True)  # FSDP casts parameters: the whole forward runs in bf16
        return cls("autocast-bf16", 4, 2, False)  # fp32 parameters, autocast matmuls, fp32 residual stream


# --------------------------------------------------------------------------------------------------
# Activation bytes
# --------------------------------------------------------------------------------------------------


def norm_bytes(s: Shape, p: Precision, consumers: int, tp: int = 1) -> float:
    """Per token: saved tensors of one RMSNorm and of its output as its consuming Linears save it."""
    h, r, c = s.dim, p.residual, p.compute
    if p.fused_norm:
        own = r * h + 4  # its input and the float32 1/rms
    else:  # float32 upcast (the input itself when float32), the input, the normalised tensor, 1/rms
        own = 4 * h + r * h + 4 + (r * h if r != 4 else 0)
    out = r * h if r == c else consumers * c * h  # saved once, or one autocast cast copy per consumer
    return own / tp + out  # under TP the consumers save the all-gathered (full-sequence) output


def layer_bytes(s: Shape, p: Precision, tp: int = 1) -> float:
    """Per token, one transformer block without activation checkpointing."""
    c = p.compute
    attention = 2 * c * s.dim + 2 * c * s.kv_dim + 4 * s.n_heads  # q, SDPA output; k, v; fp32 logsumexp
    mlp = 4 * c * s.ffn
    return norm_bytes(s, p, 3, tp) + norm_bytes(s, p, 2, tp) + (attention + mlp) / tp


def layer_bytes_selective_op(s: Shape, p: Precision, tp: int = 1) -> float:
    """Per token, one block under selective "op" AC: block input + wq, wv, w1, w2 outputs + SDPA outputs."""
    c = p.compute
    kept = c * (s.dim + s.kv_dim + s.ffn + s.dim + s.dim) + 4 * s.n_heads
    return p.residual * s.dim / tp + kept / tp


def checkpointed_layers(layers: int, ac: str) -> int:
    if ac == "none":
        return 0
    if ac.startswith("selective_") and ac != "selective_op":
        return math.ceil(layers / int(ac.split("_", 1)[1]))  # blocks 0, N, 2N, ...
    return layers


def layers_activation_bytes(s: Shape, p: Precision, layers: int, tokens: int, ac: str, tp: int = 1) -> dict:
    """Activation bytes of ``layers`` blocks for ``tokens`` tokens under AC mode ``ac``."""
    full = layer_bytes(s, p, tp) * tokens
    if ac == "none":
        kept, recompute = full * layers, 0.0
    elif ac == "full":
        kept, recompute = p.residual * s.dim / tp * tokens * layers, full
    elif ac == "selective_op":
        kept, recompute = layer_bytes_selective_op(s, p, tp) * tokens * layers, full
    elif ac.startswith("selective_"):
        every = int(ac.split("_", 1)[1])
        wrapped = math.ceil(layers / every)  # blocks 0, N, 2N, ... are checkpointed
        kept = (p.residual * s.dim / tp * wrapped + layer_bytes(s, p, tp) * (layers - wrapped)) * tokens
        recompute = full if wrapped else 0.0
    else:
        raise ValueError(f"unknown activation checkpointing mode {ac!r}")
    return {"layers": kept, "recompute": recompute}


def head_bytes(s: Shape, p: Precision, tokens: int, tp: int = 1) -> dict:
    """Final norm and loss (logits, fp32 log-softmax, its gradient in and out; under TP, loss parallel's
    backward holds one more float32 tensor of the vocabulary shard), per micro-batch."""
    per_vocab = p.compute + (16 if tp > 1 else 12)
    return {"final_norm": norm_bytes(s, p, 1, tp) * tokens, "loss": per_vocab * s.vocab / tp * tokens}


# --------------------------------------------------------------------------------------------------
# Memory per GPU
# --------------------------------------------------------------------------------------------------


def _stage_layers(n_layers: int, pp: int) -> int:
    return math.ceil(n_layers / pp)


def memory_estimate(s: Shape, layout: Layout, *, compute_dtype: str = "bfloat16", cpu_offload: bool = False,
                    reshard_after_forward: str = "default", stage: str | None = None) -> dict[str, Any]:
    """Bytes per GPU for one layout (the busiest pipeline stage when pp > 1, or ``stage`` "first", "middle"
    or "last"). Keys are the terms of the model in the module docstring; ``sum`` is their sum, ``total``
    the step's largest moment (``_peak``)."""
    p = Precision.for_layout(layout, compute_dtype)
    tp, pp = layout.tp, layout.pp
    shard = layout.dp_shard
    layers = _stage_layers(s.n_layers, pp)

    def stage_terms(first: bool, last: bool) -> dict[str, float]:
        mats = layers * s.layer_matrices + (s.embedding if first else 0) + (s.output if last else 0)
        if s.tied and last and not first:
            mats += s.embedding  # the output stage holds its own copy of a tied matrix
        norms = layers * s.layer_norms + (s.dim if last else 0)
        params_rank = (mats / tp + norms) / shard
        states = 0.0 if cpu_offload else 1.0
        out: dict[str, float] = {
            "params": 4 * params_rank * states,
            "grads": 4 * params_rank * states,
            "optimizer": 8 * params_rank * states,
        }
        c = p.compute
        if p.fsdp:
            # Gathered (unsharded over dp) block parameters in the compute dtype: the running block and the
            # prefetched one; in backward one block's unsharded gradient plus its fp32 reduce-scatter copy.
            block = s.layer_matrices / tp + s.layer_norms
            per_block = 2 * c + c + (4 if c < 4 else 0)
            gathered = block * (per_block if layers >= 2 else c + c + (4 if c < 4 else 0)) if layers else 0.0
            root = ((s.embedding if first else 0) + (s.output if last else 0)) / tp + (s.dim if last else 0)
            out["weight_copies"] = gathered + c * root
            if reshard_after_forward == "never":  # every block stays gathered after forward
                out["weight_copies"] += c * block * max(0, layers - 2)
        elif c < 4:
            # Autocast: bf16 casts of the matmul weights, saved for backward by the matmuls of blocks that
            # are not checkpointed (a checkpointed block recasts them when it is recomputed) and the output.
            out_mats = s.vocab * s.dim if last else 0
            saved_layers = layers - checkpointed_layers(layers, layout.ac)
            out["weight_copies"] = c * (saved_layers * s.layer_matrices + out_mats) / tp
        else:
            out["weight_copies"] = 0.0
        if pp > 1:
            # 1F1B: the first stage holds the activations of up to pp micro-batches, the last one of one.
            tokens = layout.pp_microbatch_size * layout.seq_len
            microbatches = max(1, layout.local_batch_size // layout.pp_microbatch_size)
            in_flight = min(pp, microbatches) if first else 1
        else:
            tokens = layout.local_batch_size * layout.seq_len
            in_flight = 1
        act = layers_activation_bytes(s, p, layers, tokens, layout.ac, tp)
        out["activations"] = act["layers"] * in_flight
        out["recompute"] = act["recompute"]
        if last:
            head = head_bytes(s, p, tokens, tp)
            out["final_norm"] = head["final_norm"]
            out["loss"] = head["loss"]
        else:
            out["final_norm"] = out["loss"] = 0.0
        out["sum"] = sum(out.values())
        out["total"] = _peak(out, s, layout, p, layers, first, last, reshard_after_forward)
        return out

    if pp == 1:
        terms = stage_terms(True, True)
    elif stage is not None:
        terms = stage_terms(stage == "first", stage == "last")
    else:
        candidates = [stage_terms(True, False), stage_terms(False, True)]
        terms = max(candidates, key=lambda t: t["total"])
    return {"precision": p.name, "stage_layers": layers, **{k: float(v) for k, v in terms.items()}}


def _peak(out: dict, s: Shape, layout: Layout, p: Precision, layers: int, first: bool, last: bool,
          reshard_after_forward: str) -> float:
    """The largest of the step's three moments (module docstring, "total"): the loss's backward, the
    backward through the blocks, the end of backward."""
    tp, c = layout.tp, p.compute
    state = out["params"] + out["optimizer"]
    output = (0 if s.tied and first else s.vocab * s.dim) if last else 0
    root = ((s.embedding if first else 0) + output) / tp + (s.dim if last else 0)
    if p.fsdp:
        block = s.layer_matrices / tp + s.layer_norms
        kept = layers if reshard_after_forward == "never" else (
            1 if reshard_after_forward == "default" and layout.pp == 1 else 0)
        gathered_at_loss = c * (root + kept * block)  # the last block's backward follows its forward
        output_grad = c * output / tp
    else:
        gathered_at_loss, output_grad = out["weight_copies"], 0.0
    full_vocab_grad = (c if p.fsdp else 4) * s.vocab * s.dim if first and tp > 1 else 0.0
    end_extra = 2 * c * root + max(full_vocab_grad, 4 * root) if p.fsdp else full_vocab_grad
    loss = state + gathered_at_loss + out["activations"] + out["final_norm"] + out["loss"]
    blocks = state + out["weight_copies"] + out["recompute"] + max(out["grads"], out["activations"]) + output_grad
    end = state + out["grads"] + end_extra
    if p.fsdp and layout.pp > 1:
        # torch's PipelineStage turns FSDP's gradient reduction off until the last micro-batch: every rank
        # accumulates its stage's unsharded gradients in fp32, and after a backward the units stay gathered.
        unsharded = out["params"] * layout.dp_shard / 4
        loss, blocks = loss + 4 * unsharded, blocks + 4 * unsharded
        end = state + (c + 4) * unsharded + (c + 4) * root + full_vocab_grad
    return max(loss, blocks, end)


def gpu_memory_gib(name: str) -> float:
    key = name.upper().replace(" ", "-").replace("_", "-")
    table = {k.upper(): v for k, v in GPU_MEMORY_GIB.items()}
    if key in table:
        return table[key]
    for k in sorted(table, key=len, reverse=True):
        if key.startswith(k):
            return table[k]
    raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(GPU_MEMORY_GIB)} (or give --gpu-memory-gib)")


# --------------------------------------------------------------------------------------------------
# Search over layouts
# --------------------------------------------------------------------------------------------------


def _recompute_rank(ac: str) -> int:
    return {"none": 0, "selective_op": 1, "full": 3}.get(ac, 2)


def search_layouts(s: Shape, ngpu: int, *, seq_len: int, capacity_bytes: float, pp: int = 1,
                   dp_replicate: int = 1, global_batch: int = -1, max_local_batch: int = 16,
                   compute_dtype: str = "bfloat16", cpu_offload: bool = False, usable_fraction: float = 0.9,
                   max_tp: int = 8, min_tokens: int = 4096) -> list[dict]:
    """Every (tp, fsdp, ac, local batch) for ``ngpu`` GPUs with its estimate, fitting ones first, best first.

    Order among fitting layouts (a preference, not a throughput model): the smallest TP degree (TP costs
    communication on every layer); then micro-batches of at least ``min_tokens`` tokens where possible
    (small matmuls waste the GPU); then the least recomputation (none < selective op < selective N < full);
    then the largest local batch (fewer accumulation steps)."""
    rows = []
    for tp in (1, 2, 4, 8):
        if tp > max_tp or ngpu % (tp * pp * dp_replicate):
            continue
        if s.n_heads % tp or (s.kv_dim // (s.dim // s.n_heads)) % tp:
            continue
        shard = ngpu // (tp * pp * dp_replicate)
        dp = shard * dp_replicate
        lb = 1
        while lb <= max_local_batch:
            if global_batch <= 0 or global_batch % (lb * dp) == 0:
                for ac in AC_MODES:
                    layout = Layout(dp_replicate, shard, tp, pp, lb, seq_len, ac)
                    est = memory_estimate(s, layout, compute_dtype=compute_dtype, cpu_offload=cpu_offload)
                    fits = est["total"] <= usable_fraction * capacity_bytes
                    accum = (global_batch // (lb * dp)) if global_batch > 0 else 1
                    rows.append({"layout": layout, "estimate": est, "fits": fits, "grad_accum_steps": accum})
            lb *= 2

    def key(row):
        lay: Layout = row["layout"]
        tokens = lay.local_batch_size * lay.seq_len
        return (not row["fits"], lay.tp, -min(tokens, min_tokens), _recompute_rank(lay.ac), -lay.local_batch_size)

    rows.sort(key=key)
    return rows


# --------------------------------------------------------------------------------------------------
# The config
# --------------------------------------------------------------------------------------------------


def _ac_name(config: JobConfig) -> str:
    mode = config.activation_checkpoint.mode
    if mode == "selective":
        opt = config.activation_checkpoint.selective_ac_option
        return "selective_op" if opt == "op" else f"selective_{int(opt)}"
    return mode


def model_args_for_plan(config: JobConfig):
    """The model args the trainer would build, and a note when the tokenizer is not on this machine (then
    the vocabulary comes from the flavor or model.vocab_size, unchecked against the tokenizer)."""
    from trainer.data.tokenizer import load_tokenizer

    tokenizer_vocab = None
    note = None
    path = config.model.tokenizer_path
    if path == "" or Path(path).exists():
        tokenizer_vocab = load_tokenizer(config).vocab_size
    else:
        note = f"tokenizer {path} not found: vocabulary from the flavor/model.vocab_size"
    return resolve_model_args(config, tokenizer_vocab), note


def plan(config: JobConfig, ngpu: int, gpu: str = "H100", gpu_memory: float | None = None,
         usable_fraction: float = 0.9, max_local_batch: int | None = None, top: int = 10,
         measured: list[dict] | None = None) -> dict[str, Any]:
    """Everything ``trainer plan`` reports, as a JSON-able dict."""
    import torch

    from trainer.models.llama.flops import count_params, flops_per_token, model_num_params
    from trainer.models.llama.model import Transformer

    args, note = model_args_for_plan(config)
    seq_len = config.training.seq_len
    with torch.device("meta"):
        meta_params = model_num_params(Transformer(args))
    params = count_params(args)
    shape = Shape.from_args(args)
    assert shape.total_params() == params, "plan's parameter arithmetic disagrees with count_params"
    fpt = flops_per_token(args, seq_len)
    capacity = (gpu_memory if gpu_memory is not None else gpu_memory_gib(gpu)) * GiB
    compute_dtype = "float32" if config.training.mixed_precision_param == "float32" else "bfloat16"
    cpu_offload = config.training.enable_cpu_offload

    rep, shard, tp, pp = resolve_degrees(config.parallelism, ngpu)
    configured = Layout(rep, shard, tp, pp, config.training.local_batch_size, seq_len, _ac_name(config),
                        config.parallelism.pipeline_parallel_microbatch_size)
    est = memory_estimate(shape, configured, compute_dtype=compute_dtype, cpu_offload=cpu_offload,
                          reshard_after_forward=config.parallelism.fsdp_reshard_after_forward)
    gb = config.training.global_batch_size
    rows = search_layouts(shape, ngpu, seq_len=seq_len, capacity_bytes=capacity, pp=pp,
                          dp_replicate=rep if config.parallelism.data_parallel_replicate_degree != -1 else 1,
                          global_batch=gb,
                          max_local_batch=max_local_batch or max(16, config.training.local_batch_size),
                          compute_dtype=compute_dtype, cpu_offload=cpu_offload, usable_fraction=usable_fraction)

    def layout_json(lay: Layout) -> dict:
        return dataclasses.asdict(lay) | {"describe": lay.describe()}

    def est_gib(e: dict) -> dict:
        return {k: (round(v / GiB, 3) if isinstance(v, float) else v) for k, v in e.items()}

    ac_table = {}
    for ac in AC_MODES:
        e = memory_estimate(shape, dataclasses.replace(configured, ac=ac), compute_dtype=compute_dtype,
                            cpu_offload=cpu_offload, reshard_after_forward=config.parallelism.fsdp_reshard_after_forward)
        ac_table[ac] = round((e["activations"] + e["recompute"]) / GiB, 3)
    result: dict[str, Any] = {
        "model": {"name": config.model.name, "flavor": config.model.flavor, "params": params,
                  "params_meta_model": meta_params, "params_non_embedding": count_params(args, exclude_embedding=True),
                  "flops_per_token": fpt, "seq_len": seq_len, "vocab_size": args.vocab_size, "dim": args.dim,
                  "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.num_kv_heads,
                  "ffn_hidden_dim": args.ffn_hidden_dim},
        "flops_formula": "6 * N_non_embedding + 12 * n_layers * n_heads * head_dim * seq_len (PaLM, appendix B)",
        "memory_formula": "per token per layer: norm(3) + 2*c*h + 2*c*kv + 4*n_heads + norm(2) + 4*c*F, norm(k) = "
                          "r*h + 4 + (r*h if r == c else k*c*h); see trainer/plan.py and docs/performance.md",
        "gpu": {"name": gpu, "memory_gib": round(capacity / GiB, 2), "usable_fraction": usable_fraction},
        "ngpu": ngpu,
        "configured": {"layout": layout_json(configured), "estimate_gib": est_gib(est),
                       "fits": est["total"] <= usable_fraction * capacity,
                       "activations_by_ac_gib": ac_table,
                       "tokens_per_step": (gb if gb > 0 else configured.local_batch_size * configured.dp) * seq_len},
        "recommended": None,
        "candidates": [],
        "notes": [],
    }
    if note:
        result["notes"].append(note)
    if "quantize.linear.float8" in config.model.converters or config.compile.enable:
        result["notes"].append("estimate is for eager bf16; compile and float8 usually need less activation memory")
    _recommend(result, rows, configured, gb, ngpu, gpu, layout_json, est_gib)
    for r in rows[:top]:
        result["candidates"].append({"layout": layout_json(r["layout"]), "total_gib": round(r["estimate"]["total"] / GiB, 3),
                                     "fits": r["fits"], "grad_accum_steps": r["grad_accum_steps"]})
    result["measured"] = _measured_rows(config, configured, ngpu, est, measured)
    return result


def _recommend(result: dict, rows: list[dict], configured: Layout, gb: int, ngpu: int, gpu: str,
               layout_json, est_gib) -> None:
    """The best fitting layout into ``result``, or a note that none fits."""
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        result["notes"].append(f"no layout of {ngpu} GPU(s) fits {gpu}: use more GPUs, pipeline parallel, "
                               "CPU offload or a shorter seq_len")
        return
    best = fitting[0]
    result["recommended"] = {"layout": layout_json(best["layout"]), "estimate_gib": est_gib(best["estimate"]),
                             "grad_accum_steps": best["grad_accum_steps"]}
    if gb <= 0 and best["layout"].local_batch_size != configured.local_batch_size:
        result["notes"].append("training.global_batch_size is -1 (local batch x data-parallel degree): the "
                               "recommended local batch changes the global batch; set global_batch_size to "
                               "keep it fixed")


def _measured_rows(config: JobConfig, layout: Layout, ngpu: int, est: dict, measured: list[dict] | None) -> list:
    """Measured peaks matching this config (single-GPU runs only), beside the estimate."""
    rows = []
    if ngpu != 1:
        return rows
    key = (config.model.flavor, layout.seq_len, layout.local_batch_size, layout.ac)
    for (flavor, seq, lb, ac, variant), gib in MEASURED.items():
        if (flavor, seq, lb, ac) == key:
            rows.append({"variant": variant, "measured_gib": gib, "estimate_gib": round(est["total"] / GiB, 3)})
    for m in measured or []:
        if (m.get("flavor"), m.get("seq_len"), m.get("local_batch_size"), m.get("ac")) == key and m.get("peak_allocated_gib"):
            rows.append({"variant": m.get("variant"), "measured_gib": m["peak_allocated_gib"],
                         "estimate_gib": round(est["total"] / GiB, 3)})
    return rows


def load_measured(path: str) -> list[dict]:
    """The GPU cases of a ``trainer bench ... --json`` file."""
    data = json.loads(Path(path).read_text())
    gpu = data.get("results", {}).get("gpu", {})
    return [c for c in gpu.get("cases", []) if isinstance(c, dict)]


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def format_report(r: dict) -> str:
    m = r["model"]
    lines = [
        f"model      {m['name']} {m['flavor']}: dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads "
        f"({m['n_kv_heads']} kv), ffn {m['ffn_hidden_dim']}, vocab {m['vocab_size']}",
        f"params     {m['params']:,} (count_params; model built on meta: {m['params_meta_model']:,}); "
        f"non-embedding {m['params_non_embedding']:,}",
        f"FLOPs      {m['flops_per_token']:,} per token at seq_len {m['seq_len']}  [{r['flops_formula']}]",
        f"GPU        {r['ngpu']} x {r['gpu']['name']} ({r['gpu']['memory_gib']} GiB; fits = total <= "
        f"{r['gpu']['usable_fraction']:.0%} of it)",
        "",
    ]
    c = r["configured"]
    e = c["estimate_gib"]
    lines.append(f"configured layout: {c['layout']['describe']}  [{e['precision']}]")
    lines.append("  memory per GPU (GiB):")
    for k in ("params", "grads", "optimizer", "weight_copies", "activations", "recompute", "final_norm", "loss"):
        lines.append(f"    {k:<14} {e[k]:>10.3f}")
    lines.append(f"    {'sum':<14} {e['sum']:>10.3f}   (every term at once)")
    lines.append(f"    {'total':<14} {e['total']:>10.3f}   (the step's largest moment) -> "
                 f"{'fits' if c['fits'] else 'DOES NOT FIT'}")
    acs = ", ".join(f"{k} {v:.2f}" for k, v in c["activations_by_ac_gib"].items())
    lines.append(f"  activations (+ one recomputed layer) by AC mode: {acs} GiB")
    for row in r["measured"]:
        lines.append(f"  measured peak ({row['variant']}): {row['measured_gib']:.2f} GiB vs estimate {row['estimate_gib']:.2f}")
    lines.append("")
    if r["recommended"]:
        rec = r["recommended"]
        lines.append(f"recommended: {rec['layout']['describe']} -> {rec['estimate_gib']['total']:.2f} GiB per GPU, "
                     f"{rec['grad_accum_steps']} micro-batch(es) per step")
    lines.append("")
    lines.append(f"  {'tp':>3} {'fsdp':>5} {'ac':<13} {'batch':>5} {'accum':>5} {'GiB':>9}  fits")
    for cand in r["candidates"]:
        lay = cand["layout"]
        lines.append(f"  {lay['tp']:>3} {lay['dp_shard']:>5} {lay['ac']:<13} {lay['local_batch_size']:>5} "
                     f"{cand['grad_accum_steps']:>5} {cand['total_gib']:>9.2f}  {'yes' if cand['fits'] else 'no'}")
    for n in r["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="trainer plan", allow_abbrev=False,
        description="Parameters, FLOPs per token and memory per GPU for a config on N GPUs, and the layouts "
                    "that fit. Other --section.key value arguments override the config.")
    parser.add_argument("--config", required=False, help="TOML config (default: $CONFIG_FILE or built-in defaults)")
    parser.add_argument("--ngpu", type=int, required=True)
    parser.add_argument("--gpu", default="H100", help=f"GPU model: {', '.join(GPU_MEMORY_GIB)}")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="override the GPU's memory")
    parser.add_argument("--usable-fraction", type=float, default=0.9)
    parser.add_argument("--max-local-batch", type=int, default=None)
    parser.add_argument("--top", type=int, default=10, help="candidate layouts to list")
    parser.add_argument("--measured", default=None, help="a `trainer bench gpu --json` file with measured peaks")
    parser.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to FILE, or stdout)")
    args, overrides = parser.parse_known_args(argv)
    if args.ngpu < 1:
        parser.error("--ngpu must be >= 1")
    cfg_argv = (["--job.config_file", args.config] if args.config else []) + overrides
    try:
        config = load_config(cfg_argv, env={} if args.config else None)
        validate(config)  # the rules without a world size; plan() resolves the degrees for --ngpu
        measured = load_measured(args.measured) if args.measured else None
        result = plan(config, args.ngpu, args.gpu, args.gpu_memory_gib, args.usable_fraction,
                      args.max_local_batch, args.top, measured)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print_report(result, format_report, args.json)
    return 0


def print_report(result: dict, formatter, json_path: str | None) -> None:
    """The table on stdout (or the JSON itself with ``--json -``); ``--json FILE`` also writes the JSON."""
    if json_path == "-":
        print(json.dumps(result, indent=2))
        return
    print(formatter(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
