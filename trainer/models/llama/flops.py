"""Parameter and FLOP counts for Llama models."""

from __future__ import annotations

from torch import nn

from .args import LlamaModelArgs


def _require_vocab(args: LlamaModelArgs) -> int:
    if args.vocab_size <= 0:
        raise ValueError(
            "vocab_size is unset (-1); set it from the tokenizer before counting parameters"
        )
    return args.vocab_size


def _feed_forward_params(args: LlamaModelArgs, *, active: bool) -> int:
    """All blocks' feed-forward parameters; with ``active``, those one token uses (of the routed experts, top_k
    of num_experts: the router and the shared experts always)."""
    dense = 3 * args.dim * args.ffn_hidden_dim  # w1, w2, w3
    moe = args.moe
    n_moe = args.n_moe_layers
    if moe is None or n_moe == 0:
        return args.n_layers * dense
    expert = 3 * args.dim * args.expert_hidden_dim
    routed = (moe.top_k if active else moe.num_experts) * expert
    per_moe = args.dim * moe.num_experts + routed + moe.num_shared_experts * expert  # router, experts, shared
    return (args.n_layers - n_moe) * dense + n_moe * per_moe


def count_params(args: LlamaModelArgs, *, exclude_embedding: bool = False, active: bool = False) -> int:
    """Number of parameters of ``Transformer(args)``, by formula (nothing is allocated).

    Tied embeddings are counted once. ``exclude_embedding=True`` drops the input embedding
    table ``tok_embeddings`` (a lookup, no matmul FLOPs) but keeps the output projection,
    which is a real ``dim x vocab`` matmul. With tied embeddings the shared matrix *is* the
    output projection, so nothing is dropped. ``active=True`` counts, of a mixture of experts, the
    parameters one token goes through (top_k routed experts per MoE layer); a dense model is all active.
    """
    vocab = _require_vocab(args)
    dim, head_dim = args.dim, args.head_dim
    q_dim = args.n_heads * head_dim
    kv_dim = args.num_kv_heads * head_dim
    attention = dim * q_dim + 2 * dim * kv_dim + q_dim * dim  # wq, wk, wv, wo
    norms = 2 * dim  # attention_norm, ffn_norm
    blocks = args.n_layers * (attention + norms) + _feed_forward_params(args, active=active)

    embedding = vocab * dim
    output = 0 if args.tie_word_embeddings else vocab * dim
    total = embedding + blocks + dim + output  # + final norm
    if exclude_embedding and not args.tie_word_embeddings:
        total -= embedding
    return total


def model_num_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    """Number of (unique) parameters of a built module; works on the meta device and with
    DTensor parameters (global sizes). ``exclude_embedding`` has the same meaning as in
    :func:`count_params`: the input embedding is dropped unless it is tied to ``output``."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embedding:
        emb = getattr(model, "tok_embeddings", None)
        out = getattr(model, "output", None)
        if emb is not None and not (out is not None and out.weight is emb.weight):
            total -= emb.weight.numel()
    return total


def flops_per_token(args: LlamaModelArgs, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token, PaLM formula (Chowdhery et al. 2022,
    appendix B): ``6 * N + 12 * L * H * Q * T``.

    ``N`` is ``count_params(args, exclude_embedding=True, active=True)``: every parameter that takes
    part in a matmul, i.e. all but the input embedding lookup, *including* the output projection
    (norm weights are included too; they are a negligible ``(2L + 1) * dim``); of a mixture of experts
    only the active ones (the router, the shared experts and top_k routed experts per token), as
    torchtitan counts MoE FLOPs. ``L`` layers,
    ``H`` query heads, ``Q`` head dim, ``T = seq_len``; the attention term counts the full
    ``T x T`` score and value matmuls (the causal mask is not discounted), as in the paper.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    n = count_params(args, exclude_embedding=True, active=True)
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
