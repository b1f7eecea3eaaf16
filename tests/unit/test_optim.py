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


def _debug_shaped_model():
    from trainer.models.llama.args import LlamaModelArgs
    from trainer.models.llama.model import Transformer

    torch.manual_seed(0)
    model = Transformer(LlamaModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16))
    model.init_weights()
    return model


@pytest.mark.parametrize("implementation", ["fused", "for-loop"])
def test_weight_decay_norms_and_biases_is_torchtitans_optimizer_bitwise(implementation):
    """optimizer.weight_decay_norms_and_biases: every parameter decays, as in torchtitan's build_optimizers
    (one AdamW over all parameters with the config's weight_decay): the weights after a few steps equal that
    optimizer's bit for bit. Without the key the norms keep their scale."""
    cfg = dict(lr=3e-3, weight_decay=0.1, implementation=implementation)
    ours, theirs, default = _debug_shaped_model(), _debug_shaped_model(), _debug_shaped_model()
    opt = build_optimizer(list(ours.named_parameters()), Optimizer(**cfg, weight_decay_norms_and_biases=True))
    reference = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=3e-3, betas=(0.9, 0.95),
                                  eps=1e-8, weight_decay=0.1, **({"fused": True} if implementation == "fused"
                                                                  else {"foreach": False}))
    plain = build_optimizer(list(default.named_parameters()), Optimizer(**cfg))
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, optimizer in ((ours, opt), (theirs, reference), (default, plain)):
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.1]
    assert [g["weight_decay"] for g in plain.param_groups] == [0.1, 0.0]
    assert not torch.equal(ours.norm.weight, default.norm.weight)  # the key changes what the norms do


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_a_skipped_step_changes_nothing_and_a_taken_one_is_adamws(implementation):
    """step_or_skip(verdict): a true verdict leaves weights, moments and AdamW's step count as they were; a
    false one (or none) is torch's AdamW step bit for bit. Only the fused kernel applies the verdict on the
    device."""
    ours, theirs = _debug_shaped_model(), _debug_shaped_model()
    opt = build_optimizer(list(ours.named_parameters()), Optimizer(lr=3e-3, implementation=implementation))
    flag = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[implementation]
    reference = torch.optim.AdamW([{"params": [p for p in theirs.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in theirs.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=3e-3, betas=(0.9, 0.95), eps=1e-8, **flag)
    assert opt.skips_on_device == (implementation == "fused")
    hooks = []
    opt.register_step_pre_hook(lambda *_: hooks.append("pre"))  # what the checkpoint manager relies on
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    verdicts = [None, torch.tensor(False), torch.tensor(True), torch.tensor(False), torch.tensor(True)]
    for verdict in verdicts:
        for model in (ours, theirs):
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        before = {k: v.clone() for k, v in ours.state_dict().items()}
        state_before = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
        opt.step_or_skip(verdict)
        if verdict is not None and bool(verdict):
            assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items())
            assert all(torch.equal(a[k], b[k]) for a, b in zip(state_before, opt.state.values()) for k in a)
        else:
            reference.step()
        opt.zero_grad()
        reference.zero_grad()
    assert not hasattr(opt, "found_inf")  # the verdict does not outlive its step
    # Once per step() call: the fused kernel is called (and skips) on every verdict, the others only to step.
    assert len(hooks) == (5 if implementation == "fused" else 3)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    assert [s["step"].item() for s in opt.state.values()] == [3.0] * len(opt.state)
