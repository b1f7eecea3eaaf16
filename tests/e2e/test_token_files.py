"""Token files other trainers wrote, as a user meets them through run_train.sh: a Megatron dataset named by its
relative path prefix (as in Megatron's --data-path) trains, stops and resumes exactly. (Damaged files, a lonely .idx included, are refused
with one line and exit code 4 in tests/unit/test_token_files.py; the launcher passes a worker's line and code
on, tests/e2e/test_launcher_errors.py.)"""

from __future__ import annotations

import pytest

from tests.support.launch import read_metrics, run_train

PREFIX = "tests/assets/token_files/megatron/part0_text_document"  # relative, as a user would write it


ARGS = ("--training.seq_len", "32", "--training.local_batch_size", "2", "--data.num_shards", "2",
        "--checkpoint.enable", "true", "--training.dataset", "megatron", "--training.dataset_path", PREFIX)


@pytest.mark.slow
def test_train_stop_and_resume_on_a_megatron_prefix(tmp_path):
    """Two steps, then the same folder continued to four, give the losses of four steps straight, bit for bit."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_train(straight, *ARGS, "--training.steps", "4")
    run_train(stopped, *ARGS, "--training.steps", "2")
    proc = run_train(stopped, *ARGS, "--training.steps", "4")
    assert "step-2 loaded" in proc.stdout + proc.stderr
    records = read_metrics(stopped)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["tokens_seen"] == 4 * 2 * 32
    want = {r["step"]: (r["loss"], r["data_fingerprint"]) for r in read_metrics(straight)}
    assert {r["step"]: (r["loss"], r["data_fingerprint"]) for r in records} == want
