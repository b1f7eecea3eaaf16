"""The restart recipe of docs/stability.md: resume before a spike, skip the steps after the checkpoint and
re-warm the learning rate. The re-warm belongs to the first steps actually trained, after the skipped range,
and the build from the config wires the skip ranges into it (the recipe's own flags)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from torchtitan_ext.config import ExtJobConfig
from torchtitan_ext.stability.callbacks import build_stability_callbacks
from torchtitan_ext.stability.rewarmup import LRRewarmup
from trainer.optim.config import LRScheduler
from trainer.optim.optimizer import LRSchedule


def schedule() -> LRSchedule:
    return LRSchedule(LRScheduler(warmup_steps=2000, decay_type="linear", min_lr_factor=0.1), 3e-4, 100_000)


def rewarmed(skip_steps: list[list[int]], resumed: int, steps: int) -> LRSchedule:
    config = ExtJobConfig()
    config.stability.skip_steps = skip_steps
    config.stability.lr_rewarmup_steps_after_load = steps
    (cb,) = [c for c in build_stability_callbacks(config) if isinstance(c, LRRewarmup)]
    s = schedule()
    cb.on_checkpoint_loaded(SimpleNamespace(lr_schedule=s), resumed)
    return s


def test_rewarm_starts_at_the_first_trained_step_after_a_skipped_range():
    s, plain = rewarmed([[41001, 41400]], 41000, 200), schedule()
    assert s.lr(41401) == pytest.approx(plain.lr(41401) / 200)  # the first trained step: 1/200 of the LR
    assert s.lr(41500) == pytest.approx(plain.lr(41500) * 100 / 200)
    assert s.lr(41600) == pytest.approx(plain.lr(41600))
    assert all(s.lr(step) == 0.0 for step in (41001, 41200, 41400))  # skipped: no update, and no negative LR


def test_rewarm_right_after_the_checkpoint_without_a_skip_there():
    s, plain = rewarmed([[10, 20]], 500, 100), schedule()  # a range before the checkpoint changes nothing
    assert s.lr(501) == pytest.approx(plain.lr(501) / 100)
    assert s.lr(600) == pytest.approx(plain.lr(600))


def test_adjacent_ranges_are_skipped_together():
    cb = LRRewarmup(10, [[101, 150], [151, 160], [200, 210]])
    assert cb.first_trained_step(100) == 161
    assert cb.first_trained_step(199) == 211
    assert cb.first_trained_step(170) == 171
