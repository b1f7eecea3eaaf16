"""``[eval]``: lm-eval tasks scored on the live model during training.

Every ``eval.freq`` steps (on the log step, after the optimizer update, so the scores are those of that
step's checkpoint), lm-eval builds the same requests on every rank and the data-parallel ranks split them:
each scores its share of the batches through the model as it is (FSDP/HSDP gather each layer as in
training, tensor parallel gathers the vocabulary-sharded logits, pipeline stages run the schedule's
forward-only path), and the answers are gathered back in lm-eval's order (lm.py, ``EvalLayout``). Nothing
is converted or exported; every rank gets the scores one process would; the logging rank writes them.
The random state of the training (python, numpy, torch) is saved before and restored after, and the model
goes back to train mode.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from typing import TYPE_CHECKING, Any

import torch

from trainer.callbacks import Callback

if TYPE_CHECKING:
    from torchtitan_ext.config import ExtJobConfig
    from torchtitan_ext.evaluation.lm import EvalLayout

logger = logging.getLogger("trainer")


def build_eval_callbacks(config: ExtJobConfig) -> list[Callback]:
    return [LMEvalCallback(config.eval)] if config.eval.freq > 0 else []


@contextlib.contextmanager
def _kept_random_state():
    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def _every_rank_reports():
    """lm-eval returns results only where LOCAL_RANK is 0; here every rank scores the same requests."""
    old = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = old


def flatten_results(results: dict | None) -> dict[str, float]:
    """lm-eval results -> {"eval/<task>/<metric>": value}; the filter suffix ",none" is dropped, other
    filters stay as "<metric>_<filter>"; standard errors are left out."""
    out: dict[str, float] = {}
    for task, metrics in (results or {}).get("results", {}).items():
        for key, value in metrics.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or "stderr" in key:
                continue
            if key == "sample_len":
                continue
            metric, _, flt = key.partition(",")
            out[f"eval/{task}/{metric if flt in ('', 'none') else f'{metric}_{flt}'}"] = float(value)
    return out


def eval_layout(run) -> EvalLayout:
    """How this rank takes part in the in-training evaluation: its share of the requests by data-parallel
    rank, the forward in lockstep with the other ranks (the model is sharded), widths padded for sequence
    parallel, and the training's pipeline schedule when the model is split into stages."""
    import torch.distributed as dist

    from torchtitan_ext.evaluation.lm import EvalLayout, PipelineEval

    dims = run.dims
    pipeline = None
    if run.pp_schedule is not None:
        t = run.config.training
        pipeline = PipelineEval(run.pp_schedule, has_first=run.pp_has_first, has_last=run.pp_has_last,
                                pp_group=run.pp_group, rows=t.local_batch_size, width=t.seq_len)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    return EvalLayout(dp_rank=run.dp_rank, dp_size=dims.dp, group=dist.group.WORLD if distributed else None,
                      lockstep=distributed, pad_multiple=dims.tp, pipeline=pipeline)


class LMEvalCallback(Callback):
    name = "eval"

    def __init__(self, cfg):
        self.cfg = cfg

    def metrics(self, run, step: int) -> dict[str, Any]:
        if step % self.cfg.freq:
            return {}
        from tokenizer.policy import run_separator
        from torchtitan_ext.evaluation.lm import NativeLM, evaluate

        cfg = self.cfg
        parts = run.model_parts
        was_training = [part.training for part in parts]
        t0 = time.perf_counter()
        # Requests are short and of any length: context parallelism is set aside for them; the CP ranks of a
        # data-parallel rank answer the same requests whole, in lockstep with the others (the model stays
        # sharded over them), as tensor-parallel ranks do.
        split = [part.__dict__.pop("context_parallel", None) for part in parts]
        for part in parts:
            part.eval()
        try:
            lm = NativeLM(model=parts[0], tokenizer=run.tokenizer, batch_size=cfg.batch_size,
                          add_bos_token=run_separator(run.config, run.tokenizer).add_bos, layout=eval_layout(run))
            limit = None if cfg.limit is None else (int(cfg.limit) if cfg.limit >= 1 else cfg.limit)
            with _kept_random_state(), _every_rank_reports(), torch.no_grad():
                results = evaluate(lm, list(cfg.tasks), include_path=cfg.include_path or None, limit=limit,
                                   num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size, seed=cfg.seed,
                                   bootstrap_iters=cfg.bootstrap_iters, environment=False)
        finally:
            for part, mode, cp in zip(parts, was_training, split):
                part.train(mode)
                if cp is not None:
                    part.context_parallel = cp
        seconds = time.perf_counter() - t0
        out: dict[str, Any] = flatten_results(results)
        out["eval_time_s"] = round(seconds, 3)
        logger.info("eval at step %d: %d task(s) in %.1f s (max_length %d)", step, len(cfg.tasks), seconds,
                    lm.max_length)
        return out
