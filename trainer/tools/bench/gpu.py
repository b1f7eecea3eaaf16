"""``trainer bench gpu`` (CUDA only): tokens/s, MFU and peak memory per flavor and variant, one process per case."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from .common import ROOT, _free_port, _quiet, _sync, build_trainer, close_trainer, load_bench_config, observed, \
    trainer_steps


GPU_FLAVORS = ("debug_gqa", "llama3_1b", "llama3_3b", "llama3_8b_4l")
GPU_VARIANTS: dict[str, list[str]] = {
    "eager": [],
    "compile": ["--compile.enable", "true"],
    "float8_tensorwise": ["--model.converters", "quantize.linear.float8",
                          "--quantize.linear.float8.recipe_name", "tensorwise"],
    "compile_float8_tensorwise": ["--compile.enable", "true", "--model.converters", "quantize.linear.float8",
                                  "--quantize.linear.float8.recipe_name", "tensorwise"],
    "compile_float8_rowwise": ["--compile.enable", "true", "--model.converters", "quantize.linear.float8",
                               "--quantize.linear.float8.recipe_name", "rowwise"],
    "compile_ac_selective_op": ["--compile.enable", "true", "--activation_checkpoint.mode", "selective",
                                "--activation_checkpoint.selective_ac_option", "op"],
    "compile_ac_full": ["--compile.enable", "true", "--activation_checkpoint.mode", "full"],
}
_VARIANT_AC = {"compile_ac_selective_op": "selective_op", "compile_ac_full": "full"}

# Named sets of cases (``--matrix NAME``): flavors x variants x sequence lengths.
MATRICES: dict[str, dict[str, tuple]] = {
    # The hot path of one GPU: 1B and 8B-shaped layers (4 of them) at long sequences, bf16 and float8,
    # eager and compiled.
    "hot_path": {"flavors": ("llama3_1b", "llama3_8b_4l"), "seq_lens": (4096, 8192),
                 "variants": ("eager", "compile", "float8_tensorwise", "compile_float8_tensorwise")},
}


def plan_local_batch(config, capacity_bytes: float, ac: str, max_batch: int) -> tuple[int, float]:
    """The largest power-of-two local batch whose single-GPU estimate fits 90% of the GPU, and its estimate."""
    from trainer.tools.plan.cli import model_args_for_plan
    from trainer.tools.plan.memory import Layout, Shape, memory_estimate

    args, _ = model_args_for_plan(config)
    shape = Shape.from_args(args)
    lb = max_batch
    while True:
        est = memory_estimate(shape, Layout(1, 1, 1, 1, lb, config.training.seq_len, ac))["total"]
        if est <= 0.9 * capacity_bytes or lb == 1:
            return lb, est
        lb //= 2


def gpu_case(spec: dict) -> dict:
    """One GPU case in this process: build the trainer, warm up (compile), time steps."""
    from trainer.metrics import peak_tflops

    workdir = tempfile.mkdtemp(prefix="bench_gpu_")
    argv = ["--model.flavor", spec["flavor"], "--training.seq_len", str(spec["seq_len"]),
            "--training.local_batch_size", str(spec["local_batch_size"]), "--training.mixed_precision_param",
            "bfloat16", "--metrics.log_freq", "1000000", "--lr_scheduler.warmup_steps", "2",
            "--data.num_workers", "2", *GPU_VARIANTS[spec["variant"]], *spec.get("overrides", [])]
    ns = argparse.Namespace(config=spec["config"])
    config = load_bench_config(ns, argv, [], workdir)
    config.training.steps = 1_000_000
    trainer = build_trainer(config)
    device = trainer.device
    cuda = device.type == "cuda"  # (on CPU the case still runs, for testing; memory figures are null)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with _quiet(), observed(trainer) as obs:
        t0 = time.perf_counter()
        trainer_steps(trainer, 1, spec["warmup"], obs)
        _sync(device)
        warmup_s = time.perf_counter() - t0
        times = []
        step = spec["warmup"] + 1
        for _ in range(spec["rounds"]):
            _sync(device)
            t0 = time.perf_counter()
            trainer_steps(trainer, step, spec["block"], obs)
            _sync(device)
            times.append((time.perf_counter() - t0) / spec["block"])
            step += spec["block"]
    tokens = trainer.accum_steps * spec["local_batch_size"] * spec["seq_len"]
    step_time = statistics.median(times)
    tps = tokens / step_time
    peak = peak_tflops(device, config.metrics.peak_tflops)
    tflops = tps * trainer.flops_per_token / 1e12
    result = {
        "flavor": spec["flavor"], "variant": spec["variant"], "ac": _VARIANT_AC.get(spec["variant"], "none"),
        "seq_len": spec["seq_len"], "local_batch_size": spec["local_batch_size"], "params": trainer.num_params,
        "flops_per_token": trainer.flops_per_token, "step_time_s": step_time, "tokens_per_s": tps,
        "tflops": tflops, "mfu_pct": None if peak is None else 100 * tflops / peak,
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
        "warmup_s": warmup_s, "device": torch.cuda.get_device_name(device) if cuda else str(device),
    }
    close_trainer(trainer)
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)
    return result


def gpu_cases(args) -> list[tuple[str, str, int]]:
    """(flavor, variant, seq_len) of every case asked for: a ``--matrix``, or ``--flavors`` x ``--variants`` at
    ``--seq-len`` (debug_gqa at most 2048)."""
    if args.matrix:
        m = MATRICES[args.matrix]
        flavors, variants, seq_lens = list(m["flavors"]), list(m["variants"]), list(m["seq_lens"])
    else:
        flavors = args.flavors.split(",") if args.flavors else list(GPU_FLAVORS)
        variants = args.variants.split(",") if args.variants else list(GPU_VARIANTS)
        seq_lens = [args.seq_len]
    _check_flavors(flavors)
    unknown = [v for v in variants if v not in GPU_VARIANTS]
    if unknown:
        raise SystemExit(f"trainer bench gpu: unknown variant {unknown[0]!r}; known: {', '.join(GPU_VARIANTS)}")
    cases = []
    for flavor in flavors:
        for seq_len in dict.fromkeys(s if flavor != "debug_gqa" else min(s, 2048) for s in seq_lens):
            cases += [(flavor, variant, seq_len) for variant in variants]
    return cases


def bench_gpu(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: the GPU suite runs on a GPU machine (trainer bench gpu)"}

    capacity = torch.cuda.get_device_properties(0).total_memory
    cases = []
    for flavor, variant, seq_len in gpu_cases(args):
        case = _gpu_cell(args, overrides, workdir, flavor, variant, seq_len, capacity)
        cases.append(case)
        print(_gpu_row(case), flush=True)
    return {"cases": cases, "device": torch.cuda.get_device_name(0), "memory_gib": capacity / 2**30,
            "matrix": args.matrix}


def _gpu_cell(args, overrides, workdir, flavor: str, variant: str, seq_len: int, capacity: float) -> dict:
    """One case in its own process, at the largest local batch the planner fits, halved on out-of-memory."""
    small = args.steps == "small"
    ns = argparse.Namespace(config=args.config)
    cfg = load_bench_config(ns, ["--model.flavor", flavor, "--training.seq_len", str(seq_len),
                                 "--training.mixed_precision_param", "bfloat16"], [], f"{workdir}/plan")
    ac = _VARIANT_AC.get(variant, "none")
    lb, est = plan_local_batch(cfg, capacity, ac, args.max_local_batch)
    while True:
        spec = {"flavor": flavor, "variant": variant, "seq_len": seq_len, "local_batch_size": lb,
                "config": str(args.config), "overrides": overrides, "warmup": 2 if small else 5,
                "rounds": 1 if small else 3, "block": 2 if small else 5}
        case = _run_case(spec, args.case_timeout)
        case.update({"flavor": flavor, "variant": variant, "ac": ac, "seq_len": seq_len,
                     "local_batch_size": lb, "plan_estimate_gib": est / 2**30})
        if not (case.get("oom") and lb > 1):
            return case
        lb //= 2
        _, est = plan_local_batch(cfg, 0, ac, lb)  # the estimate at the smaller batch


def _check_flavors(flavors: list[str]) -> None:
    """Stop before any case runs if a flavor is unknown. The trainer resolves each name itself (including
    ``<flavor>_<N>l``, e.g. llama3_8b_4l: 8B-shaped layers, 4 of them), so nothing is registered here."""
    from trainer.models.config import get_model_args

    for flavor in flavors:
        try:
            get_model_args("llama", flavor)
        except ValueError as e:
            raise SystemExit(f"trainer bench gpu: {e}") from None


def _run_case(spec: dict, timeout: float) -> dict:
    env = {**os.environ, "MASTER_PORT": str(_free_port())}
    cmd = [sys.executable, "-m", "trainer.tools.bench", "_gpu_case", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stdout + proc.stderr)[-3000:]
    oom = "OutOfMemoryError" in tail or "CUDA out of memory" in tail
    return {"error": tail.strip().splitlines()[-1] if tail.strip() else f"exit {proc.returncode}", "oom": oom}


def _gpu_row(c: dict) -> str:
    if "error" in c:
        return (f"  {c['flavor']:<14} {c['variant']:<26} s{c['seq_len']:<5} b{c['local_batch_size']:<3} "
                f"ERROR {c['error'][:80]}")
    mfu = "-" if c.get("mfu_pct") is None else f"{c['mfu_pct']:.1f}%"
    return (f"  {c['flavor']:<14} {c['variant']:<26} s{c['seq_len']:<5} b{c['local_batch_size']:<3} "
            f"{c['tokens_per_s']:>10,.0f} tok/s  MFU {mfu:>6}  peak {c['peak_allocated_gib']:6.2f} GiB "
            f"(plan {c['plan_estimate_gib']:.2f})")
