"""The [eval] config section: lm-eval tasks scored on the live model during training.

Every field has a string under it: that string is the user documentation (``--help`` and docs/config.md
are generated from it). See docs/export_eval.md, "Evaluation during training".
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from trainer.errors import ConfigError


@dataclass
class Eval:
    freq: int = 0
    """Score the lm-eval tasks every this many steps, on the model being trained as it is sharded (the
    data-parallel ranks split the requests; FSDP, HSDP, tensor and pipeline parallel; no conversion); 0:
    never. A multiple of metrics.log_freq, so the scores land on a logged step."""
    tasks: list[str] = field(default_factory=list)
    """lm-eval task or group names, e.g. ["hellaswag", "arc_easy"]; on the command line hellaswag,arc_easy.
    Their scores go to metrics.jsonl and TensorBoard as eval/<task>/<metric>, and to the console line."""
    limit: float | None = None
    """Examples per task (a fraction of the task if < 1); None: all of them."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt; None: the task's default."""
    include_path: str = ""
    """A folder of extra task YAMLs (local tasks); relative data_files in them are read from this folder."""
    batch_size: int = 8
    """Requests per forward pass (each data-parallel rank runs every dp-th batch; under pipeline parallel
    at most training.local_batch_size, the schedule's batch). Requests longer than training.seq_len (the
    model's RoPE table) are cut from the left, as lm-eval does at its max_length."""
    bootstrap_iters: int = 0
    """Bootstrap resamples for the standard errors of metrics without a closed form (lm-eval's default is
    100000, seconds per task); 0: those standard errors are not computed."""
    seed: int = 1234
    """lm-eval's seeds (python, numpy, torch, few-shot sampling) for the evaluation; the training's random
    state is saved before and restored after."""


def check_config(config, world_size: int | None = None) -> None:
    """The [eval] rules (registered with the core's config validation)."""
    e = config.eval
    if e.freq < 0:
        raise ConfigError(f"eval.freq must be >= 0 (0: off), got {e.freq}")
    if not e.freq:
        return
    if not e.tasks:
        raise ConfigError("eval.tasks is empty: name the lm-eval tasks to score every eval.freq steps, or set "
                          "eval.freq = 0")
    log_freq = config.metrics.log_freq
    if e.freq % log_freq:
        raise ConfigError(f"eval.freq = {e.freq} is not a multiple of metrics.log_freq = {log_freq}: the scores "
                          "are written on logged steps; choose a multiple")
    if e.limit is not None and e.limit <= 0:
        raise ConfigError(f"eval.limit must be > 0 (or unset for every example), got {e.limit}")
    if e.num_fewshot is not None and e.num_fewshot < 0:
        raise ConfigError(f"eval.num_fewshot must be >= 0, got {e.num_fewshot}")
    if e.batch_size < 1:
        raise ConfigError(f"eval.batch_size must be >= 1, got {e.batch_size}")
    if e.bootstrap_iters < 0:
        raise ConfigError(f"eval.bootstrap_iters must be >= 0, got {e.bootstrap_iters}")
    if e.include_path and not Path(e.include_path).is_dir():
        raise ConfigError(f"eval.include_path: {e.include_path} is not a folder of task YAMLs")
    p = config.parallelism
    if getattr(p, "context_parallel_degree", 1) > 1 and p.pipeline_parallel_degree > 1:
        raise ConfigError("eval.freq with context_parallel_degree > 1 and pipeline_parallel_degree > 1: the "
                          "pipeline schedule's stages are shaped for each rank's share of the sequence, which "
                          "evaluation requests do not have; evaluate the checkpoints with 'trainer eval' instead, "
                          "or set eval.freq = 0")
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("eval.freq needs lm-eval: pip install 'lm-eval[hf]>=0.4.5' (the [eval] extra)")
