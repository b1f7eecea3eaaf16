"""``trainer bench kernels``: two forms of the rotary embedding, forward+backward.

Both rotate interleaved pairs ``(2i, 2i+1)`` by the same cos/sin table: the *real* form with a chain of
pointwise ops (``x0 cos - x1 sin``, ``x0 sin + x1 cos``, stacked), the *complex* form as Llama's reference
code does, viewing each pair as one complex number and multiplying it by ``cos + i sin``
(``torch.view_as_complex``); the model uses the complex form
(:func:`trainer.models.llama.model.apply_rotary_emb`). This suite measures both, eager and under
``torch.compile``, at the debug model's attention shape and at an 8B-layer shape, and how far apart their
outputs and gradients are.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from trainer.models.llama.model import apply_rotary_emb, precompute_rope_cache

# name -> (batch, seq, heads, head_dim, rope_theta)
SHAPES = {
    "debug_gqa": (8, 256, 16, 16, 500000.0),
    "llama3_8b_layer": (1, 2048, 32, 128, 500000.0),
}


def apply_rotary_emb_real(x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """The real-valued form: each pair rotated with cos/sin in a chain of pointwise ops."""
    cache = rope_cache[: x.shape[1]]
    cos = cache[..., 0].unsqueeze(-2)
    sin = cache[..., 1].unsqueeze(-2)
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def _fwd_bwd(fn, x: torch.Tensor, table: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    out = fn(x, table)
    out.backward(grad)
    return out.detach(), x.grad


def _time(fn, x, table, grad, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        _fwd_bwd(fn, x, table, grad)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _fwd_bwd(fn, x, table, grad)
        times.append(time.perf_counter() - t0)
    return times


def rope_case(shape: str, compile_: bool, repeats: int, rounds: int) -> dict[str, Any]:
    """Real vs complex RoPE at one shape, eager or compiled; rounds alternate the two (medians of rounds)."""
    b, s, h, d, theta = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, h, d, generator=gen)
    grad = torch.randn(b, s, h, d, generator=gen)
    cache = precompute_rope_cache(d, s, theta)
    real_fn, complex_fn = apply_rotary_emb_real, apply_rotary_emb  # the model's: the complex form
    if compile_:
        torch.compiler.reset()
        real_fn, complex_fn = torch.compile(real_fn), torch.compile(complex_fn)
    out_r, g_r = _fwd_bwd(real_fn, x, cache, grad)
    out_c, g_c = _fwd_bwd(complex_fn, x, cache, grad)
    real_t, complex_t = [], []
    for i in range(rounds):
        pair = [(real_t, real_fn), (complex_t, complex_fn)]
        for times, fn in pair if i % 2 == 0 else pair[::-1]:
            times.append(statistics.median(_time(fn, x, cache, grad, repeats, warmup=1)))
    real_s, complex_s = statistics.median(real_t), statistics.median(complex_t)
    return {
        "shape": shape, "batch": b, "seq_len": s, "heads": h, "head_dim": d, "compile": compile_,
        "real_ms": 1e3 * real_s, "complex_ms": 1e3 * complex_s, "complex_over_real": complex_s / real_s,
        "max_abs_diff_out": (out_r - out_c).abs().max().item(), "max_abs_diff_grad": (g_r - g_c).abs().max().item(),
        "bitwise_equal": bool(torch.equal(out_r, out_c) and torch.equal(g_r, g_c)),
    }


def model_case(repeats: int, rounds: int, batch: int = 8, seq: int = 256) -> dict[str, Any]:
    """The whole debug model, forward + backward of the loss, with each RoPE form (eager, float32)."""
    import torch.nn.functional as F

    from trainer.models.config import get_model_args
    from trainer.models.llama.model import Transformer
    from trainer.models.llama import model as llama

    args = get_model_args("llama", "debug_gqa")
    if args.vocab_size <= 0:
        args.vocab_size = 2048  # the bundled tokenizer's
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)

    complex_form = llama.apply_rotary_emb
    forms = {"real": apply_rotary_emb_real, "complex": complex_form}
    times: dict[str, list[float]] = {k: [] for k in forms}
    cpu: dict[str, list[float]] = {k: [] for k in forms}
    try:
        for i in range(rounds):
            for name in (list(forms) if i % 2 == 0 else list(forms)[::-1]):
                llama.apply_rotary_emb = forms[name]
                step()  # warm-up
                t, c = [], []
                for _ in range(repeats):
                    t0, c0 = time.perf_counter(), time.process_time()
                    step()
                    t.append(time.perf_counter() - t0)
                    c.append(time.process_time() - c0)
                times[name].append(statistics.median(t))
                cpu[name].append(statistics.median(c))
    finally:
        llama.apply_rotary_emb = complex_form
    med = statistics.median
    # Process CPU time: what each form costs, whatever else runs on a shared machine (wall clock beside it).
    real_s, complex_s = med(cpu["real"]), med(cpu["complex"])
    return {"batch": batch, "seq_len": seq, "real_ms": 1e3 * real_s, "complex_ms": 1e3 * complex_s,
            "complex_over_real": complex_s / real_s, "real_wall_ms": 1e3 * med(times["real"]),
            "complex_wall_ms": 1e3 * med(times["complex"]),
            "complex_over_real_wall": med(times["complex"]) / med(times["real"])}


def bench_kernels(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    small = args.steps == "small"
    shapes = ["debug_gqa"] if small else list(SHAPES)
    modes = [False] if small else [False, True]
    repeats, rounds = (2, 1) if small else (5, 5)
    cases = []
    for shape in shapes:
        for compile_ in modes:
            case = rope_case(shape, compile_, repeats, rounds)
            cases.append(case)
            print(_row(case), flush=True)
    model = model_case(1, 1, batch=2, seq=32) if small else model_case(3, 4)
    print(f"  debug model forward+backward, CPU time: real RoPE {model['real_ms']:.1f} ms, complex "
          f"{model['complex_ms']:.1f} ms (complex/real {model['complex_over_real']:.3f}; wall clock "
          f"{model['complex_over_real_wall']:.3f})", flush=True)
    return {"rope": cases, "model": model, "threads": torch.get_num_threads()}


def _row(c: dict) -> str:
    mode = "compile" if c["compile"] else "eager"
    return (f"  rope {c['shape']:<16} {mode:<8} real {c['real_ms']:8.3f} ms  complex {c['complex_ms']:8.3f} ms  "
            f"complex/real {c['complex_over_real']:.3f}  max diff out {c['max_abs_diff_out']:.2e} "
            f"grad {c['max_abs_diff_grad']:.2e}")
