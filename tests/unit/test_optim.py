"""LR schedule values at the boundaries and weight-decay grouping."""

import math

import pytest
import torch

from trainer.optim.config import LRScheduler, Optimizer
from trainer.optim.optimizer import LRSchedule, build_optimizer


def sched(**kw):
    return LRSchedule(LRScheduler(**kw), base_lr=1.0, total_steps=100)


def test_warmup_is_linear_and_never_zero():
    s = sched(warmup_steps=10)
    assert s.lr(1) == pytest.approx(0.1)
    assert s.lr(5) == pytest.approx(0.5)
    assert s.lr(10) == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["linear", "cosine", "sqrt"])
def test_decay_shapes_end_just_above_min_lr(kind):
    # torchtitan's schedule: one stable step after warmup, then 90 decay steps of which the run takes 89
    # (a virtual last step keeps the final lr above the minimum).
    s = sched(warmup_steps=10, decay_type=kind, min_lr_factor=0.1)
    assert s.lr(10) == s.lr(11) == 1.0
    assert 0.1 < s.lr(100) < s.lr(99) < 1.0
    shape = {"linear": lambda p: 1 - p, "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
             "sqrt": lambda p: 1 - math.sqrt(p)}[kind]
    assert s.lr(56) == pytest.approx(0.1 + 0.9 * shape(0.5))


def test_constant_and_wsd():
    assert sched(warmup_steps=0, decay_type="constant").lr(80) == 1.0
    s = sched(warmup_steps=10, decay_ratio=0.2, decay_type="linear", min_lr_factor=0.0)
    assert s.lr(81) == pytest.approx(1.0)  # stable until step 81, then 20 decay steps
    assert s.lr(91) == pytest.approx(0.5)
    assert s.lr(100) == pytest.approx(0.05)


def test_rewarmup_after_load():
    s = sched(warmup_steps=10, decay_type="constant")
    s.rewarmup_from, s.rewarmup_steps = 50, 10
    assert s.lr(51) == pytest.approx(0.1)
    assert s.lr(60) == pytest.approx(1.0)


def test_weight_decay_only_on_matrices():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 4, bias=False))
    opt = build_optimizer(list(model.named_parameters()), Optimizer(implementation="for-loop", weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert {p.ndim for p in decay["params"]} == {2} and decay["weight_decay"] == 0.1
    assert {p.ndim for p in no_decay["params"]} == {1} and no_decay["weight_decay"] == 0.0
