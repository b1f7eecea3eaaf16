"""Throughput of the training loader: tokenizing on the fly versus reading prepared token files.

    from trainer.data.bench import measure_throughput
    measure_throughput(load_config([...]))   # {"tokens_per_s_on_the_fly": ..., "tokens_per_s_pretokenized": ...}
"""

from __future__ import annotations

import tempfile
import time

from trainer.data.loader import TrainLoader, batch_geometry, build_plan, build_train_loader
from trainer.data.prepare import prepare
from trainer.data.sources import SourceSpec, training_specs


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
