"""Fault drills (``[stability] inject_bad_data_steps``, ``inject_nonfinite_loss_steps``): show the guards
working on a real run."""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainer.callbacks import Callback

logger = logging.getLogger("trainer")


def random_tokens_like(batch: dict[str, torch.Tensor], vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """The batch with ``input``/``labels`` replaced by uniformly random tokens, as one shifted sequence per
    row (``labels[:, :-1] == input[:, 1:]``); other keys are kept. Deterministic in ``seed``."""
    inputs, labels = batch["input"], batch["labels"]
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab_size, (inputs.shape[0], inputs.shape[1] + 1), generator=g, dtype=torch.int64)
    out = dict(batch)
    out["input"] = seq[:, :-1].to(inputs.dtype).to(inputs.device)
    out["labels"] = seq[:, 1:].to(labels.dtype).to(labels.device)
    return out


def drill_seed(seed: int, step: int, dp_rank: int, micro_batch: int) -> int:
    return (seed * 1_000_003 + step * 65_537 + dp_rank * 257 + micro_batch) % 2**63


class FaultInjection(Callback):
    """Bad data: the step's micro-batches become random tokens (generator seeded by seed, step, data-parallel
    rank and micro-batch). Non-finite loss: every micro-batch's loss is multiplied by NaN, so the loss and
    all gradients are NaN, as after an overflow."""

    name = "fault_injection"

    def __init__(self, bad_data_steps: list[int], nonfinite_loss_steps: list[int]):
        self.bad_data_steps = set(bad_data_steps)
        self.nonfinite_steps = set(nonfinite_loss_steps)
        self._nonfinite_now = False

    @property
    def enabled(self) -> bool:
        return bool(self.bad_data_steps or self.nonfinite_steps)

    def on_batches(self, run, step: int, batches: list[dict]) -> list[dict]:
        self._nonfinite_now = step in self.nonfinite_steps
        if self._nonfinite_now:
            logger.warning("fault drill: forcing a non-finite loss at step %d", step)
        if step not in self.bad_data_steps:
            return batches
        logger.warning("fault drill: replacing the batch of step %d with random tokens", step)
        vocab = min(run.model_args.vocab_size, run.tokenizer.vocab_size)
        return [random_tokens_like(b, vocab, drill_seed(run.seed, step, run.dp_rank, i)) for i, b in enumerate(batches)]

    def extra_loss(self, run, logits: torch.Tensor, loss: torch.Tensor, tokens: int) -> torch.Tensor:
        return loss * float("nan") if self._nonfinite_now else loss

    def metrics(self, run, step: int) -> dict[str, Any]:
        out = {}
        if step in self.bad_data_steps:
            out["injected_bad_data"] = True
        if step in self.nonfinite_steps:
            out["injected_nonfinite_loss"] = True
        return out
