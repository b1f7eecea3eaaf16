"""The one attention function of the models, and the masks of packed documents (``attn_mask_type``).

``causal`` (the default) is SDPA with ``is_causal``: every token sees every earlier token of its sequence,
across the documents the loader packed into it. ``block_causal`` limits a token to the earlier tokens of its
own document. The boundaries come from the loader's per-token document positions (``batch["positions"]``:
0 where a document starts, counting on inside it; a document carried over from the previous sequence goes
on counting), so a new segment starts wherever a position does not follow its predecessor's, and at the
first token of every sequence.

Kernels, picked once per device type by :func:`document_kernel`:

* ``sdpa``: SDPA with a boolean ``[batch, 1, seq, seq]`` mask. On CPU (FlexAttention has no CPU backward);
  the same SDPA call as ``causal``, with a mask instead of ``is_causal``.
* ``flex``: FlexAttention with a block mask (compiled), on CUDA: only the blocks a document reaches are
  computed, so the work falls with the documents' lengths (``scripts/gpu_checks/attention.sh`` measures it
  against causal SDPA).

With ``rope_restart`` the RoPE positions also restart at every segment, so a packed document is rotated
as it would be alone (torchtitan's default does not: positions run ``0 .. seq-1`` along the sequence).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# On GPUs, the fastest fused attention first (as torchtitan orders them); math only as the last resort.
_GPU_SDPA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]


def sdpa_backends(q: torch.Tensor):
    """The SDPA backend preference for ``q``'s device: cuDNN, flash, memory-efficient, math on CUDA; the
    default elsewhere (on CPU torch picks its flash kernel itself)."""
    if q.is_cuda:
        return sdpa_kernel(_GPU_SDPA_ORDER, set_priority=True)
    return contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def document_kernel(device_type: str) -> str:
    """The kernel of ``block_causal`` attention on ``device_type``: "flex" on CUDA, "sdpa" elsewhere."""
    return "flex" if device_type == "cuda" else "sdpa"


@functools.lru_cache(maxsize=None)
def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if compiled:
        # Eager FlexAttention is an unfused reference (it materialises the scores); compiled, it is one
        # kernel that skips the blocks the mask leaves out. Compiled once per process, as torchtitan does.
        return torch.compile(flex_attention), torch.compile(create_block_mask)
    return flex_attention, create_block_mask


@dataclass
class DocumentMask:
    """What attention needs for one batch of packed documents: the mask in the kernel's form and, with RoPE
    restarting, each token's position inside its segment (``[batch, seq]``)."""

    kernel: str
    mask: object  # an additive float tensor [batch, 1, seq, seq] (sdpa) or a BlockMask (flex)
    rope_positions: torch.Tensor | None = None


def segment_starts(positions: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` bool: where a document's part in the sequence starts (the first token, and each token
    whose document position does not continue its predecessor's)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts


def segment_positions(starts: torch.Tensor) -> torch.Tensor:
    """Each token's offset from the start of its segment (``starts`` from :func:`segment_starts`)."""
    index = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return index - first


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's float form of the boolean mask ``allowed``: 0 where a query may attend, -inf elsewhere, in the
    attention's dtype. Every block of a forward shares one mask; given a boolean one, SDPA converts it to this
    form in each call and saves each copy for backward (a float copy of the whole mask per block), given this
    form it saves the tensor itself."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def document_mask(positions: torch.Tensor, *, rope_restart: bool, kernel: str | None = None,
                  dtype: torch.dtype = torch.float32) -> DocumentMask:
    """The ``block_causal`` mask of a batch from its document ``positions`` (``[batch, seq]``); ``kernel``
    defaults to :func:`document_kernel` of the positions' device. ``dtype``: the attention's (SDPA's mask is
    :func:`additive_mask`)."""
    kernel = kernel or document_kernel(positions.device.type)
    starts = segment_starts(positions)
    segments = torch.cumsum(starts, dim=1, dtype=torch.int32)
    rope = segment_positions(starts) if rope_restart else None
    batch, seq = positions.shape
    if kernel == "flex":
        flex, create_block_mask = _flex(positions.is_cuda)

        def same_document(b, h, q, kv):
            return (q >= kv) & (segments[b, q] == segments[b, kv])

        mask = create_block_mask(same_document, batch, None, seq, seq, device=positions.device)
        return DocumentMask(kernel, mask, rope)
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    mask = (segments[:, :, None] == segments[:, None, :]) & causal
    return DocumentMask(kernel, additive_mask(mask.unsqueeze(1), dtype), rope)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """Attention of ``q`` over ``k``/``v`` (``[batch, heads, seq, head_dim]``; fewer key/value heads: grouped
    query attention). ``mask``: None (causal), a tensor for SDPA (bool, True: may attend; or additive), a
    :class:`DocumentMask`, or an object with ``attend(q, k, v)`` that runs the attention itself (context
    parallel: trainer/parallel/context.py)."""
    if hasattr(mask, "attend"):
        return mask.attend(q, k, v)
    if isinstance(mask, DocumentMask):
        if mask.kernel == "flex":
            flex, _ = _flex(q.is_cuda)
            return flex(q, k, v, block_mask=mask.mask, enable_gqa=q.shape[1] != k.shape[1])
        mask = mask.mask
    # With fewer key/value heads, query head h attends with kv head h // (heads / kv heads) (Meta's repeat_kv
    # ordering), which SDPA's enable_gqa does without materialising (and saving for backward) repeated copies.
    with sdpa_backends(q):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=q.shape[1] != k.shape[1])
