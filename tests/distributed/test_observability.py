"""Observability in a real 2-process run over gloo: a profiler trace per rank with the named ranges, and
the GPU-only and optional parts saying so once."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.support.batches import spec

E2E = ["--training.seq_len", "64", "--training.local_batch_size", "2"]
PROFILED = spec("profiled", 2, *E2E, "--training.steps", "3", "--profiling.enable_profiling",
                "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "1",
                "--profiling.profiler_active", "1", "--profiling.enable_memory_snapshot", "--metrics.enable_wandb")


@pytest.mark.slow
@pytest.mark.runs(PROFILED)
def test_profiled_run_writes_a_trace_per_rank_with_named_ranges(batches):
    run = batches.get(PROFILED)
    dump = run.dump
    traces = dump / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_2"]  # step 3's window never completed
    for rank in (0, 1):
        events = json.loads((traces / "iteration_2" / f"rank{rank}_trace.json").read_text())["traceEvents"]
        names = {e.get("name") for e in events if e.get("ph") == "X"}
        for name in ("ProfilerStep#2", "data", "forward", "loss", "backward", "optimizer", "log", "checkpoint"):
            assert name in names, (rank, name)
    # GPU-only and optional parts say so once and do not stop a CPU run.
    assert run.log.count("CUDA memory snapshots need a GPU") == 1
    if importlib.util.find_spec("wandb") is None:
        assert run.log.count("wandb package is not installed") == 1
    summary = json.loads((dump / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["outputs"]["profile_traces"] == str(traces.resolve())
