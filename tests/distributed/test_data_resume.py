"""A run checkpointed with 2 data-parallel ranks resumes with 1 rank (same global batch) and continues with
exactly the data, and the loss, of an uninterrupted run (real processes, batched torchrun starts)."""

import pytest

from tests.support.batches import spec

COMMON = ["--lr_scheduler.decay_type", "constant", "--training.global_batch_size", "4", "--debug.deterministic",
          "--checkpoint.interval", "4", "--checkpoint.last_save_model_only", "false"]

STRAIGHT = spec("data_straight", 1, *COMMON, "--training.local_batch_size", "4", "--training.steps", "8")
DP2 = spec("data_dp2", 2, *COMMON, "--checkpoint.enable", "--training.local_batch_size", "2", "--training.steps", "4")
DP1 = spec("data_dp2_to_dp1", 1, *COMMON, "--checkpoint.enable", "--training.local_batch_size", "4",
           "--training.steps", "8", after=(DP2,), copy=((f"{{root}}/{DP2}/checkpoint", f"{{root}}/{DP2}_to_dp1/checkpoint"),))


@pytest.mark.slow
@pytest.mark.runs(STRAIGHT, DP2, DP1)
def test_two_ranks_to_one(batches):
    straight = batches.get(STRAIGHT).records()
    resumed = batches.get(DP1).records()
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step]["data_fingerprint"] == straight[step]["data_fingerprint"], step
        assert resumed[step]["tokens_seen"] == straight[step]["tokens_seen"]
        assert abs(resumed[step]["loss"] - straight[step]["loss"]) <= 1e-5 * straight[step]["loss"]
