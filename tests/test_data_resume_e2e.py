"""Through run_train.sh: a run checkpointed with 2 data-parallel ranks resumes with 1 rank (same global
batch) and continues with exactly the data, and the loss, of an uninterrupted run."""

import shutil

import pytest

from tests.utils import read_metrics, run_train

COMMON = ["--lr_scheduler.decay_type", "constant", "--training.global_batch_size", "4", "--debug.deterministic",
          "--checkpoint.interval", "4", "--checkpoint.last_save_model_only", "false"]


@pytest.mark.slow
def test_two_ranks_to_one(tmp_path):
    run_train(tmp_path / "straight", *COMMON, "--training.local_batch_size", "4", "--training.steps", "8")
    straight = {r["step"]: r for r in read_metrics(tmp_path / "straight")}
    run_train(tmp_path / "dp2", *COMMON, "--checkpoint.enable", "--training.local_batch_size", "2",
              "--training.steps", "4", nproc=2)
    (tmp_path / "dp1").mkdir()
    shutil.copytree(tmp_path / "dp2" / "checkpoint", tmp_path / "dp1" / "checkpoint")
    run_train(tmp_path / "dp1", *COMMON, "--checkpoint.enable", "--training.local_batch_size", "4",
              "--training.steps", "8")
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "dp1")}
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in resumed:
        assert resumed[step]["data_fingerprint"] == straight[step]["data_fingerprint"], step
        assert resumed[step]["tokens_seen"] == straight[step]["tokens_seen"]
        assert abs(resumed[step]["loss"] - straight[step]["loss"]) <= 1e-5 * straight[step]["loss"]
