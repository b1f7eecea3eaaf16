"""A torchtitan user's debug TOML trains unchanged but for its length, at its own sequence length, from a local
tokenizer folder and a local C4 copy (the real trainer.train.main in this process)."""

from __future__ import annotations

import json
import math

import pytest

from tests.support.data import make_c4
from tests.support.processes import free_port
from tests.support.tokenizers import TORCHTITAN_ASSETS as ASSETS, make_tokenizer_folder

STEPS = 2  # the TOML says 10
# The TOML's 8 sequences of 2048 tokens cost ~20 CPU-seconds a step; its sequence length (what a model built
# for shorter ones would fail on) is kept, the batch is 2 of them.
BATCH = 2


@pytest.mark.slow
def test_debug_toml_trains_at_its_own_sequence_length_with_local_assets(tmp_path, monkeypatch):
    from trainer.train import main

    folder = make_tokenizer_folder(tmp_path / "tokenizer")
    c4 = make_c4(tmp_path / "c4")
    monkeypatch.chdir(tmp_path)
    # World size 1 on a free port (the default, 29500, may be taken by another run on the machine).
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    # The test worker's threads (OMP_NUM_THREADS=1 under run_tests.sh): two would end sooner but cost more CPU
    # in all, and the suite keeps both cores busy.
    rc = main(["--job.config_file", str(ASSETS / "debug_model.toml"), "--model.hf_assets_path", str(folder),
               "--training.dataset_path", str(c4), "--training.steps", str(STEPS),
               "--training.local_batch_size", str(BATCH)])
    assert rc == 0
    records = [json.loads(line) for line in (tmp_path / "outputs" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
