"""Data files that were cut short (a download, a copy, a prepare that did not finish): one line naming the
file and what to do, the data exit code (4), never a traceback and never documents read past the end. The
real ``trainer.train.main`` at world size 1, in this process."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

from tests.support.launch import train_in_process
from trainer.data.cli import main as data_main

SAMPLE = Path(__file__).resolve().parents[2] / "trainer" / "data" / "sample" / "shakespeare_train.jsonl"


def train(dump: Path, *args: str, monkeypatch) -> tuple[int, str]:
    return train_in_process(dump, "--training.steps", "3", "--data.num_shards", "1", "--checkpoint.enable", "false",
                            *args, monkeypatch=monkeypatch)


def test_a_truncated_gzip_file(tmp_path, monkeypatch):
    whole = gzip.compress(SAMPLE.read_bytes()[:400_000])
    path = tmp_path / "data.jsonl.gz"
    path.write_bytes(whole[: len(whole) // 3])
    rc, log = train(tmp_path / "out", "--training.dataset", "jsonl", "--training.dataset_path", str(path),
                    monkeypatch=monkeypatch)
    assert rc == 4, log[-3000:]
    assert f"{path}: damaged or truncated gzip file" in log and "Traceback" not in log


def prepared(tmp_path: Path) -> Path:
    out = tmp_path / "prepared"
    assert data_main(["prepare", "--output", str(out), "--workers", "1", "--no-progress",
                      "--training.dataset", "jsonl", "--training.dataset_path", str(SAMPLE)]) == 0
    return out


def test_prepared_tokens_cut_short(tmp_path, monkeypatch):
    folder = prepared(tmp_path)
    (tokens,) = folder.glob("*.tokens")
    args = ["--training.dataset", "tokens", "--training.dataset_path", str(folder)]
    itemsize = 2  # the debug tokenizer's vocabulary fits uint16
    size = tokens.stat().st_size
    os.truncate(tokens, size - 1)  # not a whole token
    rc, log = train(tmp_path / "a", *args, monkeypatch=monkeypatch)
    assert rc == 4 and "is not a whole number of uint16 tokens" in log and "Traceback" not in log, log[-3000:]
    os.truncate(tokens, size - 100 * itemsize)  # whole tokens, but fewer than the index says
    rc, log = train(tmp_path / "b", *args, monkeypatch=monkeypatch)
    assert rc == 4 and "but its index ends at" in log and "run trainer data prepare again" in log, log[-3000:]
