"""trainer bench: a smoke run of the overhead suite (speed is measured by the benchmarks, not asserted here)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from trainer.tools import bench

from tests.support.launch import ROOT
from tests.support.processes import QUICK_S, run


def test_bench_overhead_small_writes_ratio(tmp_path):
    out = tmp_path / "bench.json"
    # A fresh process: the suite initialises (and destroys) a process group of its own.
    proc = run(
        [sys.executable, "-m", "trainer.cli", "bench", "overhead", "--steps", "small", "--json", str(out),
         "--training.seq_len", "16", "--training.local_batch_size", "1"],
        cwd=ROOT, timeout=300,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    o = data["results"]["overhead"]
    assert o["overhead_ratio"] > 0 and o["step_time_trainer_s"] > 0 and o["step_time_bare_s"] > 0
    assert "overhead_ratio" in proc.stdout
    # Same weights, same first batch: the trainer and the bare loop compute the same loss.
    assert o["loss_step1_trainer"] == pytest.approx(o["loss_step1_bare"], rel=1e-5)
    assert data["machine"]["torch"] == torch.__version__
    # The same comparison with the trainer and the bare loop each in a process of its own.
    p = o["processes"]
    assert p["overhead_ratio_processes"] > 0 and len(p["ratio_per_repeat"]) == p["repeats"] == 1
    assert {run["role"] for run in p["runs"][0].values()} == {"trainer", "bare"}
    assert "overhead_ratio_processes" in proc.stdout


def test_bench_gpu_skips_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = bench.bench_gpu(None, [], "/nonexistent")
    assert "skipped" in result


def test_fewer_layer_flavors_resolve_without_registering(tmp_path):
    """llama3_8b_4l (a GPU-suite flavor) is resolved by the trainer itself; the flavor table stays as it is."""
    import argparse

    from trainer.models.llama.flavors import LLAMA_FLAVORS
    from trainer.tools.plan.cli import model_args_for_plan

    before = dict(LLAMA_FLAVORS)
    ns = argparse.Namespace(config=str(bench.DEFAULT_CONFIG))
    config = bench.load_bench_config(ns, ["--model.flavor", "llama3_8b_4l"], [], str(tmp_path))
    args, _ = model_args_for_plan(config)
    assert args.n_layers == 4 and args.dim == LLAMA_FLAVORS["llama3_8b"].dim
    assert LLAMA_FLAVORS == before
    bench._check_flavors(list(bench.GPU_FLAVORS))
    with pytest.raises(SystemExit, match="unknown flavor 'llama3_9b'"):
        bench._check_flavors(["debug_gqa", "llama3_9b"])


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
    assert config.compile.enable == variant.startswith("compile")


def test_gpu_case_process_runs_on_cpu():
    """The GPU suite's per-case process, run on CPU with a tiny case (memory figures are null there)."""
    spec = {"flavor": "debug_gqa", "variant": "eager", "seq_len": 16, "local_batch_size": 1,
            "config": str(bench.DEFAULT_CONFIG), "overrides": ["--data.num_workers", "0"], "warmup": 1,
            "rounds": 1, "block": 1}
    case = bench._run_case(spec, timeout=300)
    assert "error" not in case, case
    assert case["tokens_per_s"] > 0 and case["flops_per_token"] > 0 and case["mfu_pct"] is None


def test_gpu_suite_refuses_without_cuda_in_one_line():
    proc = run([sys.executable, "-m", "trainer.cli", "bench", "gpu", "--matrix", "hot_path"], cwd=ROOT, timeout=QUICK_S,
               env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and "no CUDA device" in proc.stderr


def test_hot_path_matrix_cases():
    import argparse

    ns = argparse.Namespace(matrix="hot_path", flavors=None, variants=None, seq_len=4096)
    cases = bench.gpu.gpu_cases(ns)
    assert len(cases) == 16 and {c[2] for c in cases} == {4096, 8192}
    assert {c[1] for c in cases} == {"eager", "compile", "float8_tensorwise", "compile_float8_tensorwise"}


def test_rope_forms_agree_bitwise():
    """The model's RoPE (complex multiply) and the real-valued chain give the same bits, forward and backward."""
    from trainer.tools.bench.kernels import rope_case

    case = rope_case("debug_gqa", compile_=False, repeats=1, rounds=1)
    assert case["bitwise_equal"], case


def test_vs_torchtitan_skips_in_one_line_without_torchtitan(monkeypatch, tmp_path):
    import argparse

    from trainer.tools.bench import vs_torchtitan

    monkeypatch.setattr(vs_torchtitan, "torchtitan_version", lambda: None)
    result = vs_torchtitan.bench_vs_torchtitan(argparse.Namespace(steps="small"), [], str(tmp_path))
    assert list(result) == ["skipped"] and "\n" not in result["skipped"]


def test_step_seeding_matches_manual_seed():
    """The per-step seed reaches the CPU generator exactly as torch.manual_seed would put it."""
    from trainer.setup import seed_step

    seed_step(1234, torch.device("cpu"))
    ours = torch.get_rng_state()
    torch.manual_seed(1234)
    assert torch.equal(ours, torch.get_rng_state())


def test_bench_data_files_measures_every_kind_against_plain_memmap(tmp_path):
    """The token-file loader benchmark, shrunk: a row per kind and seq_len, beside the plain memmap read."""
    from tests.support.data import make_config
    from tokenizer import DEBUG_TOKENIZER_PATH, build_tokenizer
    from trainer.tools.bench.data_files import format_rows, measure_token_files

    config = make_config(**{"training.local_batch_size": 2, "data.num_shards": 2})
    rows = measure_token_files(config, build_tokenizer(DEBUG_TOKENIZER_PATH), seconds=0.05, seq_lens=(64,),
                               n_tokens=1 << 16, workdir=str(tmp_path))
    assert [r["kind"] for r in rows] == ["plain", "megatron", "numpy", "arrow"]
    assert all(r["tokens_per_s"] > 0 and r["plain_tokens_per_s"] == rows[0]["tokens_per_s"] for r in rows)
    assert "megatron" in format_rows({"rows": rows})


def test_context_parallel_cases_are_configs_the_trainer_takes(tmp_path):
    """trainer bench context-parallel: CP 1, 2 and 4, causal and block_causal, both rotate methods above CP 1;
    each case a config the trainer accepts at its world size, and plan's estimate per rank falls with the
    degree (the run itself is the benchmark's: docs/benchmarks.md)."""
    from trainer.config import load_config
    from trainer.config.validate import validate
    from trainer.tools.bench import context_parallel as cp

    cases = cp.cases()
    assert len(cases) == 10 and {(m, d) for m, d, _ in cases} == {(m, d) for m in cp.MASKS for d in cp.DEGREES}
    planned = {}
    for mask, degree, method in cases:
        argv = cp.case_argv(str(bench.DEFAULT_CONFIG), tmp_path / "run", 8192, mask, degree, method, [])
        config = load_config(argv, env={})
        validate(config, degree)
        p = config.parallelism
        assert (config.model.attn_mask_type, p.context_parallel_degree, config.training.seq_len) == (mask, degree, 8192)
        assert method is None or p.context_parallel_rotate_method == method
        planned[(mask, degree)] = cp.plan_total_gib(argv, degree)
    for mask in cp.MASKS:
        assert planned[(mask, 1)] > planned[(mask, 2)] > planned[(mask, 4)] > 0
