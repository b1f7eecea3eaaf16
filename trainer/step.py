"""The training step as free functions: the loss, forward/backward over a step's micro-batches (one model or a
pipeline schedule), the global gradient norm and clipping, the optimizer step under a skip verdict, and the
loss averaged over all ranks.

``Trainer.train_step`` and ``trainer simulate`` both call these, so what the simulator measures is the step
that trains. Nothing here reads a device value on the host: losses, norms and skip verdicts stay tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from trainer.models.moe import counted_microbatches, moe_layers, set_aux_loss_scale
from trainer.optim.loss_scale import LossScaler
from trainer.parallel.context import shard_batch

# (logits, loss already divided by the step's tokens, the step's tokens per rank) -> the loss with added terms
ExtraLoss = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies (float32); callers divide by the step's token count."""
    # Mean then scale: loss-parallel cross-entropy supports the mean reduction.
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1)) * labels.numel()


def uses_loss_parallel(tp: int, disable_loss_parallel: bool) -> bool:
    """Under TP the output layer leaves the logits sharded over the vocabulary unless this is switched off."""
    return tp > 1 and not disable_loss_parallel


def loss_parallel(enabled: bool):
    """Context for the loss and its backward: cross-entropy on vocabulary shards under TP.
    (Not re-entrant: leaving a nested loss_parallel context removes its handlers.)"""
    if enabled:
        return torch.distributed.tensor.parallel.loss_parallel()
    return contextlib.nullcontext()


def autocast_context(device_type: str, compute_dtype: torch.dtype, fsdp_enabled: bool):
    """Precision: FSDP casts parameters itself; without FSDP, autocast to the compute dtype."""
    if compute_dtype != torch.float32 and not fsdp_enabled:
        return torch.autocast(device_type, dtype=compute_dtype)
    return contextlib.nullcontext()


def plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (e.g. the loss under loss parallel) as an ordinary tensor."""
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


def model_kwargs(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's inputs to the model besides the tokens: the document positions when the loader emits them
    (block_causal attention needs them; a causal model ignores them)."""
    positions = batch.get("positions")
    return {} if positions is None else {"positions": positions.to(device, non_blocking=True)}


def forward_backward(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], *, device: torch.device,
                     autocast, parallel_loss: bool, loss_fn: Callable = loss_fn, extra_loss: ExtraLoss | None = None,
                     mark: Callable = record_function, loss_scale: torch.Tensor | None = None,
                     context_parallel=None) -> torch.Tensor:
    """Accumulate gradients over the micro-batches; returns this rank's mean token loss (detached).

    ``autocast`` is the context the forward runs in (:func:`autocast_context`), ``parallel_loss`` whether the
    loss runs in :func:`loss_parallel`; ``mark(name)`` opens the "forward", "loss" and "backward" ranges
    (profiler ranges; the simulator's phases). ``loss_scale`` (float16 training's, a 0-d tensor) multiplies
    the loss backward runs on, not the loss returned. ``context_parallel`` (the model's, or None): each
    batch is split to this CP rank's tokens first, and the loss is the mean over them (averaged over the
    CP ranks like data-parallel ranks: trainer/parallel/context.py)."""
    batches = [shard_batch(b, context_parallel) for b in batches]
    tokens_per_rank = sum(b["labels"].numel() for b in batches)
    # A mixture of experts' layers (found only in a model that has them: this runs every step).
    experts = moe_layers(model) if getattr(getattr(model, "args", None), "moe", None) is not None else []
    if experts:
        set_aux_loss_scale(experts, _aux_loss_scale(tokens_per_rank, loss_scale))
    total = torch.zeros((), device=device)
    for batch in batches:
        inputs = batch["input"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        with mark("forward"), autocast:
            logits = model(inputs, **model_kwargs(batch, device))
        # Loss parallel needs backward inside its context too.
        with loss_parallel(parallel_loss):
            with mark("loss"):
                loss = loss_fn(logits, labels) / tokens_per_rank
                if extra_loss is not None:
                    loss = extra_loss(logits, loss, tokens_per_rank)
            # The loss saved what its backward needs (the log-softmax); the logits themselves
            # (vocabulary x tokens, the largest activation) would otherwise live through backward.
            del logits
            with mark("backward"):
                (loss if loss_scale is None else loss * loss_scale).backward()
        total += plain(loss.detach())
    return total


def _aux_loss_scale(tokens_per_rank: int, loss_scale: torch.Tensor | None) -> torch.Tensor | float:
    """What the step multiplies a summed token loss by before backward: an MoE layer's auxiliary loss (summed
    over its tokens) gets the same."""
    return 1.0 / tokens_per_rank if loss_scale is None else loss_scale / tokens_per_rank


class PipelineLoss:
    """The loss a pipeline schedule calls on each micro-batch its last stage finishes: normalised by the
    rank's tokens in the whole step (``tokens_per_rank``, set before each step), plus the extra terms. With
    a ``scale`` (float16 training's loss scale, set before each step) the schedule's backward runs on the
    scaled loss, and ``unscaled`` pairs each loss returned with the loss as it was (:meth:`unscaled_of`)."""

    def __init__(self, loss_fn: Callable = loss_fn, extra_loss: ExtraLoss | None = None):
        self.loss_fn = loss_fn
        self.extra_loss = extra_loss
        # This rank's stages with their MoE layers, and the micro-batches of a schedule step (set once the
        # stages are built): the layers' auxiliary losses are scaled as the loss is, and count micro-batches only.
        self.stage_experts: list[tuple[torch.nn.Module, list]] = []
        self.microbatches = 0
        self.tokens_per_rank = 0
        self.scale: torch.Tensor | None = None
        self.unscaled: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits, labels) / self.tokens_per_rank
        if self.extra_loss is not None:
            loss = self.extra_loss(logits, loss, self.tokens_per_rank)
        if self.scale is None:
            return loss
        scaled = loss * self.scale
        self.unscaled.append((scaled, loss.detach()))
        return scaled

    def unscaled_of(self, scaled: torch.Tensor) -> torch.Tensor:
        """The loss before scaling of a loss this returned. By identity: the schedule hands back the very
        tensors, and may call the loss more often than it has micro-batches (torch >= 2.13 infers the
        backward's shapes by calling it once, on the first step)."""
        return next(kept for out, kept in self.unscaled if out is scaled)


def forward_backward_pipeline(schedule, batches: list[dict[str, torch.Tensor]], *, pipeline_loss: PipelineLoss,
                              device: torch.device, autocast, parallel_loss: bool, has_first: bool,
                              has_last: bool, loss_scale: torch.Tensor | None = None,
                              context_parallel=None) -> torch.Tensor:
    """:func:`forward_backward` through this rank's pipeline stages: the schedule runs each local batch as
    micro-batches and calls ``pipeline_loss`` (the loss it was built with) on the last stage. Only ranks
    holding the last stage have a loss; the others return 0. ``loss_scale``, ``context_parallel``: as for
    :func:`forward_backward`."""
    batches = [shard_batch(b, context_parallel) for b in batches]
    pipeline_loss.tokens_per_rank = sum(b["labels"].numel() for b in batches)
    pipeline_loss.scale = loss_scale
    experts = [layer for _, layers in pipeline_loss.stage_experts for layer in layers]
    if experts:
        set_aux_loss_scale(experts, _aux_loss_scale(pipeline_loss.tokens_per_rank, loss_scale))
    total = torch.zeros((), device=device)
    for batch in batches:
        inputs = batch["input"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        losses: list[torch.Tensor] = []
        args = (inputs,) if has_first else ()
        kwargs = {"target": labels, "losses": losses} if has_last else {}
        # The document positions go to every stage (the schedule splits keyword inputs into micro-batches and
        # hands them to each stage's forward): each stage builds its blocks' block_causal mask from them.
        kwargs.update(model_kwargs(batch, device))
        # The schedule computes the loss and runs backward inside, hence the loss-parallel context around it.
        pipeline_loss.unscaled = []
        with record_function("forward_backward"), autocast, loss_parallel(parallel_loss), \
                counted_microbatches(pipeline_loss.stage_experts, pipeline_loss.microbatches):
            schedule.step(*args, **kwargs, return_outputs=False)
        for loss in losses:
            total += plain(loss.detach() if loss_scale is None else pipeline_loss.unscaled_of(loss))
    pipeline_loss.unscaled = []
    return total


def clip_grad_norm(model_parts: list[torch.nn.Module], max_norm: float, pp_group=None) -> torch.Tensor:
    """Global gradient norm over every parameter (all shards, and all pipeline stages over ``pp_group``, None
    without pipelining); clips in place when ``max_norm`` > 0."""
    params = [p for part in model_parts for p in part.parameters() if p.grad is not None]
    # One norm per device mesh (expert parallel puts the experts on a mesh of their own), then combined; with one
    # mesh, that norm as it is.
    by_mesh: dict = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [plain(torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, foreach=True))
             for group in by_mesh.values()] or [torch.nn.utils.get_total_norm([], norm_type=2.0)]
    norm = norms[0] if len(norms) == 1 else torch.stack(norms).pow(2).sum().sqrt()
    if pp_group is not None:
        squared = norm.pow(2)
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


def clip_and_step(model_parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer, *, max_norm: float,
                  pp_group=None, should_skip: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                  scaler: LossScaler | None = None) -> tuple[torch.Tensor, bool | torch.Tensor]:
    """Clip to the global norm, ask ``should_skip(grad_norm)`` for a verdict (a 0-d bool on the device, or
    None), step the optimizer unless it says skip (fused AdamW applies a device verdict without a host
    sync), zero the gradients. Returns the norm and the verdict (False when there was none).

    With float16's ``scaler`` the gradients are unscaled first (the norm, the clipping and ``should_skip``
    see the true gradients), an overflow anywhere skips the step on every rank, and the scale is updated."""
    if scaler is not None:
        scaler.unscale_(model_parts)
    grad_norm = clip_grad_norm(model_parts, max_norm, pp_group)
    overflow = scaler.found_overflow(grad_norm) if scaler is not None else None
    skip = should_skip(grad_norm) if should_skip is not None else None
    if overflow is not None:
        skip = overflow if skip is None else skip | overflow
    optimizer.step_or_skip(skip)
    if scaler is not None:
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, False if skip is None else skip


def global_loss(local_loss: torch.Tensor, *, pp_group, dp_group, dp: int) -> torch.Tensor:
    """The step's mean token loss over all ranks: summed over pipeline stages (only the last has it; over
    ``pp_group``, None without pipelining), averaged over the ``dp`` ranks of ``dp_group`` (data parallel,
    and context parallel: each CP rank's loss is the mean over its share of the tokens). A collective:
    every rank must call it."""
    loss = local_loss.detach().clone()
    if pp_group is not None:
        dist.all_reduce(loss, group=pp_group)
    if dp > 1:
        dist.all_reduce(loss, group=dp_group)
        loss /= dp
    return loss
