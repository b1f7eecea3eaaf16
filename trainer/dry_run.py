"""``job.dry_run``: validate the config and build the model on the meta device, allocating nothing, then print
what the run would be (flavor, parameters, FLOPs per token, layout, gradient accumulation) as one JSON line.

The model arguments come from :func:`model_args_for_plan`, which ``trainer plan``, ``trainer simulate`` and
``trainer bench`` use too: what the trainer would build, reading the tokenizer only where it is on this
machine (a layout can be checked anywhere).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from trainer.config import JobConfig
from trainer.models.config import resolve_model_args

logger = logging.getLogger("trainer")


def model_args_for_plan(config: JobConfig):
    """The model args the trainer would build, and a note when the tokenizer is not on this machine (then
    the vocabulary comes from the flavor or model.vocab_size, unchecked against the tokenizer)."""
    from trainer.data.tokenizer import load_tokenizer

    tokenizer_vocab = None
    note = None
    path = config.model.tokenizer_path
    if path == "" or Path(path).exists():
        tokenizer_vocab = load_tokenizer(config).vocab_size
    else:
        note = f"tokenizer {path} not found: vocabulary from the flavor/model.vocab_size"
    return resolve_model_args(config, tokenizer_vocab), note


def dry_run(config: JobConfig) -> None:
    """Build the model on the meta device without allocating it and print the run's shape as JSON."""
    import torch  # here: trainer plan imports this module for model_args_for_plan and stays light

    from trainer.data.checks import grad_accum_steps
    from trainer.models.llama.flops import flops_per_token, model_num_params
    from trainer.models.llama.model import Transformer
    from trainer.parallel.dims import ParallelDims

    args, note = model_args_for_plan(config)  # as trainer plan: the tokenizer only if it is on this machine
    if note:
        logger.warning(note)
    with torch.device("meta"):
        model = Transformer(args)
    dims = ParallelDims.from_config(config.parallelism, int(os.environ.get("WORLD_SIZE", 1)))
    print(json.dumps({
        "flavor": config.model.flavor, "params": model_num_params(model),
        "flops_per_token": flops_per_token(args, config.training.seq_len), "vocab_size": args.vocab_size,
        "layout": dims.describe(), "grad_accum_steps": grad_accum_steps(config, dims.dp), "status": "ok",
    }))
