"""What the parity tests (tests/distributed/test_parallel.py, test_pipeline.py) share: five deterministic
steps of the debug model on a global batch of 8 sequences, and the single-process reference run."""

from __future__ import annotations

from tests.support.batches import spec

STEPS = ["--training.steps", "5", "--debug.deterministic", "--training.global_batch_size", "8"]

SINGLE = spec("single", 1, *STEPS, "--training.local_batch_size", "8")


def relative_diffs(a: dict[int, float], b: dict[int, float]) -> list[float]:
    assert a.keys() == b.keys() and len(a) == 5, (a, b)
    return [abs(a[s] - b[s]) / abs(b[s]) for s in a]
