"""Checkpoints in real runs of the trainer (gloo; one torchrun start per world size runs many): exact resume
with synchronous and asynchronous saves, and resharding from FSDP 4 to other layouts. The settings and the
straight reference run are in tests/support/checkpoints.py."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.batches import spec
from tests.support.checkpoints import CKPT, COMMON, STEPS, STRAIGHT, assert_same, batch
from tests.support.launch import read_metrics
from trainer.checkpoint.layout import scan_folder

SYNC = ["--checkpoint.last_save_model_only", "false"]
SYNC_10 = spec("ckpt_sync_10", 1, *COMMON, *CKPT, *batch(1), *SYNC, "--training.steps", "10")
SYNC_20 = spec("ckpt_sync_20", 1, *COMMON, *CKPT, *batch(1), *SYNC, "--training.steps", str(STEPS), after=(SYNC_10,),
               dump=f"{{root}}/{SYNC_10}")


@pytest.mark.slow
@pytest.mark.runs(STRAIGHT, SYNC_10, SYNC_20)
def test_exact_resume_sync(batches):
    """10 steps, stop, the same command to 20: steps 11-20 bitwise identical to the straight run."""
    batches.get(SYNC_10)
    run = batches.get(SYNC_20)
    assert "checkpoint step-10 saved" not in run.log and "step-10 loaded" in run.log
    got = run.records()
    assert_same(batches.get(STRAIGHT).records(), got, range(1, STEPS + 1))
    assert sorted(got) == list(range(1, STEPS + 1))


ASYNC = ["--checkpoint.async_mode", "async", "--checkpoint.drill_save_delay_s", "1"]
ASYNC_10 = spec("ckpt_async_10", 1, *COMMON, *CKPT, *batch(1), *ASYNC, "--training.steps", "10")
# The step-10 full save gone: final-step-10 (weights only) and step-5 are left.
ASYNC_20 = spec("ckpt_async_20", 1, *COMMON, *CKPT, *batch(1), *ASYNC, "--training.steps", str(STEPS),
                after=(ASYNC_10,), dump=f"{{root}}/{ASYNC_10}", remove=(f"{{root}}/{ASYNC_10}/checkpoint/step-10",))


@pytest.mark.slow
@pytest.mark.runs(STRAIGHT, ASYNC_10, ASYNC_20)
def test_exact_resume_async(batches):
    """Asynchronous saves (slowed down so several steps run while one is written) with the default
    model-only final export: with the last step's full save gone, the extended run resumes from the
    asynchronous step-5, bitwise."""
    first = batches.get(ASYNC_10).log
    saved = re.search(r"checkpoint step-5 saved: .* in ([0-9.]+) s \(training blocked ([0-9.]+) s\)", first)
    assert saved, first[-3000:]
    total, blocked = map(float, saved.groups())
    assert total >= 1.0 > blocked  # written in the background while training went on
    run = batches.get(ASYNC_20)
    assert "holds only model weights" in run.log and "step-5 loaded" in run.log
    assert_same(batches.get(STRAIGHT).records(), run.records(), range(1, STEPS + 1))
    kinds = {c.path.name: c.kind for c in scan_folder(run.dump / "checkpoint")}
    assert kinds == {"step-5": "full", "step-10": "full", "final-step-10": "model_only", "step-15": "full",
                     "step-20": "full", "final-step-20": "model_only"}


SOURCE = spec("ckpt_fsdp4", 4, *COMMON, *CKPT, *batch(4), "--training.steps", "10",
              "--checkpoint.last_save_model_only", "false")
STEP10 = f"{{root}}/{SOURCE}/checkpoint/step-10"
RESUMED = {
    "fsdp2": (2, [*batch(2), "--checkpoint.async_mode", "async", "--checkpoint.drill_fail_save_steps", "15",
                  "--checkpoint.max_failed_saves", "2"]),
    "hsdp": (4, [*batch(4), "--parallelism.data_parallel_replicate_degree", "2",
                 "--checkpoint.initial_load_path", STEP10, "--checkpoint.initial_load_model_only", "false"]),
    "tp2": (2, [*batch(1), "--parallelism.tensor_parallel_degree", "2"]),
    "single": (1, batch(1)),
}
for _name, (_nproc, _extra) in RESUMED.items():
    _copy = () if "--checkpoint.initial_load_path" in _extra else ((STEP10, f"{{root}}/ckpt_to_{_name}/checkpoint/step-10"),)
    spec(f"ckpt_to_{_name}", _nproc, *COMMON, *CKPT, *_extra, "--training.steps", str(STEPS), after=(SOURCE,), copy=_copy)


@pytest.mark.slow
@pytest.mark.runs(STRAIGHT, SOURCE, *(f"ckpt_to_{n}" for n in RESUMED))
def test_reshard(batches):
    """Saved by FSDP 4, resumed by FSDP 2 (asynchronous saves, one failing on purpose), HSDP 2x2 (via
    initial_load_path with the full state), TP 2 and one process: every run continues with the straight
    run's data and losses (relative 1e-5)."""
    straight = batches.get(STRAIGHT).records()
    assert_same(straight, batches.get(SOURCE).records(), range(1, 11), rel=1e-5)
    runs = {name: batches.get(f"ckpt_to_{name}") for name in RESUMED}
    for name, run in runs.items():
        got = run.records()
        assert sorted(got) == list(range(11, STEPS + 1)), name
        assert_same(straight, got, range(11, STEPS + 1), rel=1e-5)
    fsdp2 = runs["fsdp2"].log
    assert "checkpoint step-15 FAILED" in fsdp2 and "injected write failure" in fsdp2
    # The failed background save of step 15 is agreed at a step boundary after it (the run goes on:
    # max_failed_saves 2), at the latest before the last step's record: the summary and that record count it.
    assert json.loads((runs["fsdp2"].dump / "summary.json").read_text())["checkpoint_failures"] == 1
    assert runs["fsdp2"].records()[STEPS]["checkpoint_failures"] == 1
    assert "step-10 loaded" in runs["hsdp"].log


# Background saves failing on rank 1 only (copies into reused buffers): the copy of step 4 (the run goes on:
# max_failed_saves 2), then the write of step 6 (the second failure in a row: the run stops); then the same
# command resumes. A rank that waited for another would wait checkpoint.timeout_seconds (60 s).
FAILING = [*batch(2), "--checkpoint.interval", "2", "--checkpoint.async_mode", "async_with_pinned_mem"]
ASYNC_FAIL = spec("ckpt_async_fail", 2, *COMMON, *CKPT, *FAILING, "--checkpoint.drill_fail_copy_steps", "4",
                  "--checkpoint.drill_fail_save_steps", "6", "--checkpoint.max_failed_saves", "2",
                  "--checkpoint.timeout_seconds", "60", "--training.steps", "10", rc=3)
ASYNC_FAIL_RESUMED = spec("ckpt_async_fail_resumed", 2, *COMMON, *CKPT, *FAILING, "--training.steps", "3",
                          after=(ASYNC_FAIL,), dump=f"{{root}}/{ASYNC_FAIL}")
_LINE = re.compile(r"^\d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d) .*?(step +(\d+) +loss|checkpoint step-(\d+) FAILED)")


@pytest.mark.slow
@pytest.mark.runs(ASYNC_FAIL, ASYNC_FAIL_RESUMED)
def test_failed_background_save_on_one_rank(batches):
    """Every rank learns of a background save that failed on rank 1 at the step boundary after the
    failure, as of a failed synchronous save: none waits for the checkpoint's timeout, the run stops (or
    goes on, by checkpoint.max_failed_saves) in one line, and a resume loads the previous checkpoint."""
    run = batches.get(ASYNC_FAIL)
    log = run.log
    assert "pinned memory needs CUDA; the staging buffers are ordinary CPU memory on this machine, still reused" in log
    when = {}  # "step N" / "failed N" -> seconds of the day its line was logged
    for line in log.splitlines():
        m = _LINE.match(line)
        if m:
            h, mi, sec, _, step, failed = m.groups()
            when[f"step {step}" if step else f"failed {failed}"] = int(h) * 3600 + int(mi) * 60 + int(sec)
    # The copy failed on rank 1 before its step 5 could change the weights: agreed after step 5 (counted
    # from step 6's record on), within seconds of it, and the run went on.
    assert re.search(r"checkpoint step-4 FAILED \(in the background: it ended during step [45], agreed by every rank "
                     r"after step 5\): rank 1: OSError: fault drill: injected copy failure", log), log[-4000:]
    assert 0 <= (when["failed 4"] - when["step 5"]) % 86400 < 30, when
    records = {r["step"]: r for r in read_metrics(run.dump)}
    assert records[5]["checkpoint_failures"] == 0 and records[6]["checkpoint_failures"] == 1
    # The write failed on rank 1: agreed at the boundary of the step it ended in or the next, where both
    # ranks stopped with the same one line, the checkpoint of step 2 untouched and nothing half-written.
    m = re.search(r"checkpoint step-6 FAILED \(in the background: it ended during step (\d+), agreed by every rank "
                  r"after step (\d+)\): rank 1: OSError: fault drill: injected write failure", log)
    assert m, log[-4000:]
    ended, agreed = map(int, m.groups())
    assert 6 <= ended <= agreed <= ended + 1
    assert max(records) == agreed and 0 <= (when["failed 6"] - when[f"step {agreed}"]) % 86400 < 30
    stop = "stopping after 2 failed checkpoint save(s) in a row (checkpoint.max_failed_saves=2); last: step-6"
    assert stop in log and stop in (run.log_path.parent / f"{run.log_path.name}.rank1").read_text()
    # The same command resumes from step 2, exactly (step 3 trains again as it did the first time).
    resumed = batches.get(ASYNC_FAIL_RESUMED)
    left = sorted(p.name for p in (run.dump / "checkpoint").iterdir())
    assert left == ["final-step-3", "step-2", "step-3"], left
    assert "checkpoint/step-2 loaded" in resumed.log
    again = [r for r in read_metrics(run.dump) if r["step"] == 3]
    assert len(again) == 2 and again[0]["loss"] == again[1]["loss"]
    assert again[0]["data_fingerprint"] == again[1]["data_fingerprint"]
