"""``trainer bench data``: tokens/s the loader delivers against tokens/s the model consumes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .common import SMALL, _quiet, build_trainer, close_trainer, load_bench_config, observed, trainer_steps


def bench_data(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    from trainer.data.bench import measure_throughput

    small = args.steps == "small"
    extra = list(SMALL) if small else []
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
