"""What the parity tests (tests/distributed/test_parallel.py, test_pipeline.py) share: five deterministic
steps of the debug model on a global batch of 8 sequences, and the single-process reference run."""

from __future__ import annotations

from tests.support.batches import spec
from tests.support.launch import ROOT

STEPS = ["--training.steps", "5", "--debug.deterministic", "--training.global_batch_size", "8"]

SINGLE = spec("single", 1, *STEPS, "--training.local_batch_size", "8")

# In-training evaluation at step 4 with that step's checkpoint (tests/distributed/test_eval.py), added to
# some of the parity runs: the step-5 loss, compared with SINGLE (no evaluation), shows the training after
# an evaluation goes on as without it.
EVAL_TASKS = ROOT / "tests" / "assets" / "lm_eval_tasks"
IN_TRAINING_EVAL = ["--eval.freq", "4", "--eval.tasks", "tiny_mc,tiny_ppl,tiny_gen", "--eval.include_path",
                    str(EVAL_TASKS), "--eval.limit", "6", "--checkpoint.enable", "--checkpoint.interval", "4"]


def relative_diffs(a: dict[int, float], b: dict[int, float]) -> list[float]:
    assert a.keys() == b.keys() and len(a) == 5, (a, b)
    return [abs(a[s] - b[s]) / abs(b[s]) for s in a]
