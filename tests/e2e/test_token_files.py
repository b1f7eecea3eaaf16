"""Token files other trainers wrote, as a user meets them through run_train.sh: a Megatron dataset named by its
path prefix (as in Megatron's --data-path) trains; a damaged one is one line and the data exit code (4)."""

from __future__ import annotations

import shutil

import pytest

from tests.support.launch import ROOT, read_metrics, run_train

PREFIX = "tests/assets/token_files/megatron/part0_text_document"  # relative, as a user would write it
SMALL = ["--training.steps", "3", "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--data.num_shards", "2"]


@pytest.mark.slow
def test_train_on_a_megatron_prefix(tmp_path):
    run_train(tmp_path / "run", *SMALL, "--training.dataset", "megatron", "--training.dataset_path", PREFIX)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["tokens_seen"] == 3 * 2 * 32


@pytest.mark.slow
def test_a_megatron_index_without_its_bin_is_one_line_exit_4(tmp_path):
    shutil.copy(ROOT / f"{PREFIX}.idx", tmp_path / "lonely.idx")
    proc = run_train(tmp_path / "run", *SMALL, "--data.sources", f"megatron:{tmp_path / 'lonely'}", check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr
    assert len(err) == 1 and "lonely.bin is missing" in err[0] and "Traceback" not in proc.stdout + proc.stderr, err
