"""Expert parallelism: the routed experts of every MoE layer split over ``ep`` ranks, tokens sent to the rank
that holds their expert and back.

The ``ep`` ranks are a part of the data-parallel (FSDP) ranks: ``dp_shard = efsdp x ep`` (ParallelDims), so each
EP rank brings its own tokens. Expert ``e``'s weights live on EP rank ``e // (experts / ep)`` (a DTensor sharded on
the expert dimension over the ``ep`` mesh); FSDP then shards each rank's experts over the ``efsdp`` ranks that
hold the same ones (trainer/parallel/parallelize.py), and everything else over all of ``dp_shard`` as before.

In a layer's forward (:class:`ExpertParallel`, called by ``MoE.forward`` between sorting and unsorting):

1. each rank sends every other its number of token copies per expert (an all-to-all of ``experts`` counts), so
   both sides know the sizes of the exchange (read on the host: the one sync of a layer);
2. the copies, sorted by expert, go to the ranks holding their experts (a variable-size all-to-all), arrive
   grouped by sender, and are regrouped by local expert for the grouped matrix multiply;
3. the outputs are put back in the order they arrived and return to their senders (the reverse all-to-all).

Both exchanges are autograd functions over torch.distributed (:class:`_AllToAllV`), so gloo on CPU and NCCL on
GPU run the same code. A token's output does not depend on the EP degree: the same expert weights meet the same
rows. An expert's weight gradient sums the contributions of every sender; FSDP then averages it over the ranks
holding that expert only, so the experts scale their gradients by ``1 / ep`` (``GroupedExperts.grad_scale``, in
the graph: no reduction option that gloo lacks), and every gradient is the average over all data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


class _AllToAllV(torch.autograd.Function):
    """All-to-all of rows along dim 0 with per-rank sizes: ``send[j]`` rows go to rank j, ``recv[j]`` come from
    it (in rank order); backward sends the gradients the other way."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = t.new_empty((sum(recv), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


@dataclass
class Dispatched:
    """What :meth:`ExpertParallel.combine` needs to send a dispatch's outputs back."""

    send: list[int]
    recv: list[int]
    order: torch.Tensor  # arrival position of each row in local-expert order


@dataclass
class ExpertParallel:
    """One MoE layer's expert-parallel exchange over ``group`` (``degree`` ranks, this one ``rank``)."""

    group: object
    degree: int
    rank: int
    # trainer simulate: fake tensors hold no counts, so every rank sends each the same share of its rows.
    even_routing: bool = False

    @torch.compiler.disable  # eager under torch.compile: collectives with sizes read on the host
    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
        """``rows`` sorted by (global) expert with ``counts`` per expert -> the rows this rank's experts take,
        sorted by local expert, their counts per local expert, and the state :meth:`combine` needs."""
        local = counts.numel() // self.degree
        with torch.no_grad():
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts.contiguous(), group=self.group)
        if self.even_routing:
            return self._dispatch_evenly(rows, local)
        with torch.no_grad():
            received = received.view(self.degree, local)  # [sender, local expert]
            sizes = torch.stack([counts.view(self.degree, local).sum(1), received.sum(1)]).tolist()
            # Arrived grouped by sender, then by local expert: regroup by local expert, senders in order.
            expert_of_row = torch.arange(local, device=counts.device).repeat(self.degree).repeat_interleave(
                received.flatten())
            order = torch.argsort(expert_of_row, stable=True)
        send, recv = sizes
        arrived = _AllToAllV.apply(rows, send, recv, self.group)
        return arrived[order], received.sum(0), Dispatched(send, recv, order)

    def _dispatch_evenly(self, rows: torch.Tensor, local: int) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
        """:meth:`dispatch` for an evenly routed batch: ``rows / degree`` to each rank, as many from each."""
        sizes = _even_split(rows.shape[0], self.degree)
        arrived = _AllToAllV.apply(rows, sizes, sizes, self.group)
        counts = torch.tensor(_even_split(arrived.shape[0], local), dtype=torch.int64, device=rows.device)
        return arrived, counts, Dispatched(sizes, sizes, torch.arange(arrived.shape[0], device=rows.device))

    @torch.compiler.disable
    def combine(self, out: torch.Tensor, state: Dispatched) -> torch.Tensor:
        """The experts' outputs (local-expert order) back to their senders, in the order they were sent."""
        arrived = torch.empty_like(out)
        arrived[state.order] = out
        return _AllToAllV.apply(arrived, state.recv, state.send, self.group)


def _even_split(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


# The hidden dimension of each routed expert weight (``[experts, out, in]``): what tensor parallel splits.
HIDDEN_DIM = {"w1": 1, "w3": 1, "w2": 2}


def shard_experts(model: nn.Module, ep_mesh=None, tp_mesh=None, ep_tp_mesh=None) -> None:
    """Split the routed experts of every MoE layer of ``model`` (on the meta device): over the ``ep_mesh`` ranks
    on the expert dimension (expert parallel), over the ``tp_mesh`` ranks on the hidden one (tensor parallel:
    ``w1``/``w3`` rows, ``w2`` columns), or both on ``ep_tp_mesh``. Their weights become DTensors, and under
    expert parallel each layer gets its :class:`ExpertParallel`."""
    from torch.distributed.tensor import Shard

    from trainer.models.moe import moe_layers
    from trainer.parallel import distribute_parameter

    for layer in moe_layers(model):
        experts = layer.experts
        for name in HIDDEN_DIM:
            hidden = Shard(HIDDEN_DIM[name])
            if ep_mesh is not None and tp_mesh is not None:
                mesh, placements = ep_tp_mesh, [Shard(0), hidden]
            else:
                mesh, placements = (ep_mesh, [Shard(0)]) if ep_mesh is not None else (tp_mesh, [hidden])
            distribute_parameter(experts, name, mesh, placements)
        if ep_mesh is None:
            continue
        layer.expert_parallel = ExpertParallel(ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank())
        # Each expert's gradient sums the contributions of the tokens of all ep ranks, and FSDP averages it over
        # the dp_shard / ep ranks that hold the same expert: 1 / ep makes that the average over all of dp_shard.
        experts.grad_scale = 1.0 / ep_mesh.size()
