"""End-to-end training through run_train.sh: the debug model learns, metrics are complete, runs repeat
bitwise, gradient accumulation equals one big batch, and the presets validate."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.launch import ROOT, losses, read_metrics, run_train

FIELDS = {"step", "loss", "grad_norm", "lr", "tokens_seen", "tps", "mfu", "tflops", "step_time_s", "data_wait_s",
          "memory", "data_fingerprint"}


@pytest.mark.slow
def test_debug_model_learns_and_writes_every_output(tmp_path):
    """The Quickstart run itself (40 steps at its own seq_len and batch), with TensorBoard on."""
    proc = run_train(tmp_path, "--metrics.log_freq", "1", fast=False)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 41))
    for r in records:
        assert FIELDS <= r.keys(), FIELDS - r.keys()
        assert r["mfu"] is None  # no known peak on CPU
        assert r["tps"] > 0 and r["memory"] > 0 and r["tflops"] > 0
    assert records[-1]["tokens_seen"] == 40 * 8 * 256
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last <= 0.8 * first, (first, last)
    assert str(tmp_path.resolve()) in proc.stdout  # says where the outputs went
    assert (tmp_path / "config.toml").is_file()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tb_loss = [e.value for e in events.Scalars("loss")]
    assert tb_loss == pytest.approx([r["loss"] for r in records])


@pytest.mark.slow
def test_deterministic_runs_are_bitwise_identical(tmp_path):
    """Also evaluates the held-out split every 3 steps: validation_loss is logged and repeats too."""
    args = ["--training.steps", "6", "--debug.deterministic", "--validation.enable", "--validation.freq", "3",
            "--validation.steps", "2"]
    run_train(tmp_path / "a", *args)
    run_train(tmp_path / "b", *args)
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    validated = {r["step"]: r["validation_loss"] for r in a if "validation_loss" in r}
    assert sorted(validated) == [3, 6] and all(0 < v < 20 for v in validated.values())
    assert validated == {r["step"]: r["validation_loss"] for r in b if "validation_loss" in r}
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    assert [r["data_fingerprint"] for r in a] == [r["data_fingerprint"] for r in b]


@pytest.mark.slow
def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    common = ["--training.steps", "4", "--debug.deterministic", "--training.global_batch_size", "8"]
    run_train(tmp_path / "big", *common, "--training.local_batch_size", "8")
    run_train(tmp_path / "accum", *common, "--training.local_batch_size", "2")  # 4 micro-batches
    big, accum = read_metrics(tmp_path / "big"), read_metrics(tmp_path / "accum")
    assert [r["data_fingerprint"] for r in big] == [r["data_fingerprint"] for r in accum]
    for x, y in zip(big, accum):
        assert abs(x["loss"] - y["loss"]) / x["loss"] <= 1e-5
        assert abs(x["grad_norm"] - y["grad_norm"]) / x["grad_norm"] <= 1e-4


@pytest.mark.parametrize("preset, world", [
    ("llama2_7b", 64), ("llama2_13b", 64), ("llama2_70b", 64), ("llama3_1b", 8), ("llama3_8b", 64),
    ("llama3_70b", 128), ("llama3_405b", 512),
])
def test_presets_validate_and_build_on_meta(preset, world):
    """Dry run: config validation for the preset's world size and the model built on the meta device."""
    env = {**os.environ, "WORLD_SIZE": str(world)}
    proc = subprocess.run([sys.executable, "-m", "trainer.train", "--job.config_file",
                           str(ROOT / "train_configs" / f"{preset}.toml"), "--job.dry_run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    published = {"llama2_7b": 6_738_415_616, "llama2_13b": 13_015_864_320, "llama2_70b": 68_976_648_192,
                 "llama3_1b": 1_235_814_400, "llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496,
                 "llama3_405b": 405_853_388_800}
    assert out["params"] == published[preset]
    assert out["status"] == "ok"
