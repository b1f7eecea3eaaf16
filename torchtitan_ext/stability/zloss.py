"""z-loss (PaLM): ``weight * mean over tokens of logsumexp(logits)^2``, keeping the softmax normaliser near 1.

Under tensor-parallel loss parallel the logits are a DTensor sharded on the vocabulary dimension; the
log-sum-exp is then computed from the local shard with one max and one sum all-reduce over the
tensor-parallel group (the full logits are never gathered).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from trainer.callbacks import Callback


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose result is used identically on every rank (a replicated value): the gradient
    with respect to each rank's input is the incoming gradient itself."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def logsumexp_last_dim(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp(logits.float(), -1)`` as a plain tensor, for plain logits or vocabulary-sharded DTensors."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(logits, DTensor):
        return torch.logsumexp(logits.float(), dim=-1)
    placements = logits.placements
    if all(isinstance(p, Replicate) for p in placements):
        return torch.logsumexp(logits.to_local().float(), dim=-1)
    vocab_dim = logits.ndim - 1
    if logits.device_mesh.ndim != 1 or not (isinstance(placements[0], Shard) and placements[0].dim in (-1, vocab_dim)):
        raise RuntimeError(
            f"stability.z_loss_weight: unsupported logits layout {placements} on a {logits.device_mesh.ndim}-D mesh; "
            "z-loss supports replicated logits or logits sharded on the vocabulary dimension over one mesh "
            "dimension (tensor-parallel loss parallel). Set parallelism.disable_loss_parallel = true to use "
            "gathered logits instead."
        )
    group = logits.device_mesh.get_group()
    local = logits.to_local().float()
    # The max only stabilises exp(); any constant gives the same value and gradient, so it is detached.
    m = local.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    sum_exp = _SumOverGroup.apply((local - m).exp().sum(dim=-1), group)
    return sum_exp.log() + m.squeeze(-1)


def z_loss(logits: torch.Tensor, weight: float, tokens: int) -> torch.Tensor:
    """``weight * sum over the micro-batch's tokens of lse^2 / tokens`` (tokens: the step's count on this
    rank, as for the cross-entropy)."""
    lse = logsumexp_last_dim(logits)
    return weight * lse.pow(2).sum() / tokens


class ZLoss(Callback):
    """Adds the z-loss to every micro-batch's loss and reports the step's z-loss as ``z_loss``."""

    name = "z_loss"

    def __init__(self, weight: float):
        self.weight = weight
        self._values: list[torch.Tensor] = []  # this step's z-loss per loss call (detached)

    def on_batches(self, run, step: int, batches: list[dict]) -> list[dict]:
        self._values = []
        return batches

    def extra_loss(self, run, logits: torch.Tensor, loss: torch.Tensor, tokens: int) -> torch.Tensor:
        if self.weight <= 0:
            return loss
        z = z_loss(logits, self.weight, tokens)
        self._values.append(z.detach())
        from torch.distributed.tensor import DTensor, Replicate

        if isinstance(loss, DTensor) and not isinstance(z, DTensor):
            z = DTensor.from_local(z, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
            if z.placements != loss.placements:
                z = z.redistribute(loss.device_mesh, loss.placements)
        return loss + z

    def step_total(self, run) -> torch.Tensor | None:
        """This rank's z-loss for the step. Under pipelining, torch's schedule calls the loss function once
        more on its first step, on placeholder activations, to infer gradient shapes; only the last
        ``accum_steps x n_microbatches`` calls are real micro-batches."""
        values = self._values
        if run.pp_microbatches:
            values = values[-run.pp_microbatches * run.accum_steps:]
        return torch.stack([v.float().reshape(()) for v in values]).sum() if values else None

    def metrics(self, run, step: int) -> dict[str, Any]:
        if self.weight <= 0:
            return {}
        # Every rank takes part (a collective): pipeline stages without the output contribute 0.
        total = self.step_total(run)
        z = run.global_loss(total if total is not None else torch.zeros((), device=run.device))
        value = z.item()
        # z-loss is positive whenever it was computed: 0 means no forward ran (a step skipped in advance).
        return {"z_loss": value if value != 0.0 else float("nan")}
