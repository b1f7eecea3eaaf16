"""What the parity tests (tests/distributed/test_parallel.py, test_pipeline.py) share: five deterministic
steps of the debug model on a global batch of 8 sequences, the single-process reference run, and the runs of
each parallel layout and pipeline schedule (declared here because tests/distributed/test_eval.py reads
some of them too, and test modules do not import each other)."""

from __future__ import annotations

from tests.support.batches import spec
from tests.support.launch import ROOT
from trainer.parallel.config import SCHEDULES, SINGLE_STAGE

STEPS = ["--training.steps", "5", "--debug.deterministic", "--training.global_batch_size", "8"]

SINGLE = spec("single", 1, *STEPS, "--training.local_batch_size", "8")

# In-training evaluation at step 4 with that step's checkpoint (tests/distributed/test_eval.py), added to
# some of the parity runs: the step-5 loss, compared with SINGLE (no evaluation), shows the training after
# an evaluation goes on as without it.
EVAL_TASKS = ROOT / "tests" / "assets" / "lm_eval_tasks"
IN_TRAINING_EVAL = ["--eval.freq", "4", "--eval.tasks", "tiny_mc,tiny_ppl,tiny_gen", "--eval.include_path",
                    str(EVAL_TASKS), "--eval.limit", "6", "--checkpoint.enable", "--checkpoint.interval", "4"]


# name: (processes, local batch size so that local x data-parallel degree = 8, extra args)
LAYOUTS = {
    "fsdp2": (2, 4, []),
    "fsdp4": (4, 2, []),
    "hsdp2x2": (4, 2, ["--parallelism.data_parallel_replicate_degree", "2"]),
    "tp2": (2, 8, ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_tp2": (4, 4, ["--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_ac_full": (2, 4, ["--activation_checkpoint.mode", "full"]),
    "fsdp2_ac_selective_op": (2, 4, ["--activation_checkpoint.mode", "selective"]),
    "fsdp2_ac_selective_every2": (2, 4, ["--activation_checkpoint.mode", "selective",
                                         "--activation_checkpoint.selective_ac_option", "2"]),
    "cp2": (2, 8, ["--parallelism.context_parallel_degree", "2"]),
}
# These also evaluate at step 4 (tests/distributed/test_eval.py).
EVALUATED_LAYOUTS = ("fsdp2", "hsdp2x2", "tp2", "cp2")
for _name, (_nproc, _batch, _extra) in LAYOUTS.items():
    spec(f"layout_{_name}", _nproc, *STEPS, "--training.local_batch_size", str(_batch), *_extra,
         *(IN_TRAINING_EVAL if _name in EVALUATED_LAYOUTS else []))

PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
# The schedules with two stages per rank need four blocks (the fast settings have two), and so their reference.
FOUR_BLOCKS = ["--model.n_layers", "4"]
SINGLE_4 = spec("single_4_blocks", 1, *STEPS, "--training.local_batch_size", "8", *FOUR_BLOCKS)
REFERENCE = {s: SINGLE if s in SINGLE_STAGE else SINGLE_4 for s in SCHEDULES}  # each schedule's one-process run
EVALUATED_SCHEDULE = "1F1B"  # also evaluates at step 4 (tests/distributed/test_eval.py)
for _schedule in SCHEDULES:
    spec(f"pp2_{_schedule}", 2, *STEPS, "--training.local_batch_size", "8", *PP2,
         *([] if _schedule in SINGLE_STAGE else FOUR_BLOCKS),
         "--parallelism.pipeline_parallel_schedule", _schedule,
         *(IN_TRAINING_EVAL if _schedule == EVALUATED_SCHEDULE else []))


def relative_diffs(a: dict[int, float], b: dict[int, float]) -> list[float]:
    assert a.keys() == b.keys() and len(a) == 5, (a, b)
    return [abs(a[s] - b[s]) / abs(b[s]) for s in a]
