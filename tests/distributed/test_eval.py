"""Evaluation spread over ranks: ``[eval]`` under FSDP, HSDP, tensor, pipeline and context parallel (the parity runs of
tests/support/parity.py evaluate at step 4, IN_TRAINING_EVAL) logs the scores ``trainer eval``
gives on that step's checkpoint in one process, and close to a one-process run's scores; ``trainer eval``
under torchrun (NGPU=2) equals one process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
pytest.importorskip("lm_eval")

from tests.support.batches import spec  # noqa: E402
from tests.support.launch import ROOT  # noqa: E402
from tests.support.parity import EVAL_TASKS, IN_TRAINING_EVAL, SINGLE, STEPS  # noqa: E402
from tests.support.processes import run  # noqa: E402
from torchtitan_ext.evaluation.callback import flatten_results  # noqa: E402
from torchtitan_ext.lm_eval_model import main as eval_main  # noqa: E402

EVAL_SINGLE = spec("eval_single", 1, *STEPS, "--training.local_batch_size", "8", *IN_TRAINING_EVAL,
                   "--metrics.enable_tensorboard", "true")
LAYOUT_RUNS = {"fsdp2": "layout_fsdp2", "hsdp2x2": "layout_hsdp2x2", "tp2": "layout_tp2", "pp2": "pp2_1F1B",
               "cp2": "layout_cp2"}
# trainer eval with the in-training settings: the model's RoPE table (training.seq_len) and eval.batch_size.
OFFLINE = ["--max_length", "64", "--batch_size", "8", "--tasks", "tiny_mc,tiny_ppl,tiny_gen", "--include_path",
           str(EVAL_TASKS), "--limit", "6"]


def live_scores(run, step: int = 4) -> dict[str, float]:
    return {k: v for k, v in run.records()[step].items() if k.startswith("eval/")}


def results_of(out: Path) -> dict[str, float]:
    [path] = list(out.rglob("results_*.json"))
    return flatten_results(json.loads(path.read_text()))


def offline_scores(dump: Path, out: Path, step: int = 4) -> dict[str, float]:
    assert eval_main(["--model_args", f"checkpoint={dump},step={step}", *OFFLINE, "--output_path", str(out)]) == 0
    return results_of(out)


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.runs(r, EVAL_SINGLE))
                                    for n, r in LAYOUT_RUNS.items()])
def test_in_training_eval_equals_trainer_eval_of_the_checkpoint(layout, batches, tmp_path):
    run = batches.get(LAYOUT_RUNS[layout])
    live = live_scores(run)
    assert {"eval/tiny_mc/acc", "eval/tiny_ppl/bits_per_byte", "eval/tiny_gen/exact_match"} <= live.keys()
    assert run.records()[4]["eval_time_s"] > 0
    offline = offline_scores(run.dump, tmp_path / "offline")
    assert offline.keys() == live.keys()
    for key, value in offline.items():
        assert relative(live[key], value) <= 1e-6, (key, live[key], value)
    # Close to one process's training and evaluation (the weights differ by the parallel tolerance).
    single = live_scores(batches.get(EVAL_SINGLE))
    for key, value in single.items():
        if "bits_per_byte" in key:
            assert abs(live[key] - value) <= 1e-4, (key, live[key], value)
        elif "perplexity" in key:
            assert relative(live[key], value) <= 1e-3, (key, live[key], value)
        else:
            assert live[key] == value, (key, live[key], value)


@pytest.mark.slow
@pytest.mark.runs(SINGLE, EVAL_SINGLE)
def test_in_training_eval_leaves_the_training_as_it_was(batches):
    run = batches.get(EVAL_SINGLE)
    assert run.losses() == batches.get(SINGLE).losses()  # step 5 comes after the evaluation of step 4
    assert "eval tiny_mc/acc" in run.log  # the console line
    assert any(b"eval/tiny_ppl/bits_per_byte" in p.read_bytes() for p in (run.dump / "tb").rglob("*tfevents*"))


@pytest.mark.slow
@pytest.mark.runs(EVAL_SINGLE)
def test_trainer_eval_on_two_processes_equals_one(batches, tmp_path):
    dump = batches.get(EVAL_SINGLE).dump
    one = offline_scores(dump, tmp_path / "one")
    env = {**os.environ, "NGPU": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = run([sys.executable, "-m", "trainer.cli", "eval", "--model_args", f"checkpoint={dump},step=4", *OFFLINE,
                "--output_path", str(tmp_path / "two")], env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 processes (NGPU=2) under torchrun" in proc.stdout + proc.stderr
    assert results_of(tmp_path / "two") == one
    assert len(list((tmp_path / "two").rglob("results_*.json"))) == 1  # rank 0 writes
