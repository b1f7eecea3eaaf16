"""LR schedule values at the boundaries and weight-decay grouping."""

import math

import pytest
import torch

from trainer.config import LRScheduler, Optimizer
from trainer.optim import LRSchedule, build_optimizer


def sched(**kw):
    return LRSchedule(LRScheduler(**kw), base_lr=1.0, total_steps=100)


def test_warmup_is_linear_and_never_zero():
    s = sched(warmup_steps=10)
    assert s.lr(1) == pytest.approx(0.1)
    assert s.lr(5) == pytest.approx(0.5)
    assert s.lr(10) == pytest.approx(1.0)


@pytest.mark.parametrize("kind, mid", [("linear", 0.55), ("cosine", 0.55), ("sqrt", 1 - math.sqrt(0.5) * 0.9)])
def test_decay_shapes_reach_min_lr(kind, mid):
    s = sched(warmup_steps=10, decay_type=kind, min_lr_factor=0.1)
    assert s.lr(10) == pytest.approx(1.0)
    assert s.lr(100) == pytest.approx(0.1)
    assert s.lr(55) == pytest.approx(mid)


def test_constant_and_wsd():
    assert sched(warmup_steps=0, decay_type="constant").lr(80) == 1.0
    s = sched(warmup_steps=10, decay_ratio=0.2, decay_type="linear", min_lr_factor=0.0)
    assert s.lr(80) == pytest.approx(1.0)  # stable phase ends at step 80
    assert s.lr(90) == pytest.approx(0.5)
    assert s.lr(100) == pytest.approx(0.0)


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
