"""``trainer bench``: performance benchmarks of the trainer itself.

    trainer bench [overhead|data|checkpoint|gpu|all] [--json FILE] [--steps N|small] [--config FILE]
                  [--section.key value ...]

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
  separates the data loader's share (``overhead_ratio_no_loader``).
* ``data``: tokens/s the training loader delivers, tokenizing on the fly and from pre-tokenized files
  (``trainer.data.bench.measure_throughput``), against the tokens/s the model consumes, measured in the same
  run by the trainer, and the fraction of the trainer's step time spent waiting for data (its own
  ``data_wait_s`` accounting).
* ``checkpoint``: save throughput of synchronous and asynchronous saves and load throughput, through the
  trainer's ``CheckpointManager`` (DCP); how long an asynchronous save blocks the loop (from the save call
  until the loop may continue) against a synchronous save; and the slowdown of steps while the background
  write runs.
* ``gpu`` (CUDA only; skipped elsewhere): tokens/s, MFU and peak memory per flavor (debugmodel, llama3_1b,
  llama3_3b, llama3_8b with fewer layers) and variant (eager bf16, compile, compile+float8 tensorwise,
  compile+float8 rowwise, compile+selective op AC, compile+full AC), each case in its own process, with the
  local batch chosen by ``trainer plan``'s memory estimate (halved on out-of-memory) and that estimate
  recorded beside the measured peak.

Defaults are the debug model's config (train_configs/debug_model.toml); ``--section.key value`` overrides
it. ``--steps small`` shrinks everything to a seconds-long smoke run (used by the tests).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import logging
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from trainer.parallel import clean_fqn

logger = logging.getLogger("trainer")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "train_configs" / "debug_model.toml"
SUITES = ("overhead", "data", "checkpoint", "gpu")

# Targets on CPU (docs/benchmarks.md): (metric, comparison, bound).
TARGETS = {
    "overhead_ratio": ("<=", 1.05),
    "loader_vs_consumption": (">=", 10.0),
    "async_block_fraction": ("<", 0.20),
}


# --------------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_rank_env() -> None:
    """Environment for a one-process gloo/NCCL group (a free port, so parallel runs do not collide)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if os.environ["WORLD_SIZE"] != "1":
        raise SystemExit("trainer bench runs as a single process (WORLD_SIZE=1)")


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    with contextlib.suppress(OSError):
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    with contextlib.suppress(Exception):
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                            text=True, timeout=10).stdout.strip() or None
    return info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _quiet():
    """Keep the trainer's per-step console lines out of the benchmark table (they are still formatted)."""
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_bench_config(args, overrides: list[str], extra: list[str], dump: str):
    """The benchmark's config: the file, then the suite's settings, then the user's overrides."""
    from trainer.config import load_config

    base = ["--job.config_file", str(args.config), "--job.dump_folder", dump,
            "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false"]
    return load_config(base + extra + list(overrides), env={})


def build_trainer(config):
    from trainer.train import Trainer

    single_rank_env()
    with _quiet():
        trainer = Trainer(config)
    trainer.data_iter = iter(trainer.train_loader)
    return trainer


def close_trainer(trainer) -> None:
    with contextlib.suppress(Exception):
        trainer.checkpointer.finish()
    with contextlib.suppress(Exception):
        trainer.metrics.close()
    with contextlib.suppress(Exception):
        trainer.train_loader.close()


class _NoObservability:
    """Stands in for trainer.observability.Observability where a suite runs steps outside a session."""

    @contextlib.contextmanager
    def step(self, step):
        yield

    @contextlib.contextmanager
    def checkpoint(self):
        yield

    def step_done(self, step):
        pass


def trainer_steps(trainer, first: int, n: int, obs=None) -> int:
    """Steps first .. first+n-1 exactly as ``Trainer.train`` runs them (``Trainer.run_step``). ``obs``: an
    entered ``trainer.observability.Observability``, as ``Trainer.train`` holds one; None skips its hooks."""
    obs = obs if obs is not None else _NoObservability()
    step = first
    for step in range(first, first + n):
        trainer.run_step(step, obs)
    return step


@contextlib.contextmanager
def observed(trainer):
    """``Trainer.train``'s observability session (profiler, memory snapshots, watchdog) around a block of
    benchmark steps, when this version of the trainer has one."""
    try:
        from trainer.observability import Observability
    except ImportError:
        yield None
        return
    with Observability(trainer) as obs:
        yield obs


# --------------------------------------------------------------------------------------------------
# The bare loop
# --------------------------------------------------------------------------------------------------


class BareLoop:
    """A training loop with no framework: the model class, AdamW, clipping, a list of batches."""

    def __init__(self, trainer, batches: list[dict[str, torch.Tensor]]):
        from trainer.models.llama import Transformer

        config = trainer.config
        self.device = trainer.device
        self.accum = trainer.accum_steps
        self.log_freq = config.metrics.log_freq
        self.max_norm = config.training.max_norm
        with torch.device(self.device):
            model = Transformer(trainer.model_args)
        # Model-level choices that change the computation are mirrored, so that both loops compute the same:
        # float8 Linear layers, activation checkpointing, per-block compile (thin wrappers over torchao,
        # torch.utils.checkpoint and torch.compile).
        if config.model.converters:
            from trainer.train import apply_converters

            apply_converters(model, config)
        state = {clean_fqn(k): v for k, v in trainer.model.state_dict().items()}
        model.load_state_dict(state)
        if config.activation_checkpoint.mode != "none":
            from trainer.parallel.parallelize import apply_ac

            apply_ac(model, config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option)
        if config.compile.enable:
            for name, block in list(model.layers.items()):
                model.layers[name] = torch.compile(block, backend=config.compile.backend, fullgraph=True)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        o = config.optimizer
        kind = {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(o.implementation, {"foreach": False})
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in self.params if p.ndim >= 2], "weight_decay": o.weight_decay},
             {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **kind)
        schedule = trainer.lr_schedule  # a pure function of the step: the same learning rates
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda i: schedule.factor(i + 1))
        dtype = trainer.compute_dtype
        self.autocast = (torch.autocast(self.device.type, dtype=dtype) if dtype != torch.float32
                         else contextlib.nullcontext())
        if self.device.type == "cuda":
            batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
        self.data = itertools.cycle(batches)
        self.last_loss: float | None = None

    def step(self, step: int) -> torch.Tensor:
        batches = [next(self.data) for _ in range(self.accum)]
        tokens = sum(b["labels"].numel() for b in batches)
        total = torch.zeros((), device=self.device)
        for b in batches:
            inputs = b["input"].to(self.device, non_blocking=True)
            labels = b["labels"].to(self.device, non_blocking=True)
            with self.autocast:
                logits = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum") / tokens
            loss.backward()
            total += loss.detach()
            del logits
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm if self.max_norm > 0 else float("inf"),
                                       foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if step % self.log_freq == 0:
            self.last_loss = total.item()  # what printing the loss costs
        return total

    def steps(self, first: int, n: int) -> None:
        for step in range(first, first + n):
            self.step(step)


# --------------------------------------------------------------------------------------------------
# Suite: framework overhead
# --------------------------------------------------------------------------------------------------


def _timed_cycles(contenders: dict[str, Callable[[int, int], None]], cycles: int, cycle_len: int, device,
                  first_step: int, chunk: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall-clock and process-CPU seconds per step of each contender, one value per cycle of ``cycle_len``
    steps (= metrics.log_freq, so every cycle of every contender holds one logged step).

    Within a cycle the contenders take turns every ``chunk`` steps, in an order that rotates each turn: on
    a shared machine a burst of load then slows all of them alike. (On CPU chunk is 1; on a GPU a whole
    cycle, so that the host can run ahead of the device as in training.) CPU time counts this process's
    threads only: what the contender itself costs, whatever else runs on the machine."""
    names = list(contenders)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    steps = {n: first_step for n in names}
    turn = 0
    gc.collect()
    gc.disable()
    try:
        for _ in range(cycles):
            w = dict.fromkeys(names, 0.0)
            c = dict.fromkeys(names, 0.0)
            for _ in range(0, cycle_len, chunk):
                order = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for name in order:
                    _sync(device)
                    t0, c0 = time.perf_counter(), time.process_time()
                    contenders[name](steps[name], chunk)
                    _sync(device)
                    w[name] += time.perf_counter() - t0
                    c[name] += time.process_time() - c0
                    steps[name] += chunk
            for name in names:
                wall[name].append(w[name] / cycle_len)
                cpu[name].append(c[name] / cycle_len)
    finally:
        gc.enable()
    return wall, cpu


def bench_overhead(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    small = args.steps == "small"
    extra = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "2"] if small else []
    config = load_bench_config(args, overrides, extra, f"{workdir}/overhead")
    block = config.metrics.log_freq
    rounds = 2 if small else max(2, int(args.steps) // block)  # cycles of log_freq steps
    warmup = 1 if small else 2
    total = warmup + rounds * block
    chunk = block if torch.cuda.is_available() else 1
    config.training.steps = 10 * total + 10  # the schedule's horizon; never reached

    trainer = build_trainer(config)
    from trainer.data import build_train_loader

    # The bare loop's data: the very batches the trainer's loader yields, drawn into memory up front.
    loader = build_train_loader(config, trainer.tokenizer, dp_rank=0, dp_world_size=1)
    n_batches = min(total * trainer.accum_steps, 64)
    batches = [next(loader) for _ in range(n_batches)]
    loader.close()
    bare = BareLoop(trainer, batches)  # copies the trainer's initial weights

    # Parity: same weights, same first batch -> the same loss (checks that both compute the same thing).
    with _quiet():
        out = trainer.train_step(1)
    loss_trainer = float(out["loss"])
    loss_bare = float(bare.step(1))
    with _quiet():
        trainer_steps(trainer, 2, warmup - 1)
    bare.steps(2, warmup - 1)

    # The trainer again, fed from memory: separates the loader's share of the overhead. Both trainer
    # contenders share the one trainer and its step counter.
    in_memory = itertools.cycle(batches)
    real_iter = trainer.data_iter
    next_step = [warmup + 1]

    session: dict[str, Any] = {}

    def run_trainer(data_iter) -> Callable[[int, int], None]:
        def run(_first: int, n: int) -> None:
            trainer.data_iter = data_iter
            trainer_steps(trainer, next_step[0], n, session.get("obs"))
            next_step[0] += n
        return run

    contenders = {"trainer": run_trainer(real_iter), "bare": bare.steps,
                  "trainer_no_loader": run_trainer(in_memory)}
    with _quiet(), observed(trainer) as obs:
        session["obs"] = obs
        times, cpu = _timed_cycles(contenders, rounds, block, trainer.device, warmup + 1, chunk)
    trainer.data_iter = real_iter
    tokens_per_step = trainer.accum_steps * config.training.local_batch_size * config.training.seq_len
    per_round = [t / b for t, b in zip(times["trainer"], times["bare"])]
    per_round_nl = [t / b for t, b in zip(times["trainer_no_loader"], times["bare"])]
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "device": str(trainer.device), "flavor": config.model.flavor, "seq_len": config.training.seq_len,
        "local_batch_size": config.training.local_batch_size, "grad_accum_steps": trainer.accum_steps,
        "tokens_per_step": tokens_per_step, "threads": torch.get_num_threads(), "cycles": rounds,
        "steps_per_cycle": block, "interleave_steps": chunk, "warmup_steps": warmup,
        "step_time_trainer_s": med["trainer"], "step_time_bare_s": med["bare"],
        "step_time_trainer_no_loader_s": med["trainer_no_loader"],
        "overhead_ratio": statistics.median(per_round),
        "overhead_ratio_of_medians": med["trainer"] / med["bare"],
        "overhead_ratio_no_loader": statistics.median(per_round_nl),
        "overhead_ratio_per_cycle": per_round,
        "overhead_ratio_cpu_time": statistics.median(t / b for t, b in zip(cpu["trainer"], cpu["bare"])),
        "overhead_ratio_cpu_time_no_loader": statistics.median(
            t / b for t, b in zip(cpu["trainer_no_loader"], cpu["bare"])),
        "cpu_time_per_step_trainer_s": statistics.median(cpu["trainer"]),
        "cpu_time_per_step_bare_s": statistics.median(cpu["bare"]),
        "tokens_per_s_trainer": tokens_per_step / med["trainer"],
        "tokens_per_s_bare": tokens_per_step / med["bare"],
        "loss_step1_trainer": loss_trainer, "loss_step1_bare": loss_bare,
        "cycle_step_times_s": times, "cycle_step_cpu_times_s": cpu,
    }
    close_trainer(trainer)
    return result


# --------------------------------------------------------------------------------------------------
# Suite: data loader
# --------------------------------------------------------------------------------------------------


def bench_data(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    from trainer.data.bench import measure_throughput

    small = args.steps == "small"
    extra = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "2"] if small else []
    config = load_bench_config(args, overrides, extra, f"{workdir}/data")
    n_steps = 4 if small else max(2 * config.metrics.log_freq, int(args.steps) // 2)
    config.training.steps = 10 * n_steps + 10
    trainer = build_trainer(config)
    # Consumption: the trainer's own throughput accounting (tokens, step time, data wait) per log record,
    # after one warm-up interval.
    log_freq = config.metrics.log_freq
    with _quiet(), observed(trainer) as obs:
        trainer_steps(trainer, 1, log_freq, obs)
        trainer_steps(trainer, log_freq + 1, n_steps, obs)
    records = [json.loads(line) for line in Path(trainer.metrics.path).read_text().splitlines() if line.strip()]
    records = [r for r in records if r["step"] > log_freq]
    step_time = sum(r["step_time_s"] for r in records) / len(records)
    data_wait = sum(r["data_wait_s"] for r in records) / len(records)
    tokens_per_step = trainer.accum_steps * config.training.local_batch_size * config.training.seq_len
    consumption = tokens_per_step / step_time
    tokenizer = trainer.tokenizer
    close_trainer(trainer)

    seconds = 1.0 if small else args.data_seconds
    rates = measure_throughput(config, tokenizer, seconds=seconds, workdir=workdir)
    slowest = min(rates["tokens_per_s_on_the_fly"], rates["tokens_per_s_pretokenized"])
    return {
        "flavor": config.model.flavor, "seq_len": config.training.seq_len,
        "local_batch_size": config.training.local_batch_size, "num_workers": config.data.num_workers,
        "tokens_per_s_on_the_fly": rates["tokens_per_s_on_the_fly"],
        "tokens_per_s_pretokenized": rates["tokens_per_s_pretokenized"],
        "prepare_seconds": rates["prepare_seconds"],
        "tokens_per_s_consumed": consumption,
        "loader_vs_consumption": slowest / consumption,
        "loader_vs_consumption_on_the_fly": rates["tokens_per_s_on_the_fly"] / consumption,
        "loader_vs_consumption_pretokenized": rates["tokens_per_s_pretokenized"] / consumption,
        "step_time_s": step_time, "data_wait_s": data_wait, "data_wait_fraction": data_wait / step_time,
        "measured_steps": sum(1 for _ in records) * log_freq,
    }


# --------------------------------------------------------------------------------------------------
# Suite: checkpoint
# --------------------------------------------------------------------------------------------------


def _checkpoint_mode(args, overrides: list[str], workdir: str, async_mode: str, repeats: int) -> dict[str, Any]:
    """Synchronous and asynchronous saves and loads through one trainer's CheckpointManager."""
    from trainer.checkpoint import MARKER, tree_size

    small = args.steps == "small"
    extra = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "2"] if small else []
    extra += ["--checkpoint.enable", "true", "--checkpoint.async_mode", async_mode,
              "--checkpoint.interval", "100000", "--checkpoint.keep_latest_k", "2",
              "--checkpoint.folder", "checkpoint"]
    config = load_bench_config(args, overrides, extra, f"{workdir}/checkpoint_{async_mode}")
    config.training.steps = 1_000_000
    trainer = build_trainer(config)
    ckpt = trainer.checkpointer
    device = trainer.device
    step = 0

    def train(n: int) -> list[float]:
        nonlocal step
        times = []
        for _ in range(n):
            step += 1
            _sync(device)
            t0 = time.perf_counter()
            trainer_steps(trainer, step, 1)
            _sync(device)
            times.append(time.perf_counter() - t0)
        return times

    def timed(fn) -> float:
        _sync(device)
        t0 = time.perf_counter()
        ok = fn()
        _sync(device)
        if ok is False:
            raise RuntimeError(f"checkpoint save at step {step} failed")
        return time.perf_counter() - t0

    def drain() -> list[float]:
        """Train while the background save runs; maybe_save polls it and commits it when done."""
        times = train(1)  # the first step after the save: waits for staging, if the stager makes it wait
        while ckpt.pending is not None and len(times) < 1000:
            times += train(1)
        ckpt.finish()
        return times

    sync_s, async_block_s, async_total_s, async_write_s, load_s, nbytes = [], [], [], [], [], []
    normal_step, first_after, during_write = [], [], []
    with _quiet():
        train(2)  # optimizer state exists from here on
        # Warm-up (untimed): the first save of a process pays for imports, planner caches, new files.
        ckpt.save(step, kind="full", asynchronous=False)
        train(1)
        ckpt.save(step, kind="full", asynchronous=True)
        drain()
        for _ in range(repeats):
            normal_step += train(2)
            # Synchronous: the loop waits for all of it.
            sync_s.append(timed(lambda: ckpt.save(step, kind="full", asynchronous=False)))
            nbytes.append(tree_size(ckpt.folder / f"step-{step}"))
            normal_step += train(1)
            # Asynchronous: the loop continues when save() returns; staging and writing may go on after.
            t_call = time.perf_counter()
            async_block_s.append(timed(lambda: ckpt.save(step, kind="full", asynchronous=True)))
            saved = step
            done_at: list[float] = []
            upload = getattr(ckpt.pending, "upload", None)
            if upload is not None and hasattr(upload, "add_done_callback"):
                upload.add_done_callback(lambda _f: done_at.append(time.perf_counter()))
            after = drain()
            if done_at:
                async_write_s.append(done_at[0] - t_call)
            first_after.append(after[0])
            during_write += after[:-1] or after
            async_total_s.append(json.loads((ckpt.folder / f"step-{saved}" / MARKER).read_text())["save_seconds"])
            # Load: the newest complete checkpoint back into the trainer.
            load_s.append(timed(lambda: ckpt.load()))
            step = trainer.state.step
    close_trainer(trainer)
    med = statistics.median
    size = med(nbytes)
    step_time = med(normal_step)
    first_extra = max(0.0, med(first_after) - step_time)
    return {
        "async_mode": async_mode, "repeats": repeats, "checkpoint_bytes": size,
        "sync_save_s": med(sync_s), "async_blocking_s": med(async_block_s),
        "async_first_step_extra_s": first_extra, "async_call_to_commit_s": med(async_total_s), "load_s": med(load_s),
        "async_write_s": med(async_write_s) if async_write_s else None,
        "sync_save_gb_per_s": size / med(sync_s) / 1e9,
        "async_save_gb_per_s": size / med(async_write_s) / 1e9 if async_write_s else None,
        "load_gb_per_s": size / med(load_s) / 1e9,
        "async_block_fraction": med(async_block_s) / med(sync_s),
        "async_block_fraction_incl_next_step": (med(async_block_s) + first_extra) / med(sync_s),
        "step_time_s": step_time, "step_time_during_async_write_s": med(during_write),
        "samples": {"sync_save_s": sync_s, "async_blocking_s": async_block_s, "async_call_to_commit_s": async_total_s,
                    "async_write_s": async_write_s, "load_s": load_s, "first_step_after_async_s": first_after},
    }


def bench_checkpoint(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    """Both asynchronous modes (``async``: a fresh staging copy per save; ``async_with_pinned_mem``: reused
    pinned buffers and background staging on CUDA), each on its own trainer; the headline is the mode
    that blocks least."""
    repeats = 1 if args.steps == "small" else args.checkpoint_repeats
    modes = {m: _checkpoint_mode(args, overrides, workdir, m, repeats) for m in ("async", "async_with_pinned_mem")}
    best = min(modes.values(), key=lambda r: r["async_block_fraction"])
    return {**{k: v for k, v in best.items() if k != "samples"}, "modes": modes}


# --------------------------------------------------------------------------------------------------
# Suite: GPU throughput, MFU and peak memory (one process per case)
# --------------------------------------------------------------------------------------------------

GPU_FLAVORS = ("debugmodel", "llama3_1b", "llama3_3b", "llama3_8b_4l")
GPU_VARIANTS: dict[str, list[str]] = {
    "eager": [],
    "compile": ["--compile.enable", "true"],
    "compile_float8_tensorwise": ["--compile.enable", "true", "--model.converters", "quantize.linear.float8",
                                  "--quantize.linear.float8.recipe_name", "tensorwise"],
    "compile_float8_rowwise": ["--compile.enable", "true", "--model.converters", "quantize.linear.float8",
                               "--quantize.linear.float8.recipe_name", "rowwise"],
    "compile_ac_selective_op": ["--compile.enable", "true", "--activation_checkpoint.mode", "selective",
                                "--activation_checkpoint.selective_ac_option", "op"],
    "compile_ac_full": ["--compile.enable", "true", "--activation_checkpoint.mode", "full"],
}
_VARIANT_AC = {"compile_ac_selective_op": "selective_op", "compile_ac_full": "full"}


def plan_local_batch(config, capacity_bytes: float, ac: str, max_batch: int) -> tuple[int, float]:
    """The largest power-of-two local batch whose single-GPU estimate fits 90% of the GPU, and its estimate."""
    from trainer.plan import Layout, Shape, memory_estimate, model_args_for_plan

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


def bench_gpu(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: the GPU suite runs on a GPU machine (trainer bench gpu)"}
    from trainer.plan import Shape  # noqa: F401  (fail early if the planner is broken)

    flavors = args.flavors.split(",") if args.flavors else list(GPU_FLAVORS)
    variants = args.variants.split(",") if args.variants else list(GPU_VARIANTS)
    capacity = torch.cuda.get_device_properties(0).total_memory
    small = args.steps == "small"
    cases = []
    _check_flavors(flavors)
    for flavor in flavors:
        for variant in variants:
            if variant not in GPU_VARIANTS:
                raise SystemExit(f"unknown variant {variant!r}; known: {', '.join(GPU_VARIANTS)}")
            seq_len = args.seq_len if flavor != "debugmodel" else min(args.seq_len, 2048)
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
                if case.get("oom") and lb > 1:
                    lb //= 2
                    _, est = plan_local_batch(cfg, 0, ac, lb)  # the estimate at the smaller batch
                    continue
                break
            cases.append(case)
            print(_gpu_row(case), flush=True)
    return {"cases": cases, "device": torch.cuda.get_device_name(0), "memory_gib": capacity / 2**30}


def _check_flavors(flavors: list[str]) -> None:
    """Stop before any case runs if a flavor is unknown. The trainer resolves each name itself (including
    ``<flavor>_<N>l``, e.g. llama3_8b_4l: 8B-shaped layers, 4 of them), so nothing is registered here."""
    from trainer.models import get_model_args

    for flavor in flavors:
        try:
            get_model_args("llama", flavor)
        except ValueError as e:
            raise SystemExit(f"trainer bench gpu: {e}") from None


def _run_case(spec: dict, timeout: float) -> dict:
    env = {**os.environ, "MASTER_PORT": str(_free_port())}
    cmd = [sys.executable, "-m", "trainer.bench", "_gpu_case", json.dumps(spec)]
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
        return f"  {c['flavor']:<14} {c['variant']:<26} b{c['local_batch_size']:<3} ERROR {c['error'][:80]}"
    mfu = "-" if c.get("mfu_pct") is None else f"{c['mfu_pct']:.1f}%"
    return (f"  {c['flavor']:<14} {c['variant']:<26} b{c['local_batch_size']:<3} {c['tokens_per_s']:>10,.0f} tok/s  "
            f"MFU {mfu:>6}  peak {c['peak_allocated_gib']:6.2f} GiB (plan {c['plan_estimate_gib']:.2f})")


# --------------------------------------------------------------------------------------------------
# Table, JSON, CLI
# --------------------------------------------------------------------------------------------------


def _check(metric: str, value: float | None) -> str:
    if metric not in TARGETS or value is None:
        return ""
    op, bound = TARGETS[metric]
    ok = {"<=": value <= bound, ">=": value >= bound, "<": value < bound}[op]
    return f"target {op} {bound:g}: {'PASS' if ok else 'MISS'}"


def format_table(results: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str]] = []

    def add(name: str, value: Any, fmt: str = "{:.4g}", metric: str | None = None) -> None:
        shown = "-" if value is None else (fmt.format(value) if isinstance(value, (int, float)) else str(value))
        rows.append((name, shown, _check(metric or name, value) if isinstance(value, (int, float)) else ""))

    if "overhead" in results:
        o = results["overhead"]
        add("overhead: device", o["device"])
        add("overhead: trainer step time (s)", o["step_time_trainer_s"])
        add("overhead: bare loop step time (s)", o["step_time_bare_s"])
        add("overhead: trainer step, in-memory data (s)", o["step_time_trainer_no_loader_s"])
        add("overhead_ratio (trainer / bare)", o["overhead_ratio"], "{:.4f}", "overhead_ratio")
        add("overhead_ratio_no_loader", o["overhead_ratio_no_loader"], "{:.4f}")
        add("overhead: CPU-time ratio (with / without loader)",
            f"{o['overhead_ratio_cpu_time']:.4f} / {o['overhead_ratio_cpu_time_no_loader']:.4f}")
        add("overhead: loss step 1 trainer / bare", f"{o['loss_step1_trainer']:.6f} / {o['loss_step1_bare']:.6f}")
    if "data" in results:
        d = results["data"]
        add("data: loader tokens/s, on the fly", d["tokens_per_s_on_the_fly"], "{:,.0f}")
        add("data: loader tokens/s, pre-tokenized", d["tokens_per_s_pretokenized"], "{:,.0f}")
        add("data: model consumes tokens/s", d["tokens_per_s_consumed"], "{:,.0f}")
        add("loader_vs_consumption (slowest loader / model)", d["loader_vs_consumption"], "{:,.1f}",
            "loader_vs_consumption")
        add("data: fraction of step time waiting for data", d["data_wait_fraction"], "{:.4f}")
    if "checkpoint" in results:
        c = results["checkpoint"]
        add("checkpoint: size (MB)", c["checkpoint_bytes"] / 1e6, "{:.1f}")
        for mode, m in c.get("modes", {c["async_mode"]: c}).items():
            add(f"checkpoint: sync save (s) [{mode} run]", m["sync_save_s"], "{:.3f}")
            add(f"checkpoint: async save blocks the loop (s) [{mode}]", m["async_blocking_s"], "{:.3f}")
            add(f"checkpoint: async, extra time of the next step (s) [{mode}]", m["async_first_step_extra_s"], "{:.3f}")
            add(f"checkpoint: async block / sync save [{mode}]", m["async_block_fraction"], "{:.3f}")
        add(f"async_block_fraction (best mode: {c['async_mode']})", c["async_block_fraction"], "{:.3f}",
            "async_block_fraction")
        add("checkpoint: sync save GB/s", c["sync_save_gb_per_s"], "{:.3f}")
        add("checkpoint: async save, call to written (s)", c["async_write_s"], "{:.3f}")
        add("checkpoint: async save GB/s (call to written)", c["async_save_gb_per_s"], "{:.3f}")
        add("checkpoint: load GB/s", c["load_gb_per_s"], "{:.3f}")
        add("checkpoint: step time / during async write (s)",
            f"{c['step_time_s']:.3f} / {c['step_time_during_async_write_s']:.3f}")
    if "gpu" in results:
        g = results["gpu"]
        if "skipped" in g:
            add("gpu", f"skipped ({g['skipped']})")
        else:
            for case in g["cases"]:
                rows.append((f"gpu: {case['flavor']} {case['variant']}", _gpu_row(case).strip(), ""))
    width = max((len(r[0]) for r in rows), default=10)
    vwidth = max((len(r[1]) for r in rows), default=10)
    return "\n".join(f"{n:<{width}}  {v:>{vwidth}}  {t}".rstrip() for n, v, t in rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_gpu_case"]:  # internal: one GPU case in a fresh process
        from trainer import logs

        logs.setup()
        try:
            result = gpu_case(json.loads(argv[1]))
        except torch.OutOfMemoryError as e:
            result = {"error": f"out of memory: {str(e).splitlines()[0]}", "oom": True}
        print(json.dumps(result), flush=True)
        return 0
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
    parser.add_argument("--checkpoint-repeats", type=int, default=5)
    parser.add_argument("--flavors", default=None, help=f"gpu: comma-separated (default {','.join(GPU_FLAVORS)})")
    parser.add_argument("--variants", default=None, help=f"gpu: comma-separated (default {','.join(GPU_VARIANTS)})")
    parser.add_argument("--seq-len", type=int, default=4096, help="gpu: sequence length (debugmodel: at most 2048)")
    parser.add_argument("--max-local-batch", type=int, default=8, help="gpu: largest local batch tried")
    parser.add_argument("--case-timeout", type=float, default=900, help="gpu: seconds per case")
    args, overrides = parser.parse_known_args(argv)
    if args.steps != "small" and not args.steps.isdigit():
        parser.error("--steps takes a number or 'small'")
    bad = [o for o in overrides if o.startswith("-") and "." not in o]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    from trainer import logs

    logs.setup()
    if args.threads:
        torch.set_num_threads(args.threads)
    suites = [s for s in SUITES if s != "gpu" or torch.cuda.is_available()] if args.suite == "all" else [args.suite]
    results: dict[str, Any] = {}
    report = {"command": "trainer bench " + " ".join(argv), "machine": machine_info(), "results": results,
              "targets": {k: f"{op} {b:g}" for k, (op, b) in TARGETS.items()}}
    funcs = {"overhead": bench_overhead, "data": bench_data, "checkpoint": bench_checkpoint, "gpu": bench_gpu}
    try:
        with tempfile.TemporaryDirectory(prefix="trainer_bench_") as workdir:
            for suite in suites:
                t0 = time.perf_counter()
                results[suite] = funcs[suite](args, overrides, workdir)
                results[suite]["seconds"] = time.perf_counter() - t0
                if args.json:  # partial results survive a later failure
                    Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    with contextlib.suppress(OSError):
        report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
