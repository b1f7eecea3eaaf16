"""``trainer bench data``: tokens/s the loader delivers against tokens/s the model consumes.

:func:`measure_throughput` is the loader's side alone (on the fly, then from prepared token files); it
also serves callers that want only that number:

    measure_throughput(load_config([...]))   # {"tokens_per_s_on_the_fly": ..., "tokens_per_s_pretokenized": ...}
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from trainer.data.loader import TrainLoader, batch_geometry, build_plan, build_train_loader
from trainer.data.prepare import prepare
from trainer.data.sources import SourceSpec, training_specs

from .common import SMALL, _quiet, build_trainer, close_trainer, load_bench_config, observed, trainer_steps


def bench_data(args, overrides: list[str], workdir: str) -> dict[str, Any]:
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


def _rate(loader: TrainLoader, seconds: float, max_batches: int | None) -> tuple[float, int]:
    next(loader)  # start-up (workers, first blocks) is not throughput
    tokens, batches = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds and (max_batches is None or batches < max_batches):
        batch = next(loader)
        tokens += batch["input"].numel()
        batches += 1
    elapsed = time.perf_counter() - start
    loader.close()
    return tokens / elapsed, tokens


def measure_throughput(config, tokenizer=None, *, seconds: float = 3.0, max_batches: int | None = None,
                       prepare_workers: int | None = None, workdir: str | None = None) -> dict:
    """Tokens per second one rank's loader delivers (input tokens of micro-batches), measured for about
    `seconds` each: on the fly from the config's sources, then from the same sources after
    ``prepare`` (prepared into `workdir` or a temporary folder; that time is reported separately).
    Uses the config's data.num_workers, batch size and seq_len, as a single rank."""
    if tokenizer is None:
        from tokenizer import DEBUG_TOKENIZER_PATH, build_tokenizer

        tokenizer = build_tokenizer(config.model.tokenizer_path or DEBUG_TOKENIZER_PATH)
    on_the_fly, _ = _rate(build_train_loader(config, tokenizer, dp_rank=0, dp_world_size=1), seconds, max_batches)

    specs, weights = training_specs(config)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        start = time.perf_counter()
        token_specs = []
        for i, spec in enumerate(specs):
            folder = f"{tmp}/source{i}"
            prepare(spec, folder, tokenizer, workers=prepare_workers, text_field=config.data.text_field,
                    text_document=config.data.text_document, progress=False)
            token_specs.append(SourceSpec("tokens", folder, spec.key, f"tokens:{spec.label}"))
        prepare_seconds = time.perf_counter() - start
        d = config.data
        b, g, _ = batch_geometry(config, 1)
        plan = build_plan(config, tokenizer, token_specs, weights, num_shards=d.num_shards, shuffle=d.shuffle,
                          max_epochs=None)
        loader = TrainLoader(plan, dp_rank=0, dp_world_size=1, local_batch_size=b, global_batch_size=g,
                             num_workers=d.num_workers, prefetch_factor=d.prefetch_factor)
        pretokenized, _ = _rate(loader, seconds, max_batches)
    return {
        "tokens_per_s_on_the_fly": on_the_fly,
        "tokens_per_s_pretokenized": pretokenized,
        "prepare_seconds": prepare_seconds,
        "num_workers": config.data.num_workers,
        "seq_len": config.training.seq_len,
        "local_batch_size": b,
    }
