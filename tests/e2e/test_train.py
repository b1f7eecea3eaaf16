"""End-to-end training through run_train.sh: the Quickstart run learns and writes every output (repeats,
gradient accumulation and the presets are in tests/unit/test_train.py)."""

import pytest

from tests.support.launch import read_metrics, run_train

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
