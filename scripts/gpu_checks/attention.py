"""block_causal attention on one CUDA GPU at an 8B layer's attention shapes (32 query heads, 8 key/value
heads, head size 128, bf16, sequence 8192): forward+backward time and peak memory of each kernel against causal
SDPA, with a few documents per sequence. Run by scripts/gpu_checks/attention.sh; prints a table and writes
it as JSON to the path given as the first argument.

Kernels: the trainer's own two (trainer/models/attention.py: compiled FlexAttention with a block mask, which
the trainer uses on CUDA, and SDPA with a dense boolean mask, its CPU kernel) and, for comparison only, torch's
varlen attention (torch.nn.attention.varlen, where this torch has it). The outputs are compared with the SDPA
mask's.
"""

from __future__ import annotations

import inspect
import json
import sys
import time

import torch

from trainer.models.attention import attention, document_mask

B, HEADS, KV_HEADS, HEAD_DIM, SEQ = 1, 32, 8, 128, 8192
WARMUP, ITERS = 3, 10


def document_positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None].cuda()


def lengths_for(docs: int, seed: int) -> list[int]:
    """``docs`` document lengths summing to SEQ (random cut points, fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(SEQ - 1, generator=g)[:docs - 1].add(1).tolist())
    edges = [0, *cuts, SEQ]
    return [b - a for a, b in zip(edges, edges[1:])]


def timed(fn, q, k, v) -> tuple[float, float, torch.Tensor]:
    """Median milliseconds of forward+backward, peak memory above the inputs (GiB), and the output."""
    out = None
    for _ in range(WARMUP):
        out = fn(q, k, v)
        out.sum().backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(q, k, v)
        out.sum().backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return sorted(times)[len(times) // 2], peak, out.detach()


def varlen_kernel(lengths: list[int]):
    """torch's varlen attention over the documents as one packed batch, or None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    longest = max(lengths)
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}

    def run(q, k, v):
        if not gqa:  # repeat the key/value heads where the kernel has no grouped-query support
            k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        flat = [t.transpose(1, 2).reshape(B * SEQ, t.shape[1], HEAD_DIM) for t in (q, k, v)]
        out = varlen_attn(*flat, cu, cu, longest, longest, **causal, **gqa)
        return out.reshape(B, SEQ, HEADS, HEAD_DIM).transpose(1, 2)

    return run


def main() -> int:
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; B={B} heads={HEADS}/{KV_HEADS} "
          f"head_dim={HEAD_DIM} seq={SEQ} bf16, forward+backward, median of {ITERS}")
    q = torch.randn(B, HEADS, SEQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, KV_HEADS, SEQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, KV_HEADS, SEQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    rows = []
    ms, gib, _ = timed(lambda q, k, v: attention(q, k, v), q, k, v)
    rows.append({"docs": 1, "kernel": "causal sdpa", "ms": ms, "peak_gib": gib, "mask_ms": 0.0, "max_diff": 0.0})
    for docs in (4, 16):
        lengths = lengths_for(docs, seed=docs)
        positions = document_positions(lengths)
        masks = {}
        for kernel in ("sdpa", "flex"):
            t0 = time.perf_counter()
            document_mask(positions, rope_restart=False, kernel=kernel)  # the first builds compile
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            masks[kernel] = document_mask(positions, rope_restart=False, kernel=kernel)
            torch.cuda.synchronize()
            mask_ms = (time.perf_counter() - t1) * 1e3
            print(f"  {docs} docs: {kernel} mask built in {mask_ms:.2f} ms (first build {1e3 * (t1 - t0):.0f} ms)")
            masks[kernel] = (masks[kernel], mask_ms)
        kernels = {f"block_causal {name}": (lambda q, k, v, m=m: attention(q, k, v, m), mask_ms)
                   for name, (m, mask_ms) in masks.items()}
        varlen = varlen_kernel(lengths)
        if varlen is not None:
            kernels["block_causal varlen (torch)"] = (varlen, 0.0)
        reference = None
        for name, (fn, mask_ms) in kernels.items():
            try:
                ms, gib, out = timed(fn, q, k, v)
            except Exception as e:  # a kernel this torch or GPU cannot run: say which, go on
                print(f"  {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            reference = out if reference is None else reference
            diff = float((out.float() - reference.float()).abs().max())
            rows.append({"docs": docs, "kernel": name, "ms": ms, "peak_gib": gib, "mask_ms": mask_ms,
                         "max_diff": diff})
            print(f"  {docs} docs: {name}: {ms:.2f} ms, peak {gib:.2f} GiB, max |diff| {diff:.4f}")
    causal = rows[0]["ms"]
    print(f"{'docs':>4}  {'kernel':<28} {'fwd+bwd ms':>10} {'vs causal':>9} {'peak GiB':>8} {'mask ms':>8} "
          f"{'max |diff|':>10}")
    for r in rows:
        print(f"{r['docs']:>4}  {r['kernel']:<28} {r['ms']:>10.2f} {r['ms'] / causal:>8.2f}x {r['peak_gib']:>8.2f} "
              f"{r['mask_ms']:>8.2f} {r['max_diff']:>10.4f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
