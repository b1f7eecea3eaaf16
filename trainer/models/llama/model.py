"""Llama-style decoder-only transformer (Llama 2 / Llama 3.x shapes).

Parameter names follow Meta's reference implementation (``tok_embeddings``,
``layers.<i>.attention.wq`` ..., ``layers.<i>.feed_forward.w1`` ..., ``norm``, ``output``)
because checkpoints, tensor-parallel plans and the Hugging Face exporter rely on them.

For generation the model keeps its own key/value cache, as gpt-fast does: ``setup_kv_cache`` gives every
attention layer a :class:`KVCache` and ``forward(tokens, input_pos=...)`` then writes the new keys/values at
``input_pos``, attends over the cache and rotates by those positions. Without ``input_pos`` (training) the
cache is not touched, and it does not exist unless set up: ``Attention.kv_cache`` is None, so FSDP, TP,
pipeline splitting and ``torch.compile`` see the same modules and ops as before.

RoPE uses Meta's *interleaved pair* convention: dimensions ``(2i, 2i+1)`` of each head form
one rotated pair with frequency ``theta ** (-2i / head_dim)``. (Hugging Face's Llama uses the
"rotate half" convention instead; its converter permutes the rows of ``wq``/``wk``.) The
table is real (cos, sin pairs), so it moves, slices and shards like any buffer; the rotation views it and
each pair of ``x`` as complex numbers (one multiply), which is what Llama's reference code computes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.attention import attention, document_mask
from trainer.models.moe import MoE

from .args import LlamaModelArgs, RopeScaling
from .flavors import get_llama_args

__all__ = [
    "RMSNorm",
    "Attention",
    "FeedForward",
    "KVCache",
    "TransformerBlock",
    "Transformer",
    "apply_rope_scaling",
    "precompute_rope_cache",
    "apply_rotary_emb",
]

# Standard deviation of every hidden Linear layer at initialisation.
INIT_STD = 0.02


def _trunc_normal_(weight: torch.Tensor, std: float, cutoff: float = 3.0) -> None:
    """Normal(0, std) truncated at +-cutoff standard deviations."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)


# --------------------------------------------------------------------------------------
# Rotary position embedding
# --------------------------------------------------------------------------------------


def apply_rope_scaling(freqs: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling of the RoPE inverse frequencies ``freqs`` (rad/token)."""
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    # Band in between: interpolate between the scaled and the original frequency.
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    out = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, mid)  # low frequencies
    out = torch.where(wavelen < high_freq_wavelen, freqs, out)  # high frequencies: unchanged
    return out


def precompute_rope_cache(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Cos/sin table of shape ``[max_seq_len, head_dim // 2, 2]`` (float32).

    ``cache[p, i, 0] = cos(p * f_i)`` and ``cache[p, i, 1] = sin(p * f_i)`` with
    ``f_i = theta ** (-2i / head_dim)`` (optionally Llama 3.1-scaled).

    Precision. A Llama 3.1-scaled table (``scaling`` set: the llama3 flavors, torchtitan's included) is
    computed as torchtitan's ``precompute_freqs_cis``, Meta's reference code and ``transformers`` compute
    it: frequencies, scaling and angles in float32 (``torch.polar`` for cos/sin, as torchtitan), so the same
    weights and batches give torchtitan's losses bit for bit (``trainer bench vs-torchtitan``). An unscaled
    table keeps angles in float64, rounded once to float32: more accurate at long positions (a float32
    angle is off by up to half an ulp of ``p * f_i``, ~4e-3 rad at position 131072), and this trainer's
    own models (``debug_gqa``) and their recorded reference outputs use it.
    """
    dtype = torch.float64 if scaling is None else torch.float32
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=dtype)[: head_dim // 2]
    freqs = 1.0 / (theta ** (exponent / head_dim))
    if scaling is not None:
        freqs = apply_rope_scaling(freqs, scaling)
    positions = torch.arange(max_seq_len, device=device, dtype=dtype)
    angles = torch.outer(positions, freqs)
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles)).to(torch.float32)


def apply_rotary_emb(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` (``[batch, seq, heads, head_dim]``) by position.

    ``rope_cache`` is either the table ``[>= seq, head_dim // 2, 2]`` (positions ``0 .. seq-1``; rows
    beyond ``seq`` are ignored) or the rows already picked for each token, ``[batch, seq, head_dim // 2, 2]``
    (decoding, where each sequence of the batch may be at its own position). The rotation is done in
    float32 and the result is cast back to ``x.dtype``.

    Each pair ``(x0, x1)`` is viewed as the complex number ``x0 + i x1`` and multiplied by
    ``cos + i sin`` (the table's last dimension read as one complex number), as Llama's reference code
    does: the same products and sums as the real form ``(x0 cos - x1 sin, x0 sin + x1 cos)``, with the
    same result bit for bit, in one kernel per direction instead of a chain of pointwise ones
    (``trainer bench kernels``: 13-20x faster forward+backward in eager mode on CPU, about 1.3x compiled).
    """
    seqlen = x.shape[1]
    cache = rope_cache[:seqlen] if rope_cache.dim() == 3 else rope_cache
    # [(batch,) seq, 1, head_dim // 2] complex: broadcast over heads (and over batch for the shared table).
    rotation = torch.view_as_complex(cache.float()).unsqueeze(-2)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


# --------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square layer norm; normalisation in float32, output in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel (one kernel on GPU instead of five): float32 statistics, output in x's dtype.
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class KVCache(nn.Module):
    """One attention layer's keys and values for generation, ``[batch, max_seq_len, n_kv_heads, head_dim]``.

    Slot ``p`` of row ``b`` holds the key/value of that sequence's token at position ``p``. Buffers are
    non-persistent: a cache never enters a state dict or a checkpoint.
    """

    def __init__(self, batch_size: int, max_seq_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        shape = (batch_size, max_seq_len, n_kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` (``[batch, seq, n_kv_heads, head_dim]``) at positions ``input_pos`` (``[seq]``, or
        ``[batch, seq]`` per row) and return the whole cache; the caller masks the slots not yet valid."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        pos = input_pos.expand(k.shape[0], -1)
        self.k[rows, pos] = k
        self.v[rows, pos] = v
        return self.k, self.v


class Attention(nn.Module):
    """Causal multi-head / grouped-query self-attention with RoPE.

    The numbers of heads are derived at runtime from the projected tensors, so a module whose
    ``wq``/``wk``/``wv`` are column-sharded (and ``wo`` row-sharded) by tensor parallelism
    computes on its local heads unchanged.
    """

    def __init__(self, args: LlamaModelArgs, layer_id: int = 0):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        # Llama 4: a NoPE block neither rotates nor normalises q and k; a RoPE block may L2-normalise them.
        self.use_rope = args.uses_rope(layer_id)
        self.qk_norm_eps = args.norm_eps if args.use_qk_norm and self.use_rope else None
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Set by Transformer.setup_kv_cache for generation only; None in training.
        self.kv_cache: KVCache | None = None

    def init_weights(self, init_std: float = INIT_STD) -> None:
        """``wq``/``wk``/``wv`` get std 0.02; ``wo`` gets ``init_std`` (depth-scaled)."""
        for linear in (self.wq, self.wk, self.wv):
            _trunc_normal_(linear.weight, INIT_STD)
        _trunc_normal_(self.wo.weight, init_std)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, input_pos: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, query_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Causal self-attention over ``x`` (training: ``rope_cache`` is the whole table, or each token's rows
        when RoPE restarts per document), limited to each document by a ``DocumentMask`` (``block_causal``);
        with ``input_pos`` the keys/values also go to ``kv_cache`` and the queries attend over the cache
        under ``mask`` (``rope_cache`` then holds the rows for those positions; see ``Transformer.forward``).
        ``query_scale`` (``[seq]`` or ``[batch, seq]``, a NoPE block's): each query's temperature."""
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)

        if self.use_rope:
            q = apply_rotary_emb(q, rope_cache)
            k = apply_rotary_emb(k, rope_cache)
        if self.qk_norm_eps is not None:
            q, k = _l2_norm(q, self.qk_norm_eps), _l2_norm(k, self.qk_norm_eps)
        if query_scale is not None:
            q = (q * query_scale[..., None, None]).to(q.dtype)
        if input_pos is not None:
            k, v = self.kv_cache.update(input_pos, k, v)

        # [batch, heads, seq, head_dim]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = attention(q, k, v, mask)
        out = out.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(out)


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head vector divided by its root mean square (in float32; no weight): Llama 4's QK norm."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float = INIT_STD) -> None:
        """``w1``/``w3`` get std 0.02; the output projection ``w2`` gets ``init_std``."""
        _trunc_normal_(self.w1.weight, INIT_STD)
        _trunc_normal_(self.w3.weight, INIT_STD)
        _trunc_normal_(self.w2.weight, init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``, the ffn a SwiGLU ``feed_forward`` or a
    mixture of experts ``moe``."""

    def __init__(self, layer_id: int, args: LlamaModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        # A mixture of experts in place of the feed-forward (``moe``, torchtitan's name) in the blocks the
        # args say; ``moe_enabled`` tells which one a block has.
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            hidden = args.expert_hidden_dim
            shared = args.moe.num_shared_experts
            self.moe = MoE(args.moe, args.dim, hidden, FeedForward(args.dim, hidden * shared) if shared else None)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        # Depth-scaled std of the projections that write into the residual stream.
        self.weight_init_std = INIT_STD / math.sqrt(2 * (layer_id + 1))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.weight_init_std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, input_pos: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, query_scale: torch.Tensor | None = None) -> torch.Tensor:
        # The cache arguments go by keyword: tensor parallelism's input preparation for ``attention``
        # counts the positional inputs (x, rope_cache).
        h = x + self.attention(self.attention_norm(x), rope_cache, input_pos=input_pos, mask=mask,
                               query_scale=query_scale)
        return h + (self.moe if self.moe_enabled else self.feed_forward)(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama decoder. ``forward(tokens[B, S]) -> logits[B, S, vocab]``; for generation
    ``setup_kv_cache(...)`` then ``forward(tokens, input_pos=...)``, and ``clear_kv_cache()``.

    A pipeline stage may delete entries of ``layers`` (an ``nn.ModuleDict`` keyed ``"0"`` ..
    ``"n-1"``, so the surviving parameter names are unchanged) and set ``tok_embeddings``,
    ``norm`` or ``output`` to ``None``: without ``tok_embeddings`` the input is hidden states
    ``[B, S, dim]``; without ``output`` (and ``norm``) the hidden states are returned.

    Construction works on the meta device; materialise with
    ``model.to_empty(device=...)`` followed by ``model.init_weights()``.

    ``context_parallel`` (set by the parallelize step, trainer/parallel/context.py) makes the training
    forward take each sequence's local share of the context-parallel split instead of the whole sequence.
    """

    context_parallel = None

    def __init__(self, args: LlamaModelArgs):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError(
                "LlamaModelArgs.vocab_size is unset (-1); set it from the tokenizer before "
                "building the model (e.g. build_llama(flavor, vocab_size=tokenizer.vocab_size))"
            )
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers

        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(layer_id): TransformerBlock(layer_id, args) for layer_id in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

        # Which blocks rotate q and k (all but Llama 4's NoPE blocks), by name: a pipeline stage keeps some.
        self._rope_blocks = {str(i): args.uses_rope(i) for i in range(args.n_layers)}
        # Non-persistent: never in state_dict / checkpoints, recomputed by init_weights.
        self.register_buffer("rope_cache", self._compute_rope_cache(), persistent=False)
        self.init_weights()

    def _tie_weights(self) -> None:
        """Make ``output.weight`` the very same Parameter as ``tok_embeddings.weight``."""
        if (
            self.args.tie_word_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is not self.tok_embeddings.weight
        ):
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # Module._apply (behind .to(), .to_empty(), .half(), ...) replaces each submodule's
        # Parameter objects independently when the conversion cannot be done in place (e.g.
        # meta -> cpu), which would silently untie the embeddings; re-tie afterwards.
        # (Conversions that swap tensors in place, as with DTensor/FSDP2 params, keep the
        # tie and this is a no-op.)
        ret = super()._apply(fn, recurse)
        self._tie_weights()
        # A dtype conversion (e.g. model.to(torch.bfloat16)) would also round the RoPE
        # table; it is a recomputable buffer, so rebuild it in float32 instead.
        cache = self.rope_cache
        if cache.dtype != torch.float32 and cache.device.type != "meta":
            with torch.no_grad():
                self.rope_cache = self._compute_rope_cache(device=cache.device)
        return ret

    def _compute_rope_cache(self, device: torch.device | str | None = None) -> torch.Tensor:
        return precompute_rope_cache(
            self.args.head_dim,
            self.args.max_seq_len,
            self.args.rope_theta,
            self.args.rope_scaling,
            device=device,
        )

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re-)initialise every parameter this (possibly partial) model holds.

        Deterministic given the torch RNG state of the parameters' device. Also recomputes
        ``rope_cache`` on ``buffer_device`` (default: where the buffer already lives).

        * ``tok_embeddings``: normal(0, 1). The block input goes through RMSNorm, so the
          embedding scale does not change the first layer's input; std 1 keeps the residual
          stream O(1) against the small (0.02-scale) block updates, as in Meta's and
          torchtitan's Llama recipes.
        * hidden Linear layers: truncated normal (+-3 std), std 0.02; the residual-stream
          output projections ``wo`` and ``w2`` of block ``i`` use ``0.02 / sqrt(2 (i + 1))``.
        * ``output``: truncated normal (+-3 std), std ``dim ** -0.5``, so initial logits are
          O(1). With tied embeddings the shared matrix gets this output initialisation
          (std 1 would make the initial logits ~sqrt(dim) large).
        * norms: 1.
        """
        buffer_device = buffer_device if buffer_device is not None else self.rope_cache.device
        with torch.no_grad():
            self.rope_cache = self._compute_rope_cache(device=buffer_device)

        self._tie_weights()
        tied = self.args.tie_word_embeddings
        output_std = self.args.dim**-0.5
        if self.tok_embeddings is not None:
            if tied:
                _trunc_normal_(self.tok_embeddings.weight, output_std)
            else:
                nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        if self.norm is not None:
            self.norm.init_weights()
        if self.output is not None and not (tied and self.tok_embeddings is not None):
            _trunc_normal_(self.output.weight, output_std)

    def setup_kv_cache(self, batch_size: int, max_seq_len: int | None = None, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> None:
        """Give every attention layer a zeroed :class:`KVCache` for ``batch_size`` sequences of up to
        ``max_seq_len`` tokens (default: the RoPE table's length). ``dtype``/``device`` default to the
        parameters'. Replaces any previous cache."""
        limit = self.rope_cache.shape[0]
        max_seq_len = limit if max_seq_len is None else max_seq_len
        if not 0 < max_seq_len <= limit:
            raise ValueError(f"KV cache length {max_seq_len} must be in 1..{limit} (the RoPE table's length)")
        param = next(self.parameters())
        for layer in self.layers.values():
            layer.attention.kv_cache = KVCache(
                batch_size, max_seq_len, self.args.num_kv_heads, self.args.head_dim,
                dtype=dtype or param.dtype, device=device if device is not None else param.device,
            )

    def clear_kv_cache(self) -> None:
        """Drop the caches (and their memory); the model is as built again."""
        for layer in self.layers.values():
            layer.attention.kv_cache = None

    def _cached_inputs(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE rows and attention mask for queries at ``input_pos`` (``[seq]`` or ``[batch, seq]``): a query
        at position ``p`` sees cache slots ``0 .. p``, so the slots not yet written are never read."""
        cache = next(iter(self.layers.values())).attention.kv_cache
        if cache is None:
            raise RuntimeError("forward(..., input_pos=...) needs a KV cache: call setup_kv_cache first")
        slots = torch.arange(cache.k.shape[1], device=input_pos.device)
        mask = (slots <= input_pos[..., None]).unsqueeze(-3)  # [(batch,) 1, seq, slots]: one mask for all heads
        return self.rope_cache[input_pos], mask

    def _llama4_inputs(self, h: torch.Tensor, positions: torch.Tensor | None, input_pos: torch.Tensor | None,
                       mask, dtype: torch.dtype) -> tuple[object, torch.Tensor | None]:
        """Llama 4's attention inputs beside the usual ones: the RoPE blocks' mask when they attend within
        ``attention_chunk_size`` chunks and the sequence (or the cache) is longer than one (None otherwise:
        they take the model's mask), and the NoPE blocks' query temperatures at these positions (None when all
        are 1: every position below ``floor_scale - 1``). Under tensor parallel ``h`` holds a sequence shard:
        the configuration refuses sequences that would need either (trainer/models/config.py)."""
        args = self.args
        chunk = args.attention_chunk_size
        nope = args.no_rope_layer_interval is not None and args.attn_temperature_tuning
        if chunk is None and not nope:
            return None, None
        seqlen = h.shape[1]
        if input_pos is None and self.context_parallel is not None:
            seqlen *= self.context_parallel.degree * self.context_parallel.sequence_shards
            if (chunk is not None and seqlen > chunk) or (nope and seqlen >= args.floor_scale - 1):
                raise ValueError(f"context parallel with sequences of {seqlen} tokens needs Llama 4's chunked "
                                 "attention or temperature tuning, which are not implemented with it")
            return None, None
        where = torch.arange(seqlen, device=h.device) if input_pos is None else input_pos
        longest = seqlen if input_pos is None else int(input_pos.max()) + 1  # generation: read on the host
        query_scale = None
        if nope and longest >= args.floor_scale:
            query_scale = torch.log1p(torch.floor((where.float() + 1.0) / args.floor_scale)) * args.attn_scale + 1.0
        rope_mask = None
        if chunk is not None and input_pos is not None:  # the cache slots of each query's own chunk
            slots = torch.arange(mask.shape[-1], device=h.device)
            rope_mask = mask & (slots // chunk == input_pos[..., None] // chunk).unsqueeze(-3)
        elif chunk is not None and seqlen > chunk:  # chunks as documents: a segment starts at either boundary
            within = (where % chunk).expand(h.shape[0], -1)
            if positions is not None and args.attn_mask_type == "block_causal":
                within = torch.minimum(within, positions)
            rope_mask = document_mask(within, rope_restart=False, dtype=dtype)
        return rope_mask, query_scale

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, S, vocab]`` for ``tokens`` ``[B, S]`` at positions ``0 .. S-1`` (training).

        ``positions`` (``[B, S]``, the loader's document positions: 0 at each document start) limit
        attention to each document when the model's ``attn_mask_type`` is ``block_causal`` (and restart
        RoPE there with ``rope_per_document``); a ``causal`` model ignores them, and without them a
        ``block_causal`` model sees one document per sequence (evaluation, generation).

        With ``input_pos`` (``[S]``, or ``[B, S]`` when each sequence is at its own position) the tokens sit
        at those positions of the KV cache set up by ``setup_kv_cache``: their keys/values are stored there
        and they attend to every cached position up to their own (generation, one token at a time after
        the prompt).
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        cp = self.context_parallel
        # The dtype attention runs in (its masks are built in it once per forward).
        device_type = h.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else h.dtype
        if input_pos is None and cp is not None:
            # Context parallel: h holds this rank's tokens of each sequence (trainer/parallel/context.py).
            block_causal = self.args.attn_mask_type == "block_causal"
            rope, mask = cp.model_inputs(self.rope_cache, h.shape[1] * cp.sequence_shards, positions,
                                         block_causal=block_causal,
                                         rope_restart=block_causal and self.args.rope_per_document, dtype=dtype)
        elif input_pos is None:
            seqlen = h.shape[1]
            if seqlen > self.rope_cache.shape[0]:
                raise ValueError(
                    f"sequence length {seqlen} exceeds max_seq_len {self.rope_cache.shape[0]}"
                )
            rope, mask = self.rope_cache, None
            if positions is not None and self.args.attn_mask_type == "block_causal":
                mask = document_mask(positions, rope_restart=self.args.rope_per_document, dtype=dtype)
                if mask.rope_positions is not None:
                    rope = self.rope_cache[mask.rope_positions]  # [B, S, head_dim // 2, 2]: each token's rows
        else:
            rope, mask = self._cached_inputs(input_pos)
        rope_mask, query_scale = self._llama4_inputs(h, positions, input_pos, mask, dtype)
        for name, layer in self.layers.items():
            if self._rope_blocks[name]:
                h = layer(h, rope, input_pos=input_pos, mask=mask if rope_mask is None else rope_mask)
            else:
                h = layer(h, rope, input_pos=input_pos, mask=mask, query_scale=query_scale)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def build_llama(
    flavor_or_args: str | LlamaModelArgs,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
) -> Transformer:
    """Build a ``Transformer`` on the current default device (use ``torch.device("meta")`` as
    a context manager for a deferred build). ``vocab_size``/``max_seq_len`` override the
    flavor's values; ``vocab_size`` is required when the flavor leaves it at -1."""
    return Transformer(get_llama_args(flavor_or_args, vocab_size, max_seq_len))
