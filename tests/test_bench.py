"""trainer bench: a smoke run of the overhead suite (speed is measured by the benchmarks, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from trainer.tools import bench

from .utils import ROOT


def test_bench_overhead_small_writes_ratio(tmp_path):
    out = tmp_path / "bench.json"
    # A fresh process: the suite initialises (and destroys) a process group of its own.
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.cli", "bench", "overhead", "--steps", "small", "--json", str(out),
         "--training.seq_len", "16", "--training.local_batch_size", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    o = data["results"]["overhead"]
    assert o["overhead_ratio"] > 0 and o["step_time_trainer_s"] > 0 and o["step_time_bare_s"] > 0
    assert "overhead_ratio" in proc.stdout
    # Same weights, same first batch: the trainer and the bare loop compute the same loss.
    assert o["loss_step1_trainer"] == pytest.approx(o["loss_step1_bare"], rel=1e-5)
    assert data["machine"]["torch"] == torch.__version__


def test_bench_gpu_skips_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = bench.bench_gpu(None, [], "/nonexistent")
    assert "skipped" in result


def test_fewer_layer_flavors_resolve_without_registering(tmp_path):
    """llama3_8b_4l (a GPU-suite flavor) is resolved by the trainer itself; the flavor table stays as it is."""
    import argparse

    from trainer.models.llama import LLAMA_FLAVORS
    from trainer.plan import model_args_for_plan

    before = dict(LLAMA_FLAVORS)
    ns = argparse.Namespace(config=str(bench.DEFAULT_CONFIG))
    config = bench.load_bench_config(ns, ["--model.flavor", "llama3_8b_4l"], [], str(tmp_path))
    args, _ = model_args_for_plan(config)
    assert args.n_layers == 4 and args.dim == LLAMA_FLAVORS["llama3_8b"].dim
    assert LLAMA_FLAVORS == before
    bench._check_flavors(list(bench.GPU_FLAVORS))
    with pytest.raises(SystemExit, match="unknown flavor 'llama3_9b'"):
        bench._check_flavors(["debugmodel", "llama3_9b"])


def test_table_marks_targets():
    mode = {"async_mode": "async", "checkpoint_bytes": 1e6, "sync_save_s": 1.0, "async_blocking_s": 0.1,
            "async_first_step_extra_s": 0.0, "async_block_fraction": 0.1, "async_write_s": 1.2,
            "sync_save_gb_per_s": 0.001, "async_save_gb_per_s": 0.001, "load_gb_per_s": 0.002, "step_time_s": 1.0,
            "step_time_during_async_write_s": 1.1}
    table = bench.format_table({"checkpoint": {**mode, "modes": {"async": mode}},
                                "overhead": {"device": "cpu", "step_time_trainer_s": 1.2, "step_time_bare_s": 1.0,
                                             "step_time_trainer_no_loader_s": 1.1, "overhead_ratio": 1.2,
                                             "overhead_ratio_no_loader": 1.1, "overhead_ratio_cpu_time": 1.0,
                                             "overhead_ratio_cpu_time_no_loader": 1.0, "loss_step1_trainer": 1.0,
                                             "loss_step1_bare": 1.0}})
    assert "async_block_fraction" in table and "target < 0.2: PASS" in table
    assert "target <= 1.05: MISS" in table


@pytest.mark.parametrize("variant", sorted(bench.GPU_VARIANTS))
def test_gpu_variants_are_valid_configs(variant, tmp_path):
    import argparse

    ns = argparse.Namespace(config=str(bench.DEFAULT_CONFIG))
    config = bench.load_bench_config(ns, bench.GPU_VARIANTS[variant], [], str(tmp_path))
    assert config.compile.enable == (variant != "eager")


def test_gpu_case_process_runs_on_cpu():
    """The GPU suite's per-case process, run on CPU with a tiny case (memory figures are null there)."""
    spec = {"flavor": "debugmodel", "variant": "eager", "seq_len": 16, "local_batch_size": 1,
            "config": str(bench.DEFAULT_CONFIG), "overrides": ["--data.num_workers", "0"], "warmup": 1,
            "rounds": 1, "block": 1}
    case = bench._run_case(spec, timeout=300)
    assert "error" not in case, case
    assert case["tokens_per_s"] > 0 and case["flops_per_token"] > 0 and case["mfu_pct"] is None
