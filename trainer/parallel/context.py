"""Context parallelism (CP): each sequence split over the ``cp`` ranks of the mesh, attention exchanging what
the split separates.

The split is head-tail (torchtitan's ``headtail`` load balancer): the sequence is cut into ``2 x cp`` equal
chunks and CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, so under a causal mask every rank has the same
attention work (an early chunk sees few keys, its partner at the end sees many). Inputs, labels and document
positions are split the same way before the model (:func:`shard_batch`); everything outside attention
(embedding, norms, MLP, output layer, loss) then runs on the local tokens unchanged.

Attention, with autograd-aware collectives (autograd Functions around ``torch.distributed``'s: gloo on CPU,
NCCL on GPU):

* ``allgather`` (Llama 3's method): keys and values are all-gathered over ``cp`` (one collective per layer;
  its backward sums the gradients back to their owners: an all-to-all and a sum), put back in sequence
  order, and the local queries attend to them: causal on CPU without a mask, each local chunk over the keys
  up to its end only (two flash-attention calls merged by their log-sum-exp, :class:`_CausalChunks`), else
  under the causal (or document) mask written for their global positions.
* ``alltoall`` (Ulysses): an all-to-all turns "local tokens, all heads" into "all tokens, heads / cp heads"
  before attention and another one turns it back after, so each rank runs ordinary attention over the whole
  sequence for its share of the heads. Key/value heads not divisible by ``cp`` are repeated to the query heads
  first (grouped-query attention's sharing, made explicit).

The model reads nothing of this but :meth:`ContextParallel.model_inputs`, which gives a block's attention the
RoPE rows of its tokens' global positions and a :class:`ContextParallelMask` (``attention()`` calls its
``attend``). The loss is normalised by the local tokens, and the loss, the gradients (FSDP over
``dp_shard x cp``) and the metrics are averaged over the CP ranks as over data-parallel ones: with equal
token counts per rank, the mean of the local means is the mean over the sequence.

The CUDA fast paths (torch's experimental ``context_parallel`` ring attention, FlexAttention block masks)
are not used: on CUDA, and for ``block_causal`` everywhere, SDPA takes a dense additive mask,
``[local tokens x sequence]`` per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer import torch_compat
from trainer.models.attention import additive_mask

# torch 2.13 renamed all_gather_into_tensor (the old name warns); torch >= 2.11 is supported.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# The batch entries that run along the sequence (dimension 1) and are split.
SEQUENCE_KEYS = ("input", "labels", "positions")


def headtail_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global indices of CP rank ``rank``'s tokens: chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``."""
    chunk = seq_len // (2 * cp)
    head = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([head, tail])


def gathered_index(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """The global index of each token of the ranks' local shards concatenated in rank order (what an
    all-gather over ``cp`` gives)."""
    return torch.cat([headtail_index(seq_len, cp, r, device) for r in range(cp)])


def shard_sequence(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's head-tail share of ``t`` along ``dim`` (its length must be a multiple of ``2 cp``)."""
    return t.index_select(dim, headtail_index(t.shape[dim], cp, rank, t.device))


def unshard_sequence(gathered: torch.Tensor, cp: int, dim: int = 1) -> torch.Tensor:
    """The whole sequence in order from the ranks' shards concatenated in rank order (the inverse of
    :func:`shard_sequence` over all ranks)."""
    order = torch.argsort(gathered_index(gathered.shape[dim], cp, gathered.device))
    return gathered.index_select(dim, order)


def shard_batch(batch: dict, cp: "ContextParallel | None") -> dict:
    """The batch with its inputs, labels and document positions split to this CP rank's tokens (the batch
    itself when there is no context parallelism)."""
    if cp is None:
        return batch
    seq_len = batch["input"].shape[1]
    if seq_len % (2 * cp.degree):
        # The config rule checks training.seq_len; a batch of another length (a callback's) lands here.
        raise ValueError(f"context parallel: a batch of {seq_len} tokens per sequence does not split into "
                         f"2 x {cp.degree} chunks")
    return {k: (shard_sequence(v, cp.degree, cp.rank) if k in SEQUENCE_KEYS and torch.is_tensor(v) else v)
            for k, v in batch.items()}


@dataclass
class ContextParallel:
    """This rank's place in the ``cp`` mesh dimension and the rotate method; set on the model (and on each
    pipeline stage) as ``context_parallel`` by ``parallelize``."""

    group: object  # the cp process group
    degree: int
    rank: int
    method: str  # "allgather" | "alltoall"
    # Between blocks, tensor parallel's sequence parallelism splits the local tokens further over the TP
    # ranks (the model sees 1 / tp of them; attention all of them).
    sequence_shards: int = 1

    def gather_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The whole sequence's document positions (``[batch, seq]``, in order) from each rank's share: the
        document boundaries near a chunk's edge are on the neighbouring rank. Integers: no gradient."""
        parts = [torch.empty_like(positions) for _ in range(self.degree)]
        dist.all_gather(parts, positions.contiguous(), group=self.group)
        return unshard_sequence(torch.cat(parts, dim=1), self.degree)

    def model_inputs(self, rope_cache: torch.Tensor, local_len: int, positions: torch.Tensor | None, *,
                     block_causal: bool, rope_restart: bool,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, "ContextParallelMask"]:
        """The RoPE rows of this rank's tokens (their global positions) and the attention mask object for a
        forward over ``local_len`` local tokens; ``positions`` (this rank's share of the document positions)
        only with ``block_causal``; ``dtype``: the attention's (of the masks)."""
        from trainer.models.attention import segment_positions, segment_starts

        device = rope_cache.device
        seq_len = local_len * self.degree
        if seq_len > rope_cache.shape[0]:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {rope_cache.shape[0]}")
        index = headtail_index(seq_len, self.degree, self.rank, device)
        segments = None
        rope = rope_cache[index]  # [local, head_dim // 2, 2]: the rows of the tokens' global positions
        if block_causal and positions is not None:
            starts = segment_starts(self.gather_positions(positions))
            segments = torch.cumsum(starts, dim=1, dtype=torch.int32)  # [batch, seq]: a segment's number
            if rope_restart:
                rope = rope_cache[segment_positions(starts)[:, index]]  # [batch, local, head_dim // 2, 2]
        return rope, ContextParallelMask(self, seq_len, index, segments, dtype)


class ContextParallelMask:
    """What every attention layer of one forward needs under CP: the global positions of the local tokens
    (``index``, ``[local]``) and, for ``block_causal``, each token's segment over the whole sequence
    (``segments``, ``[batch, seq]`` segment numbers in sequence order; None: causal), and the mask built
    from them in the attention's ``dtype`` (additive: attention.additive_mask). ``attention()`` hands its
    queries, keys and values to :meth:`attend`.

    A plain class, not a dataclass: FSDP rebuilds the dataclasses among a block's inputs (to cast their
    tensors), which would build the mask again in every block and keep each copy for backward."""

    def __init__(self, cp: ContextParallel, seq_len: int, index: torch.Tensor, segments: torch.Tensor | None,
                 dtype: torch.dtype = torch.float32):
        self.cp, self.seq_len, self.index, self.segments, self.dtype = cp, seq_len, index, segments, dtype
        device = index.device
        self.gathered = gathered_index(self.seq_len, self.cp.degree, device)  # in order -> gathered
        self.order = torch.argsort(self.gathered)  # gathered -> in order
        self.flash_ops = None
        if self.cp.method == "allgather" and self.segments is None and device.type == "cpu":
            # Causal on CPU: no mask at all. Each local chunk attends the keys before it in full and itself
            # causally (:class:`_CausalChunks`), so the keys after it cost nothing: every rank does 1 / cp of
            # the causal work, where a dense mask would make it compute (and save) local x sequence scores.
            self.flash_ops = torch_compat.cpu_flash_attention_ops()
            self.mask = None
        elif self.cp.method == "allgather":
            # Local queries (rows, at their global positions) over the whole sequence in order (columns).
            keys = torch.arange(self.seq_len, device=device)
            mask = (self.index[:, None] >= keys[None, :])[None, None]
            if self.segments is not None:
                mask = mask & (self.segments[:, self.index, None] == self.segments[:, None, :])[:, None]
            self.mask = additive_mask(mask, self.dtype)
        elif self.segments is not None:  # alltoall: the whole sequence in order on both sides
            same = self.segments[:, :, None] == self.segments[:, None, :]
            causal = torch.ones(self.seq_len, self.seq_len, dtype=torch.bool, device=device).tril()
            self.mask = additive_mask((same & causal)[:, None], self.dtype)
        else:
            self.mask = None  # alltoall, causal: SDPA's is_causal over the sequence in order

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of this rank's queries ``[batch, heads, local, head_dim]`` over the whole sequence's keys
        and values; the result has the queries' shape."""
        if self.cp.method == "allgather":
            return self._allgather(q, k, v)
        return self._alltoall(q, k, v)

    def _sdpa(self, q, k, v, mask):
        from trainer.models.attention import sdpa_backends

        with sdpa_backends(q):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                  enable_gqa=q.shape[1] != k.shape[1])

    def _allgather(self, q, k, v):
        # Keys and values in one collective; its backward returns each rank the gradient of its own share.
        parts = _GatherShards.apply(torch.stack([k, v]), self.cp.group, self.cp.degree)  # [cp, 2, b, h, local, d]
        kv = parts.permute(1, 2, 3, 0, 4, 5).flatten(3, 4).index_select(3, self.order)  # [2, b, h, seq, d]
        if self.flash_ops is not None:
            degree, rank = self.cp.degree, self.cp.rank
            return _CausalChunks.apply(q, kv[0], kv[1], (rank, 2 * degree - 1 - rank), self.seq_len // (2 * degree),
                                       self.flash_ops)
        return self._sdpa(q, kv[0], kv[1], self.mask)

    def _alltoall(self, q, k, v):
        cp = self.cp.degree
        heads = q.shape[1]
        if k.shape[1] % cp:  # fewer key/value heads than CP ranks can share: one per query head
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        q, k, v = (self._to_heads(t) for t in (q, k, v))
        out = self._sdpa(q, k, v, self.mask)  # [batch, heads / cp, seq, head_dim], sequence in order
        return self._to_sequence(out)

    def _to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[batch, heads, local, d] -> [batch, heads / cp, seq, d]: rank j gets head group j of every rank's
        tokens."""
        cp = self.cp.degree
        sends = t.unflatten(1, (cp, -1)).movedim(1, 0)  # [cp, batch, heads / cp, local, d]: to rank j, group j
        received = _AllToAll.apply(sends, self.cp.group)  # [cp, ...]: from rank j, its tokens
        return received.permute(1, 2, 0, 3, 4).flatten(2, 3).index_select(2, self.order)

    def _to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_to_heads`: [batch, heads / cp, seq, d] -> [batch, heads, local, d]."""
        cp = self.cp.degree
        sends = t.index_select(2, self.gathered).unflatten(2, (cp, -1)).movedim(2, 0)  # to rank j: its tokens
        received = _AllToAll.apply(sends, self.cp.group)  # [cp, batch, heads / cp, local, d]: from rank j, group j
        return received.movedim(0, 1).flatten(1, 2)


class _GatherShards(torch.autograd.Function):
    """All-gather over ``group`` into a new leading dimension (``[degree, *shape]``, rank order); backward
    sums each rank's gradient of every shard back to its owner (a reduce-scatter, as an all-to-all and a
    sum)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group, degree: int) -> torch.Tensor:
        ctx.group = group
        out = t.new_empty((degree * t.shape[0], *t.shape[1:]))  # the collective concatenates along dim 0
        _ALL_GATHER(out, t.contiguous(), group=group)
        return out.unflatten(0, (degree, -1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # A reduce-scatter written as an all-to-all and a sum: gloo has no reduce-scatter, and one code path
        # on every backend is the one the CPU tests check (NCCL's reduce-scatter would save the receive
        # buffer, the size of the gathered gradient, for as long as the sum takes).
        received = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(received, grad.contiguous(), group=ctx.group)
        return received.sum(0), None, None


class _CausalChunks(torch.autograd.Function):
    """Causal attention of this rank's query chunks over the whole sequence's keys and values (in order) without
    a mask: query chunk ``i`` (global chunk ``chunks[i]`` of ``size`` tokens) attends the keys before its chunk
    in full and its own chunk causally, as two flash-attention calls merged by their log-sum-exp; the keys
    after it are not computed at all. Backward runs the flash backward of each part with the merged output
    and log-sum-exp (which give each part its share of the softmax). ``ops``: the forward and backward flash
    kernels (:func:`trainer.torch_compat.cpu_flash_attention_ops`)."""

    @staticmethod
    def forward(ctx, q, k, v, chunks: tuple[int, ...], size: int, ops):
        forward_op, _ = ops
        rep = q.shape[1] // k.shape[1]
        kr, vr = (t.repeat_interleave(rep, dim=1) if rep > 1 else t for t in (k, v))
        outs, lses = [], []
        for i, g in enumerate(chunks):
            qi = q[:, :, i * size:(i + 1) * size]
            out, lse = forward_op(qi, kr[:, :, g * size:(g + 1) * size], vr[:, :, g * size:(g + 1) * size], 0.0, True)
            if g > 0:  # the keys before the chunk, all visible
                out_p, lse_p = forward_op(qi, kr[:, :, :g * size], vr[:, :, :g * size], 0.0, False)
                merged = torch.logaddexp(lse_p, lse)
                out = (out_p.float() * (lse_p - merged).exp().unsqueeze(-1)
                       + out.float() * (lse - merged).exp().unsqueeze(-1)).to(q.dtype)
                lse = merged
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.size, ctx.ops = chunks, size, ops
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        _, backward_op = ctx.ops
        size, rep = ctx.size, q.shape[1] // k.shape[1]
        kr, vr = (t.repeat_interleave(rep, dim=1) if rep > 1 else t for t in (k, v))
        grad = grad.contiguous()
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(kr), torch.zeros_like(vr)
        for i, g in enumerate(ctx.chunks):
            rows = slice(i * size, (i + 1) * size)
            parts = [(slice(g * size, (g + 1) * size), True)] + ([(slice(0, g * size), False)] if g > 0 else [])
            for keys, causal in parts:
                dqi, dki, dvi = backward_op(grad[:, :, rows], q[:, :, rows], kr[:, :, keys], vr[:, :, keys],
                                            out[:, :, rows], lse[:, :, rows], 0.0, causal)
                dq[:, :, rows] += dqi
                dk[:, :, keys] += dki
                dv[:, :, keys] += dvi
        if rep > 1:  # each key/value head served ``rep`` query heads
            dk, dv = (t.unflatten(1, (k.shape[1], rep)).sum(2) for t in (dk, dv))
        return dq, dk, dv, None, None, None


class _AllToAll(torch.autograd.Function):
    """All-to-all over ``group`` along the leading dimension (``[degree, ...]``: entry j goes to rank j,
    entry j of the result came from rank j); its own backward, in the other direction."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, t.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None
