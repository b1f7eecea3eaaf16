"""``trainer generate``: sample text from a checkpoint, with the model's KV cache.

Generation runs the model's own forward: the prompt batch once, then one token per step with
``model(tokens, input_pos=...)`` against the cache ``model.setup_kv_cache`` gave it (see
``trainer.models.llama.model``), so a new token costs one position instead of the whole sequence. Prompts of
different lengths share one batch right-padded: each row's token at position ``p`` sits in column (and cache
slot) ``p``, so every row keeps its own positions and a query never sees a padding slot before a real token
has overwritten it. ``--no_kv_cache`` runs the plain training forward over the whole sequence at every step
(the slow reference path; same results).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Sequence

import torch

logger = logging.getLogger("trainer")

__all__ = ["generate", "sample_next", "main"]


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
    ``max_new_tokens``. Prompts are generated as one batch; a prompt longer than the model's RoPE table
    allows is cut from the left. ``stop_fn(row, new_ids) -> bool`` may stop a row early."""
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
    tokens = torch.full((bsz, plen + max_new_tokens), pad_id, dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        tokens[row, :len(p)] = torch.tensor(p, dtype=torch.long, device=device)
    rows = torch.arange(bsz, device=device)
    cur = torch.tensor([len(p) for p in prompts], device=device)  # each row's next position

    done = torch.zeros(bsz, dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in range(bsz)]
    if use_kv_cache:
        model.setup_kv_cache(bsz, tokens.shape[1])
    try:
        for step in range(max_new_tokens):
            if not use_kv_cache:  # the training forward over everything so far
                logits = model(tokens[:, :int(cur.max())])[rows, cur - 1]
            elif step == 0:  # the prompts, at positions 0 .. plen-1
                logits = model(tokens[:, :plen], input_pos=torch.arange(plen, device=device))[rows, cur - 1]
            else:  # each row's last token, at its own position
                last = (cur - 1)[:, None]
                logits = model(tokens[rows[:, None], last], input_pos=last)[:, -1]
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            tokens[rows, cur] = nxt
            cur += 1
            record_new_tokens(nxt, done, out, eos_id, stop_fn)
            if bool(done.all()):
                break
    finally:
        if use_kv_cache:
            model.clear_kv_cache()  # the cache is the size of this batch; free it
    return out


def record_new_tokens(nxt: torch.Tensor, done: torch.Tensor, out: list[list[int]], eos_id: int | None,
                      stop_fn) -> None:
    """Append each unfinished row's new token to ``out``; mark rows that hit EOS or ``stop_fn`` done."""
    for row in range(len(out)):
        if done[row]:
            continue
        token = int(nxt[row])
        if eos_id is not None and token == eos_id:
            done[row] = True
            continue
        out[row].append(token)
        if stop_fn is not None and stop_fn(row, out[row]):
            done[row] = True


def main(argv: list[str] | None = None) -> int:
    from trainer import logs
    from torchtitan_ext.native import CheckpointNotFound, add_model_source_args, load_model_from_args
    from trainer.errors import CheckpointError

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
    for name, least in (("temperature", 0), ("top_k", 0), ("max_new_tokens", 0), ("num_samples", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name} must be >= {least}, got {getattr(args, name)}")
    try:
        loaded = load_model_from_args(args, dtype=args.dtype, device=args.device)
    except CheckpointError as e:  # a damaged checkpoint: nothing was generated
        print(f"trainer generate: {e}", file=sys.stderr)
        return e.exit_code
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
