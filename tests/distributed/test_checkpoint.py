"""Resharding: a checkpoint saved by FSDP 4 is resumed by other layouts (real processes over gloo, one
torchrun start per world size). The runs use the settings of tests/e2e/test_checkpoint.py: a global batch
of 4 sequences of 64 tokens and a constant learning rate after warmup, so a run continued from step 10
follows the straight run's schedule."""

from __future__ import annotations

import pytest

from tests.support.batches import spec

STEPS = 20
COMMON = ["--lr_scheduler.decay_type", "constant", "--checkpoint.interval", "5"]
CKPT = ["--checkpoint.enable"]


def batch(nproc: int) -> list[str]:
    return ["--training.local_batch_size", str(4 // nproc)]


def assert_same(ref: dict[int, dict], got: dict[int, dict], steps, rel: float) -> None:
    for s in steps:
        a, b = ref[s], got[s]
        assert b["data_fingerprint"] == a["data_fingerprint"], f"step {s}: different data"
        assert b["lr"] == a["lr"], f"step {s}: lr {b['lr']} != {a['lr']}"
        assert abs(b["loss"] - a["loss"]) <= rel * abs(a["loss"]), f"step {s}: loss {b['loss']} vs {a['loss']}"


STRAIGHT = spec("ckpt_straight", 1, *COMMON, *batch(1), "--training.steps", str(STEPS))
SOURCE = spec("ckpt_fsdp4", 4, *COMMON, *CKPT, *batch(4), "--training.steps", "10",
              "--checkpoint.last_save_model_only", "false")
STEP10 = f"{{root}}/{SOURCE}/checkpoint/step-10"
RESUMED = {
    "fsdp2": (2, [*batch(2), "--checkpoint.async_mode", "async", "--checkpoint.drill_fail_save_steps", "15",
                  "--checkpoint.max_failed_saves", "2"]),
    "hsdp": (4, [*batch(4), "--parallelism.data_parallel_replicate_degree", "2",
                 "--checkpoint.initial_load_path", STEP10, "--checkpoint.initial_load_model_only", "false"]),
    "tp2": (2, [*batch(1), "--parallelism.tensor_parallel_degree", "2"]),
    "single": (1, batch(1)),
}
for _name, (_nproc, _extra) in RESUMED.items():
    _copy = () if "--checkpoint.initial_load_path" in _extra else ((STEP10, f"{{root}}/ckpt_to_{_name}/checkpoint/step-10"),)
    spec(f"ckpt_to_{_name}", _nproc, *COMMON, *CKPT, *_extra, "--training.steps", str(STEPS), after=(SOURCE,), copy=_copy)


@pytest.mark.slow
@pytest.mark.runs(STRAIGHT, SOURCE, *(f"ckpt_to_{n}" for n in RESUMED))
def test_reshard(batches):
    """Saved by FSDP 4, resumed by FSDP 2 (asynchronous saves, one failing on purpose), HSDP 2x2 (via
    initial_load_path with the full state), TP 2 and one process: every run continues with the straight
    run's data and losses (relative 1e-5)."""
    straight = batches.get(STRAIGHT).records()
    assert_same(straight, batches.get(SOURCE).records(), range(1, 11), rel=1e-5)
    runs = {name: batches.get(f"ckpt_to_{name}") for name in RESUMED}
    for name, run in runs.items():
        got = run.records()
        assert sorted(got) == list(range(11, STEPS + 1)), name
        assert_same(straight, got, range(11, STEPS + 1), rel=1e-5)
    fsdp2 = runs["fsdp2"].log
    assert "checkpoint step-15 FAILED" in fsdp2 and "injected write failure" in fsdp2
    assert runs["fsdp2"].records()[STEPS]["checkpoint_failures"] == 1
    assert "step-10 loaded" in runs["hsdp"].log
