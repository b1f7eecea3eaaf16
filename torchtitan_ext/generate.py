"""``trainer generate``: sample text from a checkpoint, with a KV cache.

The KV cache lives here, not in the training model: :func:`forward_cached` runs the model's own modules
(``tok_embeddings``, each block's norms, ``wq``/``wk``/``wv``/``wo`` and ``feed_forward``, ``norm``,
``output``) in the same order as ``Transformer.forward`` but keeps every layer's keys and values, so a
new token costs one position instead of the whole sequence. It also takes per-row positions and a key
mask, which lets prompts of different lengths be left-padded into one batch. ``--no_kv_cache``
recomputes the whole sequence at every step (the slow reference path; same results).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger("trainer")

__all__ = ["KVCache", "forward_cached", "generate", "sample_next", "main"]


@dataclass
class KVCache:
    """Per-layer key/value tensors ``[batch, max_len, n_kv_heads, head_dim]``."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def empty(cls, model, batch: int, max_len: int, dtype: torch.dtype, device) -> "KVCache":
        args = model.args
        shape = (batch, max_len, args.num_kv_heads, args.head_dim)
        n = len(model.layers)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE as in ``apply_rotary_emb``, with per-row positions (cos/sin ``[B, S, 1, D/2]``)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


@torch.no_grad()
def forward_cached(model, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, start: int,
                   key_mask: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, S, vocab]`` for ``tokens`` ``[B, S]`` written at cache slots ``start .. start+S-1``.

    ``positions`` ``[B, S]`` are the RoPE positions; ``key_mask`` ``[B, >= start+S]`` marks the slots
    that hold real tokens (False for left padding). A query attends to real keys at or before its slot
    (and always to itself, so padding rows stay finite).
    """
    bsz, seqlen = tokens.shape
    end = start + seqlen
    rope = model.rope_cache[positions]  # [B, S, D/2, 2]
    cos, sin = rope[..., 0].unsqueeze(2), rope[..., 1].unsqueeze(2)
    q_slots = torch.arange(start, end, device=tokens.device)
    k_slots = torch.arange(end, device=tokens.device)
    allowed = (k_slots[None, :] <= q_slots[:, None])[None] & key_mask[:, None, :end]
    allowed |= (k_slots[None, :] == q_slots[:, None])[None]
    mask = allowed[:, None]  # [B, 1, S, end]

    h = model.tok_embeddings(tokens)
    for i, layer in enumerate(model.layers.values()):
        attn = layer.attention
        x = layer.attention_norm(h)
        q = attn.wq(x).view(bsz, seqlen, -1, attn.head_dim)
        k = attn.wk(x).view(bsz, seqlen, -1, attn.head_dim)
        v = attn.wv(x).view(bsz, seqlen, -1, attn.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        cache.k[i][:, start:end] = k
        cache.v[i][:, start:end] = v
        keys, values = cache.k[i][:, :end], cache.v[i][:, :end]
        n_rep = q.shape[2] // keys.shape[2]
        if n_rep > 1:
            keys = torch.repeat_interleave(keys, n_rep, dim=2)
            values = torch.repeat_interleave(values, n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask)
        h = h + attn.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h))


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ``[B]`` from last-position logits ``[B, vocab]``: greedy at temperature 0, else sampled
    from the temperature-scaled distribution restricted to the top-k tokens and the top-p nucleus."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first token is always kept).
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, eos_id: int | None = None, pad_id: int = 0,
             use_kv_cache: bool = True, generator: torch.Generator | None = None,
             stop_fn=None) -> list[list[int]]:
    """New tokens for each prompt (token ids), stopping at ``eos_id`` (not included) or after
    ``max_new_tokens``. Prompts are left-padded into one batch; a prompt longer than the model's RoPE
    table allows is cut from the left. ``stop_fn(row, new_ids) -> bool`` may stop a row early."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. BOS)")
    device = model.tok_embeddings.weight.device
    limit = model.rope_cache.shape[0]
    max_new_tokens = max(0, min(max_new_tokens, limit - 1))
    prompts = [list(p)[-(limit - max_new_tokens):] for p in prompts]
    bsz = len(prompts)
    plen = max(len(p) for p in prompts)
    total = plen + max_new_tokens
    pads = torch.tensor([plen - len(p) for p in prompts], device=device)
    tokens = torch.full((bsz, total), pad_id, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        tokens[row, plen - len(p):plen] = torch.tensor(p, dtype=torch.long, device=device)
    slots = torch.arange(total, device=device)
    key_mask = slots[None, :] >= pads[:, None]  # [B, total]
    positions = (slots[None, :] - pads[:, None]).clamp(min=0)  # RoPE position 0 at each prompt's start

    dtype = model.tok_embeddings.weight.dtype
    done = torch.zeros(bsz, dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in range(bsz)]
    cache = KVCache.empty(model, bsz, total, dtype, device) if use_kv_cache else None
    cur = plen
    for step in range(max_new_tokens):
        if use_kv_cache:
            start = 0 if step == 0 else cur - 1
            logits = forward_cached(model, tokens[:, start:cur], positions[:, start:cur], cache, start, key_mask)
        else:  # recompute everything: a fresh cache and the whole sequence every step
            fresh = KVCache.empty(model, bsz, cur, dtype, device)
            logits = forward_cached(model, tokens[:, :cur], positions[:, :cur], fresh, 0, key_mask)
        nxt = sample_next(logits[:, -1], temperature, top_k, top_p, generator)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        tokens[:, cur] = nxt
        cur += 1
        for row in range(bsz):
            if done[row]:
                continue
            token = int(nxt[row])
            if eos_id is not None and token == eos_id:
                done[row] = True
                continue
            out[row].append(token)
            if stop_fn is not None and stop_fn(row, out[row]):
                done[row] = True
        if bool(done.all()):
            break
    return out


def main(argv: list[str] | None = None) -> int:
    from trainer import logs
    from torchtitan_ext.native import CheckpointNotFound, add_model_source_args, load_model_from_args

    parser = argparse.ArgumentParser(prog="trainer generate",
                                     description="Sample text from a native checkpoint or an exported HF folder.")
    add_model_source_args(parser)
    parser.add_argument("--prompt", action="append", default=None,
                        help="prompt text (repeat for several prompts, generated as one batch)")
    parser.add_argument("--prompt_file", default=None, help="file with one prompt per line")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling threshold (1.0: off)")
    parser.add_argument("--num_samples", type=int, default=1, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_bos", action="store_true", help="do not prepend BOS to the prompt")
    parser.add_argument("--no_kv_cache", action="store_true", help="recompute the whole sequence every token")
    parser.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output_json", default=None, help="also write prompts and samples to this JSON file")
    args = parser.parse_args(argv)
    logs.setup()

    prompts = list(args.prompt or [])
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        prompts = [""]  # unconditional: start from BOS
    if not 0 < args.top_p <= 1.0:
        parser.error("--top_p must be in (0, 1]")
    try:
        loaded = load_model_from_args(args, dtype=args.dtype, device=args.device)
    except (CheckpointNotFound, FileNotFoundError, ValueError, KeyError) as e:
        print(f"trainer generate: {e}", file=sys.stderr)
        return 2
    tok = loaded.tokenizer
    bos = not args.no_bos and tok.bos_id is not None
    batch_text = [p for p in prompts for _ in range(args.num_samples)]
    batch_ids = [tok.encode(p, bos=bos) for p in batch_text]
    if any(len(ids) == 0 for ids in batch_ids):
        print("trainer generate: an empty prompt needs a BOS token; drop --no_bos", file=sys.stderr)
        return 2
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    t0 = time.perf_counter()
    new = generate(loaded.model, batch_ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, eos_id=tok.eos_id, pad_id=tok.pad_id or 0,
                   use_kv_cache=not args.no_kv_cache, generator=gen)
    elapsed = time.perf_counter() - t0
    n_tokens = sum(len(x) for x in new)
    logger.info("generated %d tokens in %.2f s (%.1f tokens/s, %s)", n_tokens, elapsed,
                n_tokens / max(elapsed, 1e-9), "KV cache" if not args.no_kv_cache else "no KV cache")
    records = []
    for i, (prompt, ids) in enumerate(zip(batch_text, new)):
        text = tok.decode(ids)
        records.append({"prompt": prompt, "completion": text, "tokens": ids})
        print(f"=== sample {i + 1} ===")
        print(prompt + text)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"samples": records, "temperature": args.temperature, "top_k": args.top_k,
                       "top_p": args.top_p, "seed": args.seed}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
