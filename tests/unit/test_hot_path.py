"""The hot path: nothing on the training thread waits for the device between log steps (no tensor is read on
the host), and the logits do not outlive the loss.

The real loop runs in this process (world size 1, gloo) with the default config, then with every stability
guard on. Around each step that is not a log step, a dispatch mode counts ``aten._local_scalar_dense``
(what ``.item()``, ``float()``, ``bool()`` and ``int()`` of a tensor run) and a wrapper counts ``.tolist()``
of float or bool tensors. The data loader's own thread is not counted: its work overlaps the step.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.launch import read_metrics, train_in_process

GUARDS = ["--stability.spike_guard", "--stability.spike_window", "4", "--stability.spike_min_history", "2",
          "--stability.embedding_grad_shrink", "--training.z_loss_weight", "1e-4", "--stability.skip_steps", "3-3",
          "--debug.inject_nonfinite_loss_steps", "6"]
STEPS, LOG_FREQ = 9, 4  # log steps 4, 8 and the last
# float16's loss scaling with an overflow at quiet step 6 (a one-block model: CPUs have few float16 kernels).
FLOAT16 = ["--training.mixed_precision_param", "float16", "--debug.overflow_at_steps", "6", "--model.n_layers", "1",
           "--training.seq_len", "32", "--training.local_batch_size", "2"]


def train(dump, *args: str, monkeypatch) -> tuple[int, str]:
    """The real loop in this process, with checkpoints and a constant learning rate after warmup."""
    return train_in_process(dump, "--lr_scheduler.decay_type", "constant", "--checkpoint.enable", *args,
                            monkeypatch=monkeypatch)


class HostReads(TorchDispatchMode):
    """Counts scalar reads of tensors made on this thread while active."""

    def __init__(self):
        super().__init__()
        self.scalar_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalar_reads += 1
        return func(*args, **(kwargs or {}))


def count_reads(monkeypatch, dump, *args: str) -> dict[int, int]:
    """Host reads per step, and the steps that were logged (metrics.jsonl)."""
    from trainer.train import Trainer

    reads: dict[int, int] = {}
    tolist_calls = [0]
    main_thread = threading.get_ident()
    original_tolist = torch.Tensor.tolist

    def counting_tolist(self):
        if threading.get_ident() == main_thread and (self.dtype.is_floating_point or self.dtype == torch.bool):
            tolist_calls[0] += 1
        return original_tolist(self)

    original_run_step = Trainer.run_step

    def run_step(self, step, obs):
        before = tolist_calls[0]
        with HostReads() as mode:
            out = original_run_step(self, step, obs)
        reads[step] = mode.scalar_reads + tolist_calls[0] - before
        return out

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(Trainer, "run_step", run_step)
    rc, log = train(dump, "--training.steps", str(STEPS), "--metrics.log_freq", str(LOG_FREQ),
                    "--checkpoint.enable", "false", *args, monkeypatch=monkeypatch)
    assert rc == 0, log
    return reads, {r["step"] for r in read_metrics(dump)}


@pytest.mark.parametrize("guards,logged", [([], {1, 4, 8, 9}), (GUARDS, {1, 3, 4, 8, 9}), (FLOAT16, {1, 4, 8, 9})],
                         ids=["default", "every_guard", "float16"])
def test_no_host_reads_between_log_steps(tmp_path, monkeypatch, guards, logged):
    """(Step 1 is always logged; a step skipped by stability.skip_steps is known on the host and always logged:
    step 3.)"""
    reads, log_steps = count_reads(monkeypatch, tmp_path, *guards)
    assert log_steps == logged and sorted(reads) == list(range(1, STEPS + 1))
    assert all(reads[s] > 0 for s in log_steps), reads  # the counting sees reads where there are some
    quiet = {s: n for s, n in reads.items() if s not in log_steps}
    assert quiet == dict.fromkeys(quiet, 0), quiet
    record = {r["step"]: r for r in read_metrics(tmp_path)}[8]
    if guards is FLOAT16:  # the overflow at quiet step 6 was skipped on the device and reported at step 8
        assert record["overflow_skipped"] == 1 and record["skipped_steps"] == 1, record
    elif guards:  # the NaN at quiet step 6 was skipped on the device and reported at the next log step
        guard_skips = record["skipped_nonfinite_steps"] + record["skipped_spike_steps"]
        assert record["skipped_nonfinite_steps"] == 1 and record["skipped_steps"] == 1 + guard_skips, record


def test_logits_are_freed_before_backward(tmp_path, monkeypatch):
    """The largest activation (vocabulary x tokens) is not kept alive through backward by the loop."""
    import weakref

    from trainer import step

    original = step.loss_fn
    alive_at_backward = []

    def loss_fn(logits, labels):
        ref = weakref.ref(logits)
        loss = original(logits, labels)
        loss.register_hook(lambda grad: alive_at_backward.append(ref() is not None))  # runs as backward starts
        return loss

    monkeypatch.setattr(step, "loss_fn", loss_fn)
    rc, log = train(tmp_path, "--training.steps", "2", "--checkpoint.enable", "false", monkeypatch=monkeypatch)
    assert rc == 0, log
    assert alive_at_backward == [False, False]
