"""Token files other trainers wrote, as a user meets them through run_train.sh: a Megatron dataset named by its
relative path prefix (as in Megatron's --data-path) trains. (Damaged files, a lonely .idx included, are refused
with one line and exit code 4 in tests/unit/test_token_files.py; the launcher passes a worker's line and code
on, tests/e2e/test_launcher_errors.py.)"""

from __future__ import annotations

import pytest

from tests.support.launch import read_metrics, run_train

PREFIX = "tests/assets/token_files/megatron/part0_text_document"  # relative, as a user would write it


@pytest.mark.slow
def test_train_on_a_megatron_prefix(tmp_path):
    run_train(tmp_path / "run", "--training.steps", "2", "--training.seq_len", "32", "--training.local_batch_size",
              "2", "--data.num_shards", "2", "--training.dataset", "megatron", "--training.dataset_path", PREFIX)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["tokens_seen"] == 2 * 2 * 32
