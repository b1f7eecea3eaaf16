"""The memory model of ``trainer plan``: bytes per GPU of a layout, term by term, and the search over
layouts. Nothing is allocated; ``trainer simulate`` checks these formulas against the real code.

Memory model (bytes per GPU; see docs/performance.md for the derivation and its checks)
---------------------------------------------------------------------------------------

Notation: ``h`` model dim, ``F`` SwiGLU hidden size, ``V`` vocabulary, ``n_h`` query heads, ``kv`` the
key/value projection width, ``L`` layers (of this pipeline stage), ``T = local_batch x seq_len`` tokens per
micro-batch, ``P`` parameters held by this rank: matrices / tp (norms are replicated by TP), then / dp_shard.

* parameters 4P (fp32 master weights), gradients 4P (fp32), AdamW state 8P (exp_avg, exp_avg_sq in fp32);
  zero on the GPU with ``training.enable_cpu_offload``. With Muon (``optimizer.name = "Muon"``) the blocks'
  matrices have one fp32 state (the momentum, sharded like the parameter): 4 B each, AdamW's 8 B the rest.
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
  residual stream, r = 4, c = 2): ``22h + 4kv + 8F + 4n_h + 8``. tests/unit/test_plan.py checks these counts
  (in their CPU form) against what autograd really keeps alive after a block's forward, in all three
  regimes and all AC modes.
  Activation checkpointing keeps per layer: ``full`` the block input ``r*h``; ``selective op`` (the policy
  in trainer/parallel/parallelize.py: every other matmul output, SDPA outputs) ``r*h + c*(h + kv + F + h + h)
  + 4n_h`` (wq, wv, w1, w2 outputs and SDPA output + logsumexp); ``selective N`` full AC on every N-th
  block. A checkpointed model also holds one layer's full activations while that layer is recomputed.
  With tensor (sequence) parallel everything is divided by tp except the all-gathered inputs of the
  attention and MLP Linears (``k*c*h`` resp. ``c*h`` per norm), which are saved whole.
  Outside the layers: the final norm (1 consumer) and the loss at its peak (start of its backward):
  ``12*V/tp`` (float32 log-softmax output, the gradient flowing into it and out of it); ``16*V/tp`` under
  TP, whose loss-parallel backward holds one more float32 vocabulary shard. The step frees the logits
  before backward; a pipeline stage keeps its output (the logits) until its backward: ``c*V/tp`` more.
* context parallel (``cp`` > 1): parameters, gradients and optimizer state are sharded over
  ``dp_shard x cp``; ``T`` counts the rank's ``seq_len / cp`` tokens of each sequence; the activations add
  what :func:`context_parallel_bytes` counts (the gathered keys/values of ``allgather``, the dense mask).
  ``block_causal`` without CP adds a dense mask on CPU only (:func:`mask_bytes`).
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainer.errors import ConfigError

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
    # A mixture of experts: the blocks that have one, experts per block, experts per token, one expert's hidden
    # size and the shared experts' (all 0 for a dense model).
    moe_layers: int = 0
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0

    @classmethod
    def from_args(cls, args) -> "Shape":
        moe = {}
        if args.moe is not None and args.n_moe_layers:
            moe = dict(moe_layers=args.n_moe_layers, experts=args.moe.num_experts, top_k=args.moe.top_k,
                       expert_ffn=args.expert_hidden_dim,
                       shared_ffn=args.expert_hidden_dim * args.moe.num_shared_experts)
        return cls(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
                   kv_dim=args.num_kv_heads * args.head_dim, ffn=args.ffn_hidden_dim, vocab=args.vocab_size,
                   tied=args.tie_word_embeddings, **moe)

    @property
    def attention_matrices(self) -> int:
        return 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim  # wq, wo, wk, wv

    @property
    def routed_expert_matrices(self) -> int:
        """One MoE block's routed experts (``w1``, ``w2``, ``w3`` of each)."""
        return 3 * self.dim * self.expert_ffn * self.experts

    @property
    def moe_ffn_matrices(self) -> int:
        """One MoE block's feed-forward: router, routed experts, shared experts."""
        h = self.dim
        return h * self.experts + self.routed_expert_matrices + 3 * h * self.shared_ffn

    def _ffn_matrices_total(self) -> int:
        return (self.n_layers - self.moe_layers) * 3 * self.dim * self.ffn + self.moe_layers * self.moe_ffn_matrices

    @property
    def layer_matrices(self) -> float:
        """A block's matrix parameters (wq, wo, wk, wv, w1, w2, w3), averaged over the blocks when some hold a
        mixture of experts."""
        if not self.moe_layers:
            return self.attention_matrices + 3 * self.dim * self.ffn
        return self.attention_matrices + self._ffn_matrices_total() / self.n_layers

    def gathered_layer_matrices(self, ep: int = 1) -> float:
        """The largest block's matrix parameters as one block's all-gather holds them: under expert parallel
        (``ep`` > 1) a rank gathers its own share of the routed experts only."""
        dense = 3 * self.dim * self.ffn if self.moe_layers < self.n_layers else 0
        moe = 0.0
        if self.moe_layers:
            moe = self.moe_ffn_matrices - self.routed_expert_matrices * (1 - 1 / ep)
        return self.attention_matrices + max(dense, moe)

    @property
    def ffn_activation(self) -> float:
        """Per token, the hidden width whose activations a feed-forward saves, averaged over the blocks: a dense
        block's ``ffn``; an MoE block's ``top_k`` experts and its shared experts (tensor parallel splits both;
        the routing's own tensors are :attr:`routing_activation`)."""
        if not self.moe_layers:
            return self.ffn
        moe = self.top_k * self.expert_ffn + self.shared_ffn
        return ((self.n_layers - self.moe_layers) * self.ffn + self.moe_layers * moe) / self.n_layers

    @property
    def routing_activation(self) -> float:
        """Per token, averaged over the blocks, in the same ``4c`` units: an MoE block's routed copies of the
        token (in and out, ``2 top_k dim``) and the float32 router scores (``2 experts``). Tensor parallel does
        not split them: every TP rank routes its group's whole sequence (trainer/models/moe.py)."""
        return self.moe_layers * (2 * self.top_k * self.dim + 2 * self.experts) / 4 / self.n_layers

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
        blocks = self.n_layers * (self.attention_matrices + self.layer_norms) + self._ffn_matrices_total()
        return self.embedding + blocks + self.dim + self.output

    def active_params(self) -> int:
        """Parameters one token goes through: of each MoE block's experts, top_k."""
        routed = self.moe_layers * 3 * self.dim * self.expert_ffn * (self.experts - self.top_k)
        return self.total_params() - routed


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
    cp: int = 1  # context parallel: each sequence split over cp ranks
    ep: int = 1  # expert parallel: the routed experts split over ep of the dp_shard ranks
    cp_method: str = "allgather"
    block_causal: bool = False
    device: str = "cuda"  # whose attention kernels: "cuda" or "cpu" (they need different masks)

    @property
    def ngpu(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks the parameters are sharded over: dp_shard x cp (CP ranks hold the same parameters)."""
        return self.dp_shard * self.cp

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence on one rank (the whole sequence without context parallelism)."""
        return self.seq_len // self.cp

    def describe(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"replicate {self.dp_replicate}")
        if self.dp > 1:
            parts.append(f"fsdp {self.dp_shard}")
        else:
            parts.append("no data parallel (FSDP over cp)" if self.cp > 1 else "no data parallel (no FSDP)")
        if self.tp > 1:
            parts.append(f"tp {self.tp}")
        if self.pp > 1:
            parts.append(f"pp {self.pp}")
        if self.cp > 1:
            parts.append(f"cp {self.cp} ({self.cp_method})")
        if self.ep > 1:
            parts.append(f"ep {self.ep}")
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
        fsdp = layout.dp * layout.cp > 1
        fused = layout.device != "cpu"
        if compute_dtype == "float32":
            return cls("float32", 4, 4, fsdp, fused)
        if fsdp:
            return cls("fsdp-bf16", 2, 2, True, fused)  # FSDP casts parameters: the whole forward runs in bf16
        return cls("autocast-bf16", 4, 2, False, fused)  # fp32 parameters, autocast matmuls, fp32 residual stream


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
    mlp = 4 * c * s.ffn_activation
    return norm_bytes(s, p, 3, tp) + norm_bytes(s, p, 2, tp) + (attention + mlp) / tp + 4 * c * s.routing_activation


def layer_bytes_selective_op(s: Shape, p: Precision, tp: int = 1) -> float:
    """Per token, one block under selective "op" AC: block input + wq, wv, w1, w2 outputs + SDPA outputs."""
    c = p.compute
    kept = c * (s.dim + s.kv_dim + s.ffn_activation + s.dim + s.dim) + 4 * s.n_heads
    return p.residual * s.dim / tp + kept / tp + c * s.routing_activation


def mask_bytes(p: Precision, layout: Layout, sequences: int) -> float:
    """The dense attention mask of a forward for ``sequences`` sequences (additive, in the compute dtype, built
    once and saved by every block: trainer/models/attention.py). Without CP only ``block_causal`` on CPU
    has one, ``seq x seq`` per sequence (CUDA runs FlexAttention, whose block mask is negligible). Under CP:
    ``allgather``, ``local x seq`` (one per sequence with block_causal; causal: one for the batch on CUDA,
    none on CPU, whose chunked kernel needs none); ``alltoall``, ``seq x seq`` per sequence with
    block_causal, none when causal (SDPA's own causal kernel)."""
    local, seq, c = layout.local_seq_len, layout.seq_len, p.compute
    if layout.cp == 1:
        return seq * seq * sequences * c if layout.block_causal and layout.device == "cpu" else 0.0
    if layout.cp_method == "allgather":
        if layout.block_causal:
            return local * seq * sequences * c
        return 0.0 if layout.device == "cpu" else local * seq * c
    return seq * seq * sequences * c if layout.block_causal else 0.0


def context_parallel_bytes(s: Shape, p: Precision, layout: Layout, layers: int, sequences: int) -> float:
    """What context parallelism adds to a rank's activations for ``sequences`` sequences: with ``allgather``
    each block not checkpointed saves the gathered keys and values of the whole sequence (the other ranks'
    shares: ``(cp - 1) x local tokens x 2 kv x c``) for attention's backward; and the dense attention mask
    (:func:`mask_bytes`, which is all there is without CP)."""
    local = layout.local_seq_len
    kept = layers - checkpointed_layers(layers, layout.ac) if layout.ac != "selective_op" else 0
    kv = 0.0
    if layout.cp_method == "allgather":
        kv = kept * (layout.cp - 1) * sequences * local * 2 * p.compute * s.kv_dim / layout.tp
    return kv + mask_bytes(p, layout, sequences)


def expert_parallel_traffic(s: Shape, layout: Layout, compute_bytes: int) -> dict[str, float]:
    """Bytes one rank sends per MoE block and micro-batch under expert parallel (trainer/parallel/expert.py),
    evenly routed: forward, its token copies out to the experts' ranks and the outputs back (two all-to-alls of
    ``top_k x tokens x dim``, the share staying on the rank excluded); backward the same again."""
    tokens = layout.local_batch_size * layout.local_seq_len
    leaving = (layout.ep - 1) / layout.ep
    one_way = s.top_k * tokens * s.dim * compute_bytes * leaving
    return {"forward": 2 * one_way, "backward": 2 * one_way}


def context_parallel_traffic(s: Shape, layout: Layout, compute_bytes: int, sequences: int) -> dict[str, float]:
    """Bytes one rank's CP collectives move per transformer block for ``sequences`` sequences (forward and
    backward; a recomputed block repeats its forward's), in the buffers the simulator counts: ``allgather``
    all-gathers the keys and values (the gathered tensor, ``cp x local x 2 kv``) and sends their gradients
    back to their owners (an all-to-all of the same size, then a sum); ``alltoall`` exchanges q, k, v (k and v repeated to the query heads when
    their heads do not divide by cp) and the output, each ``local x width``, and their gradients back."""
    tokens = sequences * layout.local_seq_len
    kv = s.kv_dim / layout.tp
    if layout.cp_method == "allgather":
        one = layout.cp * tokens * 2 * kv * compute_bytes
        return {"forward": one, "backward": one}
    heads_kv = s.kv_dim * s.n_heads // s.dim // layout.tp
    kv_sent = kv if heads_kv % layout.cp == 0 else s.dim / layout.tp
    one = tokens * compute_bytes * (2 * s.dim / layout.tp + 2 * kv_sent)
    return {"forward": one, "backward": one}


# Below this many tokens of a sequence per CP rank, context parallelism rarely pays: a block's collectives
# move bytes in proportion to its compute (both grow with the local tokens), so what stays exposed is each
# collective's fixed latency (tens of microseconds, 2 per block forward and 2 backward with allgather, 8
# with alltoall) against matmuls that shrink with the local tokens and lose efficiency below a few
# thousand rows (the same 4096 tokens the layout search prefers per micro-batch). Above it, a block's
# matmuls take milliseconds on current GPUs for models of a billion parameters and more.
CP_MIN_LOCAL_TOKENS = 4096


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


def head_bytes(s: Shape, p: Precision, tokens: int, tp: int = 1, logits_kept: bool = False) -> dict:
    """Final norm and loss (fp32 log-softmax, its gradient in and out; under TP, loss parallel's backward
    holds one more float32 tensor of the vocabulary shard; the logits when the pipeline stage keeps them),
    per micro-batch."""
    per_vocab = (p.compute if logits_kept else 0) + (16 if tp > 1 else 12)
    return {"final_norm": norm_bytes(s, p, 1, tp) * tokens, "loss": per_vocab * s.vocab / tp * tokens}


# --------------------------------------------------------------------------------------------------
# Memory per GPU
# --------------------------------------------------------------------------------------------------


def _stage_layers(n_layers: int, pp: int) -> int:
    return math.ceil(n_layers / pp)


def memory_estimate(s: Shape, layout: Layout, *, compute_dtype: str = "bfloat16", cpu_offload: bool = False,
                    reshard_after_forward: str = "default", stage: str | None = None,
                    optimizer: str = "AdamW") -> dict[str, Any]:
    """Bytes per GPU for one layout (the busiest pipeline stage when pp > 1, or ``stage`` "first", "middle"
    or "last"). Keys are the terms of the model in the module docstring; ``sum`` is their sum, ``total``
    the step's largest moment (``_peak``). ``optimizer``: "AdamW", or "Muon" (one state per block matrix)."""
    p = Precision.for_layout(layout, compute_dtype)
    tp, pp = layout.tp, layout.pp
    shard = layout.fsdp_shard
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
        if optimizer == "Muon":  # the momentum alone for the blocks' matrices
            out["optimizer"] -= 4 * layers * s.layer_matrices / tp / shard * states
        c = p.compute
        if p.fsdp:
            # Gathered (unsharded over dp) block parameters in the compute dtype: the running block and the
            # prefetched one; in backward one block's unsharded gradient plus its fp32 reduce-scatter copy.
            block = s.gathered_layer_matrices(layout.ep) / tp + s.layer_norms
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
            sequences = layout.pp_microbatch_size
            microbatches = max(1, layout.local_batch_size // layout.pp_microbatch_size)
            in_flight = min(pp, microbatches) if first else 1
        else:
            sequences = layout.local_batch_size
            in_flight = 1
        tokens = sequences * layout.local_seq_len  # this rank's share of each sequence under CP
        act = layers_activation_bytes(s, p, layers, tokens, layout.ac, tp)
        cp_act = context_parallel_bytes(s, p, layout, layers, sequences)
        out["activations"] = (act["layers"] + cp_act) * in_flight
        out["recompute"] = act["recompute"]
        if last:
            head = head_bytes(s, p, tokens, tp, logits_kept=pp > 1)
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


def checkpoint_staging_bytes(s: Shape, layout: Layout, optimizer: str = "AdamW") -> float:
    """Host bytes per rank a background checkpoint save copies the state into (checkpoint.async_mode): the
    rank's shard of the fp32 weights and of the optimizer's state, 12 bytes per parameter it holds with
    AdamW's two moments (8 for Muon's matrices: one) (the larger pipeline stage), wherever the states live
    (cpu_offload included)."""
    stages = [None] if layout.pp == 1 else ["first", "last"]
    return max(sum(memory_estimate(s, layout, stage=stage, optimizer=optimizer)[k] for k in ("params", "optimizer"))
               for stage in stages)


def muon_exchange_bytes(s: Shape, layers: int, group_size: int, group_rank: int | None = None,
                        ns_bytes: int = 2) -> dict[str, float]:
    """Muon's exchange in one optimizer step (trainer/optim/muon.py), bytes one rank sends over its shard group of
    ``group_size`` ranks (dp_shard x tp) holding ``layers`` blocks, in the Newton-Schulz dtype (``ns_bytes``):
    ``gather``, its shards of every block matrix (the first all-to-all); ``scatter``, the whole orthogonalised
    matrices it owns (the second; owners dealt round-robin in parameter order: wq, wk, wv, wo, w1, w2, w3 per
    block). ``group_rank`` None: the group's average rank. Even shards assumed; zero for a group of one."""
    if group_size <= 1:
        return {"gather": 0.0, "scatter": 0.0}
    h, kv, f = s.dim, s.kv_dim, s.ffn
    sizes = [h * h, kv * h, kv * h, h * h, f * h, h * f, f * h] * layers
    gather = ns_bytes * sum(sizes) / group_size
    if group_rank is None:
        scatter = gather
    else:
        scatter = float(ns_bytes * sum(n for k, n in enumerate(sizes) if k % group_size == group_rank))
    return {"gather": gather, "scatter": scatter}


def _peak(out: dict, s: Shape, layout: Layout, p: Precision, layers: int, first: bool, last: bool,
          reshard_after_forward: str) -> float:
    """The largest of the step's three moments (module docstring, "total"): the loss's backward, the
    backward through the blocks, the end of backward."""
    tp, c = layout.tp, p.compute
    state = out["params"] + out["optimizer"]
    output = (0 if s.tied and first else s.vocab * s.dim) if last else 0
    root = ((s.embedding if first else 0) + output) / tp + (s.dim if last else 0)
    if p.fsdp:
        block = s.gathered_layer_matrices(layout.ep) / tp + s.layer_norms
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
        unsharded = out["params"] * layout.fsdp_shard / 4
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
                   max_tp: int = 8, min_tokens: int = 4096, cp: int = 1, cp_method: str = "allgather",
                   block_causal: bool = False, optimizer: str = "AdamW", ep: int = 1,
                   device: str = "cuda") -> list[dict]:
    """Every (tp, fsdp, ac, local batch) for ``ngpu`` GPUs with its estimate, fitting ones first, best first.

    Order among fitting layouts (a preference, not a throughput model): the smallest TP degree (TP costs
    communication on every layer); then micro-batches of at least ``min_tokens`` tokens where possible
    (small matmuls waste the GPU); then the least recomputation (none < selective op < selective N < full);
    then the largest local batch (fewer accumulation steps). Context- and expert-parallel degrees (``cp``,
    ``ep``) are kept as given."""
    rows = []
    for tp in (1, 2, 4, 8):
        if tp > max_tp or ngpu % (tp * pp * dp_replicate * cp):
            continue
        if s.n_heads % tp or (s.kv_dim // (s.dim // s.n_heads)) % tp or (s.moe_layers and s.expert_ffn % tp):
            continue
        shard = ngpu // (tp * pp * dp_replicate * cp)
        if shard % ep:
            continue
        dp = shard * dp_replicate
        lb = 1
        while lb <= max_local_batch:
            if global_batch <= 0 or global_batch % (lb * dp) == 0:
                for ac in AC_MODES:
                    layout = Layout(dp_replicate, shard, tp, pp, lb, seq_len, ac, cp=cp, cp_method=cp_method,
                                    block_causal=block_causal, ep=ep, device=device)
                    est = memory_estimate(s, layout, compute_dtype=compute_dtype, cpu_offload=cpu_offload,
                                          optimizer=optimizer)
                    fits = est["total"] <= usable_fraction * capacity_bytes
                    accum = (global_batch // (lb * dp)) if global_batch > 0 else 1
                    rows.append({"layout": layout, "estimate": est, "fits": fits, "grad_accum_steps": accum})
            lb *= 2

    def key(row):
        lay: Layout = row["layout"]
        tokens = lay.local_batch_size * lay.local_seq_len
        return (not row["fits"], lay.tp, -min(tokens, min_tokens), _recompute_rank(lay.ac), -lay.local_batch_size)

    rows.sort(key=key)
    return rows
