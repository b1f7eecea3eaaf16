"""``trainer bench overhead``, second part: the trainer and a bare loop each in a process of its own.

In one process the two loops share everything a process has (allocator state, threads, caches, the
interpreter's warm paths); here each runs alone, as it would in practice:

* *trainer*: a fresh process builds the real :class:`trainer.train.Trainer` from the config and steps it
  exactly as ``Trainer.train`` does (``Trainer.run_step`` inside the observability session: data from its
  own loader, the per-step callbacks, the log record every ``metrics.log_freq`` steps, ``maybe_save``, the
  watchdog heartbeat, its background threads);
* *bare*: a fresh process that builds ``Transformer`` with the same initial weights, ``torch.optim.AdamW``
  with the same settings and learning rates, and steps forward / backward / clip / step over the same token
  batches held in memory (:class:`~trainer.tools.bench.common.BareLoop`); no process group, no loader, no
  callbacks, no threads of its own.

The parent prepares the batches, weights and learning rates once (a file both can read), then runs
``repeats`` pairs of processes one after the other, alternating which goes first. Each process warms up,
then times ``cycles`` cycles of ``log_freq`` steps with the GC off and prints its median step time; the
ratio of a pair is trainer / bare, and the result is the median ratio over pairs with its spread.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from .common import (ROOT, SMALL, BareLoop, _free_port, _quiet, _sync, bare_state, build_trainer, close_trainer,
                     load_bench_config, lr_factors, observed, trainer_steps)


def _cycle_times(run, first: int, cycles: int, cycle_len: int, device) -> tuple[list[float], list[float]]:
    """Seconds per step of each of ``cycles`` cycles of ``cycle_len`` steps, GC off: wall clock, and process
    CPU time (all of the process's threads: what it costs, whatever else runs on the machine)."""
    times, cpu = [], []
    step = first
    gc.collect()
    gc.disable()
    try:
        for _ in range(cycles):
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            run(step, cycle_len)
            _sync(device)
            times.append((time.perf_counter() - t0) / cycle_len)
            cpu.append((time.process_time() - c0) / cycle_len)
            step += cycle_len
    finally:
        gc.enable()
    return times, cpu


def _config(spec: dict):
    ns = argparse.Namespace(config=spec["config"])
    config = load_bench_config(ns, spec["overrides"], spec["extra"], spec["dump"])
    config.training.steps = spec["horizon"]
    return config


def worker(spec: dict) -> dict[str, Any]:
    """One contender in this process (``spec["role"]``: trainer or bare)."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    config = _config(spec)
    block, warmup, cycles = config.metrics.log_freq, spec["warmup"], spec["cycles"]
    if spec["role"] == "trainer":
        trainer = build_trainer(config)
        device = trainer.device
        with _quiet(), observed(trainer) as obs:
            trainer_steps(trainer, 1, warmup, obs)
            times, cpu = _cycle_times(lambda first, n: trainer_steps(trainer, first, n, obs), warmup + 1, cycles, block,
                                 device)
        close_trainer(trainer)
    else:
        saved = torch.load(spec["inputs"], weights_only=False)
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        bare = BareLoop(config, saved["model_args"], saved["state"], saved["lr_factors"], device,
                        saved["dtype"], saved["accum"], saved["batches"])
        bare.steps(1, warmup)
        times, cpu = _cycle_times(bare.steps, warmup + 1, cycles, block, device)
    return {"role": spec["role"], "step_time_s": statistics.median(times), "cycle_step_times_s": times,
            "cpu_time_per_step_s": statistics.median(cpu), "threads": torch.get_num_threads()}


def _prepare(args, overrides: list[str], extra: list[str], workdir: str, horizon: int, n_batches: int) -> str:
    """Batches (as the trainer's loader yields them), initial weights and learning rates, in one file."""
    from trainer.data.loader import build_train_loader

    config = load_bench_config(args, overrides, extra, f"{workdir}/processes_prepare")
    config.training.steps = horizon
    trainer = build_trainer(config)
    loader = build_train_loader(config, trainer.tokenizer, dp_rank=0, dp_world_size=1)
    batches = [next(loader) for _ in range(n_batches * trainer.accum_steps)]
    loader.close()
    path = f"{workdir}/bare_inputs.pt"
    torch.save({"model_args": trainer.model_args, "state": bare_state(trainer), "batches": batches,
                "lr_factors": lr_factors(trainer, horizon), "dtype": trainer.compute_dtype,
                "accum": trainer.accum_steps}, path)
    close_trainer(trainer)
    return path


def _run_worker(spec: dict, timeout: float) -> dict:
    env = {**os.environ, "MASTER_PORT": str(_free_port())}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "trainer.tools.bench", "_worker", json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    raise RuntimeError(f"benchmark process {spec['role']} failed: {tail[-1] if tail else proc.returncode}")


def best_cycle_ratio(pairs: list[dict], a: str, b: str) -> float:
    """Fastest cycle of ``a`` over fastest cycle of ``b``, over all pairs: on a machine shared with bursty
    load, the least disturbed wall-clock cycles of each."""
    return (min(min(p[a]["cycle_step_times_s"]) for p in pairs) / min(min(p[b]["cycle_step_times_s"]) for p in pairs))


def bench_overhead_processes(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    small = args.steps == "small"
    extra = list(SMALL) if small else []
    config = load_bench_config(args, overrides, extra, f"{workdir}/processes")
    block = config.metrics.log_freq
    cycles = 1 if small else max(2, int(args.steps) // block)
    warmup = 1 if small else 2 * block
    repeats = 1 if small else args.processes
    horizon = 10 * (warmup + cycles * block) + 10  # the schedule's horizon; never reached
    inputs = _prepare(args, overrides, extra, workdir, horizon, min(warmup + cycles * block, 64))
    spec = {"config": str(args.config), "overrides": list(overrides), "extra": extra, "horizon": horizon,
            "warmup": warmup, "cycles": cycles, "inputs": inputs, "threads": args.threads}
    pairs = []
    for r in range(repeats):
        order = ("trainer", "bare") if r % 2 == 0 else ("bare", "trainer")
        out = {role: _run_worker({**spec, "role": role, "dump": f"{workdir}/processes_{role}_{r}"},
                                 args.case_timeout) for role in order}
        pairs.append(out)
    ratios = [p["trainer"]["step_time_s"] / p["bare"]["step_time_s"] for p in pairs]
    cpu_ratios = [p["trainer"]["cpu_time_per_step_s"] / p["bare"]["cpu_time_per_step_s"] for p in pairs]
    return {
        "repeats": repeats, "warmup_steps": warmup, "cycles": cycles, "steps_per_cycle": block,
        "step_time_trainer_s": statistics.median(p["trainer"]["step_time_s"] for p in pairs),
        "step_time_bare_s": statistics.median(p["bare"]["step_time_s"] for p in pairs),
        "overhead_ratio_processes": statistics.median(ratios), "ratio_per_repeat": ratios,
        "ratio_spread": max(ratios) - min(ratios),
        "overhead_ratio_processes_cpu_time": statistics.median(cpu_ratios), "cpu_ratio_per_repeat": cpu_ratios,
        "overhead_ratio_processes_best_cycle": best_cycle_ratio(pairs, "trainer", "bare"),
        "runs": pairs,
    }
