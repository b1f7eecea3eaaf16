"""``[eval]``: lm-eval tasks scored on the live model during training.

Every ``eval.freq`` steps (on the log step, after the optimizer update, so the scores are those of that
step's checkpoint), every rank runs the same lm-eval requests through its own copy of the model as it is:
under FSDP the sharded model's forward gathers each layer's parameters as in training, so nothing is
gathered to one rank and nothing is converted. Ranks get identical scores; the logging rank writes them.
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
        model = run.model_parts[0]
        was_training = model.training
        t0 = time.perf_counter()
        model.eval()
        try:
            lm = NativeLM(model=model, tokenizer=run.tokenizer, batch_size=cfg.batch_size,
                          add_bos_token=run_separator(run.config, run.tokenizer).add_bos)
            limit = None if cfg.limit is None else (int(cfg.limit) if cfg.limit >= 1 else cfg.limit)
            with _kept_random_state(), _every_rank_reports(), torch.no_grad():
                results = evaluate(lm, list(cfg.tasks), include_path=cfg.include_path or None, limit=limit,
                                   num_fewshot=cfg.num_fewshot, batch_size=cfg.batch_size, seed=cfg.seed,
                                   bootstrap_iters=cfg.bootstrap_iters)
        finally:
            model.train(was_training)
        seconds = time.perf_counter() - t0
        out: dict[str, Any] = flatten_results(results)
        out["eval_time_s"] = round(seconds, 3)
        logger.info("eval at step %d: %d task(s) in %.1f s (max_length %d)", step, len(cfg.tasks), seconds,
                    lm.max_length)
        return out
