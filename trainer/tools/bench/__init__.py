"""``trainer bench``: performance benchmarks of the trainer itself.

    trainer bench [overhead|data|data-files|checkpoint|staging|gpu|kernels|vs-torchtitan|integrity|eval|
                   context-parallel|all]
                  [--json FILE] [--steps N|small] [--config FILE] [--section.key value ...]

Suites (each prints rows of the table and fills one entry of the JSON results):

* ``overhead``: the trainer's step time against a bare PyTorch loop in the same process: the real
  :class:`trainer.train.Trainer` (single-rank process group; its ``train_step``, ``log_step`` every
  ``metrics.log_freq`` steps and ``checkpointer.maybe_save``, exactly what ``Trainer.train`` runs per step)
  versus a hand-written loop (``Transformer`` built directly with the same weights, ``torch.optim.AdamW``
  with the same settings, the same clipping and the same token batches, drawn up front into memory, so its
  data costs nothing). Time is taken over cycles of ``log_freq`` steps (one logged step each); within a
  cycle the contenders take turns step by step (on a GPU: cycle by cycle) in rotating order, the GC is off
  while timed, all run with the same threads. ``overhead_ratio`` is the median over cycles of (trainer
  time / bare time), wall clock; ``overhead_ratio_cpu_time`` the same in process CPU time, which a shared
  machine's load does not disturb. A third contender, the trainer fed the same in-memory batches,
  separates the data loader's share (``overhead_ratio_no_loader``). Then (``--processes N`` pairs, 0 to
  skip) the trainer and the bare loop each in a process of its own (``processes.py``):
  ``overhead_ratio_processes``.
* ``data``: tokens/s the training loader delivers, tokenizing on the fly and from pre-tokenized files
  (``trainer.tools.bench.data.measure_throughput``), against the tokens/s the model consumes, measured in the same
  run by the trainer, and the fraction of the trainer's step time spent waiting for data (its own
  ``data_wait_s`` accounting).
* ``data-files``: the loader on token files other trainers write (megatron, numpy, fms-fsdp arrow) at seq_len
  4096 and 8192, per kind, against plain numpy memmap slicing of the same tokens in the same run
  (``trainer.tools.bench.data_files``).
* ``checkpoint``: first against the disk (``checkpoint_disk.py``): the raw sequential write (fsync'ed) and
  read bandwidth of the filesystem (``--checkpoint-folder``; reads after dropping the page cache with
  posix_fadvise), and for each model size (``--checkpoint-sizes``, bf16 weights and AdamW moments) and with
  checksums on and off: sync save, async blocking / staged / committed, load and verify, each as a fraction
  of the raw bandwidth. Then inside a debug-model training run: save throughput of synchronous and
  asynchronous saves and load throughput, through the trainer's ``CheckpointManager`` (DCP); how long an
  asynchronous save blocks the loop (from the save call until the loop may continue) against a
  synchronous save; and the slowdown of steps while the background write runs. Both asynchronous modes
  are run, and the copy of the state (a fresh copy per save with ``async``, buffers reused from save to
  save with ``async_with_pinned_mem``) is timed in each, as a ratio of the two, and alone at
  ``--staging-gb`` on the training device (``staging``, below).
* ``staging``: only that copy, fresh against reused buffers (pinned on CUDA), ``--staging-gb`` GB of
  float32 tensors on CUDA when there is one (``staging.py``).
* ``gpu`` (CUDA only; skipped elsewhere): tokens/s, MFU and peak memory per flavor (debug_gqa, llama3_1b,
  llama3_3b, llama3_8b with fewer layers) and variant (eager bf16, compile, compile+float8 tensorwise,
  compile+float8 rowwise, compile+selective op AC, compile+full AC), each case in its own process, with the
  local batch chosen by ``trainer plan``'s memory estimate (halved on out-of-memory) and that estimate
  recorded beside the measured peak. ``--matrix hot_path``: 1B and 8B-shaped layers at seq 4096 and 8192,
  bf16 and float8, compile on and off. Refused in one line (exit 2) without CUDA.
* ``kernels``: the two forms of the rotary embedding (real-valued chain, complex multiply), eager and
  compiled, at the debug and an 8B-layer shape, and the debug model's forward+backward with each.
* ``vs-torchtitan``: our trainer's steady step against torchtitan 0.2.2's at the same shape and settings,
  separate processes, interleaved (when torchtitan is importable; one line otherwise).
* ``integrity``: checksum throughput, and what checksums add to a DCP save and to the check before a load.
* ``context-parallel``: one sequence of ``--cp-seq-len`` tokens (8192) over 1, 2 and 4 context-parallel
  ranks, causal and ``block_causal``, both rotate methods: step time against CP 1, and each rank's peak
  tensor memory (torch's memory tracker over the real run) against ``trainer plan``'s estimate
  (``context_parallel.py``).
* ``eval``: ``trainer eval`` wall time on the same requests with 2 processes against 1 (the data-parallel
  split of the requests), and that both give the same scores (``eval.py``).

``all`` runs overhead, data, checkpoint and (with CUDA) gpu.

Defaults are the debug model's config (train_configs/debug_model.toml); ``--section.key value`` overrides
it. ``--steps small`` shrinks everything to a seconds-long smoke run (used by the tests).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainer.config import ConfigError

from .common import DEFAULT_CONFIG, load_bench_config, machine_info
from .gpu import GPU_FLAVORS, GPU_VARIANTS, MATRICES, _check_flavors, _run_case, bench_gpu, gpu_case  # noqa: F401
from .report import TARGETS, format_table

__all__ = ["main", "SUITES", "DEFAULT_CONFIG", "GPU_FLAVORS", "GPU_VARIANTS", "bench_gpu", "format_table",
           "load_bench_config"]

# name -> (module, function(args, overrides, workdir) -> dict, part of 'all').
SUITES: dict[str, tuple[str, str, bool]] = {
    "overhead": ("trainer.tools.bench.overhead", "bench_overhead", True),
    "data": ("trainer.tools.bench.data", "bench_data", True),
    "data-files": ("trainer.tools.bench.data_files", "bench_data_files", False),
    "checkpoint": ("trainer.tools.bench.checkpoint", "bench_checkpoint", True),
    "staging": ("trainer.tools.bench.staging", "bench_staging", False),
    "integrity": ("trainer.tools.bench.integrity", "bench_integrity", False),
    "gpu": ("trainer.tools.bench.gpu", "bench_gpu", True),
    "kernels": ("trainer.tools.bench.kernels", "bench_kernels", False),
    "vs-torchtitan": ("trainer.tools.bench.vs_torchtitan", "bench_vs_torchtitan", False),
    "eval": ("trainer.tools.bench.eval", "bench_eval", False),
    "context-parallel": ("trainer.tools.bench.context_parallel", "bench_context_parallel", False),
}


def run_suite(name: str, args, overrides: list[str], workdir: str) -> dict[str, Any]:
    module, func, _ = SUITES[name]
    return getattr(importlib.import_module(module), func)(args, overrides, workdir)


def _internal(command: str, spec: dict) -> int:
    """A benchmark process started by a suite: prints its result as one JSON line."""
    from trainer import logs

    logs.setup()
    if command == "_gpu_case":
        try:
            result = gpu_case(spec)
        except torch.OutOfMemoryError as e:
            result = {"error": f"out of memory: {str(e).splitlines()[0]}", "oom": True}
    elif command == "_cp_rank":
        from .context_parallel import rank_worker

        result = rank_worker(spec)
    elif spec["role"] in ("ours", "torchtitan", "ours_losses", "torchtitan_losses"):
        from . import vs_torchtitan

        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        result = getattr(vs_torchtitan, f"{spec['role']}_worker")(spec)
    else:
        from .processes import worker

        result = worker(spec)
    print(json.dumps(result), flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainer bench", allow_abbrev=False,
        description="Benchmarks of the trainer: framework overhead, data loader, checkpoint, GPU. Other "
                    "--section.key value arguments override the benchmark config.")
    parser.add_argument("suite", nargs="?", default="all", choices=(*SUITES, "all"))
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--steps", default="30",
                        help="measured steps per contender (overhead; data uses half), or 'small' for a smoke run")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML config (default: the debug model)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--data-seconds", type=float, default=3.0, help="seconds per loader measurement")
    parser.add_argument("--checkpoint-repeats", type=int, default=5, help="checkpoint, eval: repeats")
    parser.add_argument("--checkpoint-sizes", default=None,
                        help="checkpoint: comma-separated model flavors measured against the disk (default "
                             "debugmodel,llama3_1b_4l,llama3_1b; those that do not fit in memory are skipped)")
    parser.add_argument("--staging-gb", type=float, default=1.0,
                        help="checkpoint, staging: GB of state copied by a background save's staging, fresh against "
                             "reused buffers (on CUDA when there is one)")
    parser.add_argument("--checkpoint-folder", default=None,
                        help="checkpoint: where to write (the filesystem measured; default: a temporary folder)")
    parser.add_argument("--integrity-mb", type=int, default=256, help="integrity: MiB hashed in memory and on disk")
    parser.add_argument("--processes", type=int, default=3,
                        help="overhead: pairs of separate trainer / bare-loop processes (0: in-process only)")
    parser.add_argument("--flavors", default=None, help=f"gpu: comma-separated (default {','.join(GPU_FLAVORS)})")
    parser.add_argument("--variants", default=None, help=f"gpu: comma-separated (default {','.join(GPU_VARIANTS)})")
    parser.add_argument("--matrix", default=None, choices=sorted(MATRICES),
                        help="gpu: a named set of cases (hot_path: 1B and 8B-shaped layers at seq 4096 and 8192, "
                             "bf16 and float8, compile on and off) instead of --flavors/--variants/--seq-len")
    parser.add_argument("--seq-len", type=int, default=4096, help="gpu: sequence length (debug_gqa: at most 2048)")
    parser.add_argument("--max-local-batch", type=int, default=8, help="gpu: largest local batch tried")
    parser.add_argument("--case-timeout", type=float, default=900,
                        help="gpu: seconds per case; context-parallel: seconds per step of a case")
    parser.add_argument("--cp-seq-len", type=int, default=8192, help="context-parallel: the sequence length")
    parser.add_argument("--cp-warmup", type=int, default=1, help="context-parallel: untimed steps per case")
    parser.add_argument("--cp-steps", type=int, default=3,
                        help="context-parallel: timed steps per case at CP 1 and 2 (CP 4: one; its ranks share cores)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["_worker"], ["_gpu_case"], ["_cp_rank"]):  # internal: one contender or case in a fresh process
        return _internal(argv[0], json.loads(argv[1]))
    parser = _parser()
    args, overrides = parser.parse_known_args(argv)
    if args.steps != "small" and not args.steps.isdigit():
        parser.error("--steps takes a number or 'small'")
    bad = [o for o in overrides if o.startswith("-") and "." not in o]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if args.suite == "gpu" and not torch.cuda.is_available():
        print("trainer bench gpu: no CUDA device on this machine; run it where a GPU is (the other suites run "
              "anywhere)", file=sys.stderr)
        return 2
    from trainer import logs

    logs.setup()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.suite == "all":
        suites = [s for s, (_, _, in_all) in SUITES.items()
                  if in_all and (s != "gpu" or torch.cuda.is_available())]
    else:
        suites = [args.suite]
    results: dict[str, Any] = {}
    report = {"command": "trainer bench " + " ".join(argv), "machine": machine_info(), "results": results,
              "targets": {k: f"{op} {b:g}" for k, (op, b) in TARGETS.items()}}
    try:
        with tempfile.TemporaryDirectory(prefix="trainer_bench_") as workdir:
            for suite in suites:
                t0 = time.perf_counter()
                results[suite] = run_suite(suite, args, overrides, workdir)
                results[suite]["seconds"] = time.perf_counter() - t0
                if args.json:  # partial results survive a later failure
                    Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    except ConfigError as e:  # a suite's config (the file, its settings, the user's overrides) the trainer refuses
        print(f"trainer bench: config error: {e}", file=sys.stderr)
        return 2
    finally:
        from trainer.setup import close_process_group

        close_process_group()
    with contextlib.suppress(OSError):
        report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"results written to {args.json}")
    return 0
