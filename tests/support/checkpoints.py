"""What the checkpoint tests of every tier share (tests/distributed/test_checkpoint.py,
tests/e2e/test_checkpoint.py): the settings, the straight reference run and the comparison.

Every run uses the same global batch (4 sequences of 64 tokens: 1 process x 4, 2 x 2 or 4 x 1) and the
constant learning-rate schedule. The schedule matters for honesty: "10 steps, stop, then the same command
to 20" changes training.steps, and with a decaying schedule the first run's learning rates would come
from a 10-step curve, not the 20-step one of the straight run. With warmup then constant, the learning
rate at a step does not depend on training.steps, so both runs see exactly the straight run's schedule
(asserted via the logged lr).
"""

from __future__ import annotations

from tests.support.batches import spec

STEPS = 20
COMMON = ["--lr_scheduler.decay_type", "constant", "--checkpoint.interval", "5"]
CKPT = ["--checkpoint.enable"]


def batch(nproc: int) -> list[str]:
    return ["--training.local_batch_size", str(4 // nproc)]


# 20 steps in one process, no checkpoints: the reference.
STRAIGHT = spec("ckpt_straight", 1, *COMMON, *batch(1), "--training.steps", str(STEPS))


def assert_same(ref: dict[int, dict], got: dict[int, dict], steps, rel: float = 0.0) -> None:
    """The same data and learning rate at every step, and the same loss: bitwise, or within ``rel``."""
    for s in steps:
        a, b = ref[s], got[s]
        assert b["data_fingerprint"] == a["data_fingerprint"], f"step {s}: different data"
        assert b["lr"] == a["lr"], f"step {s}: lr {b['lr']} != {a['lr']}"
        if rel == 0.0:
            assert b["loss"] == a["loss"], f"step {s}: loss {b['loss']!r} != {a['loss']!r}"
        else:
            assert abs(b["loss"] - a["loss"]) <= rel * abs(a["loss"]), f"step {s}: loss {b['loss']} vs {a['loss']}"
