"""``trainer bench overhead``: the trainer's step against a bare PyTorch loop of the same model and batches."""

from __future__ import annotations

import itertools
import statistics
from typing import Any, Callable

import torch

from .common import SMALL, BareLoop, _quiet, _timed_cycles, build_trainer, close_trainer, load_bench_config, observed, \
    trainer_steps


def bench_overhead(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    """In one process (the trainer, the bare loop and the trainer fed from memory, step by step in turn),
    then, unless ``--processes 0``, the trainer and the bare loop each in a process of its own."""
    result = overhead_in_process(args, overrides, workdir)
    if args.processes > 0:
        from .processes import bench_overhead_processes

        result["processes"] = bench_overhead_processes(args, overrides, workdir)
    return result


def overhead_in_process(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    small = args.steps == "small"
    extra = list(SMALL) if small else []
    config = load_bench_config(args, overrides, extra, f"{workdir}/overhead")
    block = config.metrics.log_freq
    rounds = 2 if small else max(2, int(args.steps) // block)  # cycles of log_freq steps
    warmup = 1 if small else 2
    total = warmup + rounds * block
    chunk = block if torch.cuda.is_available() else 1
    config.training.steps = 10 * total + 10  # the schedule's horizon; never reached

    trainer = build_trainer(config)
    from trainer.data.loader import build_train_loader

    # The bare loop's data: the very batches the trainer's loader yields, drawn into memory up front.
    loader = build_train_loader(config, trainer.tokenizer, dp_rank=0, dp_world_size=1)
    n_batches = min(total * trainer.accum_steps, 64)
    batches = [next(loader) for _ in range(n_batches)]
    loader.close()
    bare = BareLoop.from_trainer(trainer, batches, config.training.steps)  # the trainer's initial weights

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
