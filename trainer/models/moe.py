"""Mixture-of-experts feed-forward layer: token-choice top-k routing over SwiGLU experts.

A :class:`MoE` replaces a block's ``feed_forward`` with ``moe`` (Llama 4, Mixtral, DeepSeek-V3 and Qwen3 shapes).
Its names are torchtitan's, so configs, checkpoints and float8 filters carry over: ``moe.router.gate``,
``moe.experts.w1``/``w2``/``w3`` (``[experts, out, in]``: expert ``e``'s slice has an ``nn.Linear`` weight's
layout), ``moe.shared_experts`` (a dense SwiGLU every token goes through) and the buffer ``moe.expert_bias``.

One forward, with no value read on the host:

1. the router scores every token against every expert (softmax or sigmoid, in float32) and picks its
   ``top_k`` experts; the expert bias (auxiliary-loss-free balancing) only shifts the choice, never the weights;
2. the token copies are sorted by expert (a stable argsort) and the experts run as one grouped matrix multiply
   over the sorted rows (``torch._grouped_mm`` through trainer/torch_compat.py; a loop over the experts where
   torch has none, which reads the counts on the host);
3. each copy's output is weighted by its routing score (before or after the experts), put back in token order
   and summed over the ``top_k`` copies; the shared experts' output is added.

With a ``capacity_factor`` an expert takes at most ``ceil(capacity_factor * tokens * top_k / experts)`` copies
of each micro-batch, the first in token order; the copies beyond it are dropped (their output is zero and the
token keeps its residual). Without one (the default) nothing is dropped.

Balancing, two ways, both per step and independent of how the batch is split over ranks:

* **Auxiliary-loss-free** (``load_balance_coeff``, DeepSeek-V3's bias; torchtitan's name): after each optimizer
  step every expert's bias moves by ``coeff * sign(mean load - its load)`` over the step's tokens on all
  data-parallel ranks (:func:`trainer.step.balance_experts`). The bias is saved in checkpoints.
* **Auxiliary loss** (``aux_loss_coeff``): the sequence-wise balance loss of DeepSeek-V3,
  ``coeff * sum_i f_i P_i`` per sequence with ``f_i = experts / (top_k * seq) * (copies sent to expert i)``
  and ``P_i`` the mean normalised score of expert ``i`` over the sequence, averaged over the step's sequences.
  Per sequence, so one process and any data-parallel layout train on the same loss. Its gradient enters
  through the layer's output (:class:`_AttachAuxLoss`), scaled as the step scales the language-model loss
  (:func:`set_aux_loss_scale`), so pipeline stages and activation checkpointing need nothing more.

Each layer counts, over a step, the copies routed to each expert, the copies dropped and its auxiliary loss
(non-persistent buffers; activation checkpointing's recomputation may count a micro-batch twice, which
:func:`trainer.step.balance_experts` divides out). Evaluation (no gradients) counts nothing.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from trainer.models.llama.args import MoEArgs
from trainer.torch_compat import grouped_mm

logger = logging.getLogger(__name__)

class TokenChoiceRouter(nn.Module):
    """Scores ``[tokens, experts]`` (float32) and each token's ``top_k`` experts with their routing weights."""

    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.route_norm
        self.route_scale = args.route_scale

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(scores [N, E], weights [N, K], experts [N, K])`` for tokens ``x`` ``[N, dim]``."""
        w = self.gate.weight  # under tensor parallel a DTensor replicated over the TP ranks; x is local
        logits = (F.linear(x, w.to_local()) if isinstance(w, DTensor) else self.gate(x)).float()
        scores = F.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)
        choice = scores if expert_bias is None else scores + expert_bias
        experts = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, weights * self.route_scale, experts

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std, a=-3 * init_std, b=3 * init_std)


def _experts_kernel(use_grouped_mm: bool, dim: int, hidden_dim: int) -> bool:
    """Whether the experts run as a grouped matrix multiply: asked for, present in this torch, and every row
    a multiple of 16 bytes in bfloat16 (the kernel's alignment). Says so when it is not."""
    if not use_grouped_mm:
        return False
    if grouped_mm() is None:
        logger.warning("model.moe.use_grouped_mm: this torch has no grouped matrix multiply; the experts run as a "
                       "loop, which reads each step's token counts on the host")
        return False
    if dim % 8 or hidden_dim % 8:
        logger.warning(f"model.moe.use_grouped_mm: dim {dim} and expert hidden size {hidden_dim} must be multiples "
                       "of 8 for the grouped matrix multiply; the experts run as a loop")
        return False
    return True


def grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether the grouped kernel takes ``x``: bfloat16 everywhere; float32 in eager mode on CPU only (CUDA's
    kernel and the compiler's shape rules take bfloat16)."""
    return x.dtype == torch.bfloat16 or (x.device.type == "cpu" and not torch.compiler.is_compiling())


def experts_kernel_note(args, device_type: str, compute_dtype: torch.dtype, compiled: bool) -> str | None:
    """What the log says when a run's MoE experts will loop instead of using the grouped kernel asked for."""
    if args.moe is None or not args.moe.use_grouped_mm or grouped_mm() is None or compute_dtype == torch.bfloat16:
        return None
    if device_type == "cpu" and not compiled:
        return None
    where = "compiled" if device_type == "cpu" else f"on {device_type}"
    return (f"model.moe.use_grouped_mm: the grouped matrix multiply takes bfloat16 {where}; in {compute_dtype} "
            "the experts run as a loop, which reads their token counts on the host")


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def _sum_grad_over(t: torch.Tensor, mesh) -> torch.Tensor:
    """``t`` unchanged; its gradient summed over ``mesh`` (the tensor-parallel ranks) in backward. Each TP rank
    computes a part of the gradient of what enters its share of the experts' hidden units."""
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts: ``w2[e] (silu(w1[e] x) * w3[e] x)`` for the rows of ``x`` sent to ``e``."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts = num_experts  # all of them; under expert parallel this rank holds a share
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.use_grouped_mm = _experts_kernel(use_grouped_mm, dim, hidden_dim)
        # Expert parallel sets 1 / degree: an expert's gradient sums every EP rank's tokens, and data parallel
        # then averages it over the ranks holding that expert only (trainer/parallel/expert.py).
        self.grad_scale = 1.0

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``[rows, dim]`` sorted by expert, ``counts`` ``[experts]`` rows per expert -> ``[rows, dim]``."""
        # Expert parallel: this rank's experts (the local shard of a DTensor over the ep ranks). Under autocast
        # without FSDP the weights are float32 and x is not: grouped_mm takes one dtype.
        w1, w2, w3 = (_local(w).to(x.dtype) for w in (self.w1, self.w2, self.w3))
        if self.grad_scale != 1.0:
            w1, w2, w3 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        if self.use_grouped_mm and grouped_mm_runs(x):
            mm = grouped_mm()
            ends = torch.cumsum(counts, dim=0, dtype=torch.int32)
            h = F.silu(mm(x, w1.transpose(-2, -1), offs=ends)) * mm(x, w3.transpose(-2, -1), offs=ends)
            return mm(h, w2.transpose(-2, -1), offs=ends)
        outputs = []
        for e, rows in enumerate(torch.split(x, counts.tolist())):
            outputs.append(F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e]))
        return torch.cat(outputs)

    def init_weights(self, init_std: float) -> None:
        """As the dense FeedForward: ``w1``/``w3`` std 0.02, the output projection ``w2`` ``init_std``."""
        for w, std in ((self.w1, 0.02), (self.w3, 0.02), (self.w2, init_std)):
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; backward also gives ``aux`` the gradient ``scale`` (what the step's loss scaling
    gives a term added to the loss), so the auxiliary loss trains without being returned by the model."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (scale,) = ctx.saved_tensors
        return grad, scale.clone(), None


class MoE(nn.Module):
    """Routed experts (plus optional shared experts) in place of a block's feed-forward; see the module doc.

    ``expert_parallel`` (set by trainer/parallel/expert.py's ``shard_experts``): the exchange that takes each sorted
    token copy to the rank holding its expert and back; None, every expert is here.

    ``tensor_parallel`` (set by trainer/parallel/parallelize.py's ``apply_tp``): the TP mesh. The layer then
    takes the whole (all-gathered) sequence of its TP group, routes it as every TP rank does, runs its share of
    each expert's hidden units (and of the shared experts') and returns its partial sum of the output, which
    the TP plan reduce-scatters back to sequence shards. In backward the input's gradient is reduce-scattered
    (as a dense feed-forward's), and the routing weights' (one number per token copy) all-reduced."""

    expert_parallel = None
    tensor_parallel = None

    def __init__(self, args: MoEArgs, dim: int, hidden_dim: int, shared_experts: nn.Module | None = None):
        super().__init__()
        self.args = args
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.router = TokenChoiceRouter(dim, args)
        self.experts = GroupedExperts(dim, hidden_dim, args.num_experts, args.use_grouped_mm)
        self.shared_experts = shared_experts
        if args.load_balance_coeff is not None:
            self.register_buffer("expert_bias", torch.zeros(args.num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        # The step's counts (see the module doc) and the auxiliary loss's gradient scale, set by the step.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("aux_grad_scale", torch.zeros((), dtype=torch.float32), persistent=False)

    def init_weights(self, init_std: float) -> None:
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        for buffer in (self.expert_bias, self.tokens_per_expert, self.dropped_tokens, self.aux_loss_sum,
                       self.aux_grad_scale):
            if buffer is not None:
                buffer.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tensor_parallel
        if tp is not None:
            # The TP group's whole sequence (a DTensor replicated over it). Each TP rank's experts give a part of
            # its gradient: summed as the input's all-gather is undone (a reduce-scatter, as for a dense
            # feed-forward). The router's part, the same on every TP rank, enters that sum 1 / tp times.
            x = x.to_local(grad_placements=[Partial()])
        bsz, seqlen, dim = x.shape
        flat = x.reshape(-1, dim)
        routed_input = flat if tp is None else _ScaleGrad.apply(flat, 1.0 / tp.size())
        scores, weights, experts = self.router(routed_input, self.expert_bias)
        routed, counts, keep = self._routed(flat, weights, experts.flatten())
        result = routed if self.shared_experts is None else self._shared(flat) + routed
        result = result.view(bsz, seqlen, dim)
        if torch.is_grad_enabled():  # training: count, and train the auxiliary loss
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
                if keep is not None:
                    self.dropped_tokens.add_((~keep).sum())
            if self.args.aux_loss_coeff > 0:
                aux = self._sequence_aux_loss(scores.view(bsz, seqlen, -1), experts.view(bsz, -1))
                self.aux_loss_sum.add_(aux.detach())
                result = _AttachAuxLoss.apply(result, aux, self.aux_grad_scale)
        return result

    def _routed(self, flat: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The routed experts' output for tokens ``flat`` ``[N, dim]`` whose copy ``j`` (token ``j // top_k``)
        goes to expert ``slots[j]`` with routing weight ``weights.flatten()[j]``; also the copies per expert and
        which copies the capacity kept (None: dropless)."""
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, slots, torch.ones_like(slots))
        order = torch.argsort(slots, stable=True)  # copies sorted by expert, in token order within one
        sorted_weights = weights.flatten()[order]
        keep = self._within_capacity(slots[order], counts) if self.args.capacity_factor is not None else None
        if keep is not None:  # a dropped copy's weight is 0: before the experts its input is 0, and so its output
            sorted_weights = sorted_weights * keep
        rows = flat[order // self.top_k]
        if self.tensor_parallel is not None:  # each TP rank's share of the experts gives part of their gradient
            sorted_weights = _sum_grad_over(sorted_weights, self.tensor_parallel)
        if self.args.score_before_experts:
            rows = (rows.float() * sorted_weights[:, None]).to(flat.dtype)
        ep = self.expert_parallel
        if ep is None:
            out = self.experts(rows, counts)
        else:  # the rows go to the ranks that hold their experts and come back (trainer/parallel/expert.py)
            local_rows, local_counts, sent = ep.dispatch(rows, counts)
            out = ep.combine(self.experts(local_rows, local_counts), sent)
        if not self.args.score_before_experts:
            out = (out.float() * sorted_weights[:, None]).to(flat.dtype)
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        return unsorted.view(-1, self.top_k, flat.shape[1]).sum(dim=1), counts, keep

    def _shared(self, flat: torch.Tensor) -> torch.Tensor:
        """The shared experts' output; under tensor parallel this rank's partial sum of it (its share of their
        hidden units: ``w1``/``w3`` rows, ``w2`` columns)."""
        shared = self.shared_experts
        if self.tensor_parallel is None:
            return shared(flat)
        w1, w2, w3 = (_local(linear.weight) for linear in (shared.w1, shared.w2, shared.w3))
        return F.linear(F.silu(F.linear(flat, w1)) * F.linear(flat, w3), w2)

    def _within_capacity(self, sorted_slots: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """For each sorted copy: whether it is among the first ``capacity`` copies of its expert."""
        capacity = math.ceil(self.args.capacity_factor * sorted_slots.numel() / self.num_experts)
        starts = torch.cumsum(counts, dim=0) - counts
        rank = torch.arange(sorted_slots.numel(), device=sorted_slots.device) - starts[sorted_slots]
        return rank < capacity

    def _sequence_aux_loss(self, scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``coeff * sum_s L_s * seq``: the sequence-wise balance loss of each sequence, weighted by its tokens
        (the step divides by its tokens, as for the language-model loss)."""
        bsz, seqlen, num_experts = scores.shape
        if self.args.score_func == "sigmoid":
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        mean_score = scores.mean(dim=1)  # [B, E]
        sent = torch.zeros(bsz, num_experts, dtype=scores.dtype, device=scores.device).scatter_add_(
            1, experts, torch.ones_like(experts, dtype=scores.dtype))
        fraction = sent * (num_experts / (self.top_k * seqlen))
        return self.args.aux_loss_coeff * seqlen * (fraction * mean_score).sum()


def moe_layers(*modules: nn.Module) -> list[MoE]:
    """The MoE layers of ``modules`` (a model, or a rank's pipeline stages), in order."""
    return [m for module in modules for m in module.modules() if isinstance(m, MoE)]


def set_aux_loss_scale(layers: list[MoE], scale: torch.Tensor | float) -> None:
    """The gradient each layer's auxiliary loss gets this step: what the step multiplies its summed token loss
    by (1 / its tokens, times float16's loss scale)."""
    for layer in layers:
        layer.aux_grad_scale.fill_(scale)


def _counters(layers: list[MoE]) -> list[torch.Tensor]:
    return [c for layer in layers for c in (layer.tokens_per_expert, layer.dropped_tokens, layer.aux_loss_sum)]


@contextlib.contextmanager
def counted_microbatches(stage_experts: list[tuple[nn.Module, list[MoE]]], microbatches: int) -> Iterator[None]:
    """Inside (one pipeline schedule step): the MoE counts of each ``(stage, its MoE layers)`` take in the
    schedule's ``microbatches`` only. When torch's schedule infers the stages' tensor shapes (its first step,
    and the first after evaluation) it runs every stage forward and backward once before the micro-batches, on
    later stages with uninitialised inputs. What a stage counted before its second forward is held apart;
    given back when the stage ran ``microbatches`` forwards, dropped when it ran one more."""
    records = []
    for stage, layers in stage_experts:
        if not layers:
            continue
        record = {"calls": 0, "start": None, "held": None}

        def before(module, args, record=record, layers=layers):
            record["calls"] += 1
            if record["calls"] == 1:
                record["start"] = [c.clone() for c in _counters(layers)]
            elif record["calls"] == 2:  # what the first forward (and a backward since) counted: held apart
                counters = _counters(layers)
                record["held"] = [c - s for c, s in zip(counters, record["start"])]
                for c, s in zip(counters, record["start"]):
                    c.copy_(s)

        record["handle"] = stage.register_forward_pre_hook(before)
        records.append((record, layers))
    try:
        yield
    finally:
        for record, _ in records:
            record["handle"].remove()
    for record, layers in records:
        if record["held"] is not None and record["calls"] == microbatches:  # no shape inference ran
            for c, held in zip(_counters(layers), record["held"]):
                c.add_(held)


def balance_experts(layers: list[MoE], dp_group, dp: int) -> torch.Tensor | None:
    """End of a step for this rank's MoE ``layers``: their counts summed over the ``dp`` data-parallel (and
    context-parallel) ranks of ``dp_group``, each expert bias moved toward an even load (``load_balance_coeff *
    sign(mean load - load)``, centred: torchtitan's update), the counts zeroed. Returns the summed counts,
    ``[layers, experts + 2]`` in float64 (per layer: copies per expert, dropped copies, auxiliary loss sum), for
    :func:`moe_metrics`; None without MoE layers. A collective over ``dp_group``; no value is read on the host."""
    if not layers:
        return None
    stats = torch.stack([torch.cat([layer.tokens_per_expert.double(), layer.dropped_tokens.double().view(1),
                                    layer.aux_loss_sum.double().view(1)]) for layer in layers])
    if dp > 1:
        torch.distributed.all_reduce(stats, group=dp_group)
    with torch.no_grad():
        for layer, row in zip(layers, stats):
            if layer.expert_bias is not None:
                load = row[: layer.num_experts]
                step = layer.args.load_balance_coeff * torch.sign(load.mean() - load)
                layer.expert_bias.add_((step - step.mean()).float())
            for buffer in (layer.tokens_per_expert, layer.dropped_tokens, layer.aux_loss_sum):
                buffer.zero_()
    return stats


def moe_metrics(stats: torch.Tensor | None, *, top_k: int, tokens: int, device: torch.device,
                pp_group=None) -> dict[str, float]:
    """The log record's MoE fields from :func:`balance_experts`'s counts of one step of ``tokens`` tokens (all
    data-parallel ranks): ``moe_aux_loss`` (the auxiliary loss summed over the layers), ``moe_tokens_per_expert_min``
    and ``_max`` (the least and most loaded expert of any layer, in token copies), ``moe_load_imbalance`` (the worst
    layer's most loaded expert over its mean load; 1 is even) and ``moe_dropped_tokens``. Under pipeline parallelism
    a collective over ``pp_group`` (every stage calls it, ``stats`` None where a stage has no MoE layer).

    Activation checkpointing's recomputation may have counted a micro-batch twice: each layer's counts are scaled
    to ``tokens * top_k`` copies, which every layer routes exactly once per step."""
    # [aux loss, dropped | -min load, max load, imbalance]: sums, then maxima; a stage without MoE layers adds
    # the neutral values.
    inf = float("inf")
    summary = torch.tensor([0.0, 0.0, -inf, -inf, -inf], dtype=torch.float64, device=device)
    if stats is not None:
        experts = stats.shape[1] - 2
        factor = stats[:, :experts].sum(dim=1, keepdim=True) / (tokens * top_k)
        scaled = stats / factor.clamp(min=1e-30)
        load = scaled[:, :experts]
        summary = torch.stack([scaled[:, -1].sum() / tokens, scaled[:, -2].sum(), -load.min(), load.max(),
                               (load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-30)).max()])
    if pp_group is not None:
        sums, highs = summary[:2].clone(), summary[2:].clone()
        torch.distributed.all_reduce(sums, group=pp_group)
        torch.distributed.all_reduce(highs, op=torch.distributed.ReduceOp.MAX, group=pp_group)
        summary = torch.cat([sums, highs])
    aux, dropped, low, high, imbalance = summary.tolist()
    return {"moe_aux_loss": aux, "moe_tokens_per_expert_min": round(-low), "moe_tokens_per_expert_max": round(high),
            "moe_load_imbalance": imbalance, "moe_dropped_tokens": round(dropped)}
