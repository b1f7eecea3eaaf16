"""Observability: profiler traces, memory snapshots, the hang watchdog, console logging, the run summary.

Unit tests drive trainer.observability in-process (and in small subprocesses for the parts that end a
process); the multi-process runs are in tests/distributed/test_observability.py and
tests/e2e/test_observability.py. Tests that need a GPU (the gpu marker) skip on CPU.
"""

from __future__ import annotations

import json
import os
import logging
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerAction, record_function

from tests.support.launch import ROOT
from tests.support.processes import QUICK_S, popen
from trainer import logs
from trainer.observability import profiling
from trainer.observability.sinks import build_wandb_writer
from trainer.observability.watchdog import WATCHDOG_EXIT_CODE
from trainer.config import ConfigError, load_config, validate
from trainer.metrics import MetricsWriter, console_line, use_color
from trainer.observability.profiling import MemorySnapshots, Profiler
from trainer.observability.session import Observability, ObservedRun
from trainer.observability.watchdog import Watchdog

STEP_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[rank (\d+)\] INFO step +(\d+) ")


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def trainer_log():
    """Messages of the "trainer" logger during the test (whatever handlers earlier tests installed)."""
    logger = logging.getLogger("trainer")
    handler, old_level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def fake_trainer(tmp_path: Path, *args: str, device: str = "cpu", metrics: bool = True):
    """What Observability reads from a Trainer, without building a model."""
    config = load_config(["--job.dump_folder", str(tmp_path), "--training.steps", "3", *args], env={})
    state = types.SimpleNamespace(step=0, tokens_seen=0, skipped_steps=0)
    writer = MetricsWriter(tmp_path, enabled=True, tensorboard_dir=None) if metrics else None
    return ObservedRun(
        config=config, rank=0, world_size=1, is_logging_rank=True, device=types.SimpleNamespace(type=device),
        state=state, metrics=writer, flops_per_token=1000, peak_tflops=1e-6,
        checkpointer=types.SimpleNamespace(enabled=True, saves=2, failures=0),
    )


def wait_until(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# --------------------------------------------------------------------------------------------------
# Profiler
# --------------------------------------------------------------------------------------------------


def test_profiler_schedule_ends_windows_at_multiples_of_freq():
    cfg = types.SimpleNamespace(enable_profiling=True, profile_freq=5, profiler_warmup=2, profiler_active=2)
    p = Profiler(cfg, Path("unused"), 0, 1, use_cuda=False)
    N, W, R, S = ProfilerAction.NONE, ProfilerAction.WARMUP, ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE
    assert [p.schedule(s) for s in range(1, 11)] == [N, W, W, R, S] * 2  # steps 4-5 and 9-10 recorded


@pytest.mark.parametrize("first_step", [1, 11])
def test_profiler_writes_named_trace_at_window_end(tmp_path, first_step):
    """Steps first_step.. with profile_freq 4: the window ending at the next multiple of 4 is written
    under iteration_<step>, with ProfilerStep#<training step>; a window cut short at the end is not."""
    cfg = types.SimpleNamespace(enable_profiling=True, profile_freq=4, profiler_warmup=1, profiler_active=1)
    prof = Profiler(cfg, tmp_path, 0, first_step, use_cuda=False)
    prof.start()
    x = torch.randn(32, 32)
    end = -(-first_step // 4) * 4
    for step in range(first_step, end + 4):  # ends after the next window's warmup step
        with record_function("forward"):
            x = torch.tanh(x @ x)
        prof.step(step)
    prof.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"iteration_{end}"]
    events = json.loads((tmp_path / f"iteration_{end}" / "rank0_trace.json").read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "forward" in names and f"ProfilerStep#{end}" in names
    assert f"ProfilerStep#{end - 1}" not in names  # warmup steps are not recorded


# --------------------------------------------------------------------------------------------------
# Watchdog
# --------------------------------------------------------------------------------------------------


class Clock:
    """The watchdog's clock, advanced by hand: what it sees does not depend on how busy the machine is."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _polls(wd: Watchdog, n: int = 5) -> None:
    """Real time for the watchdog thread to look at the clock a few times."""
    time.sleep(n * wd.poll_s)


def test_watchdog_dumps_every_thread_and_exits(tmp_path):
    exits, fired = [], []
    release = threading.Event()  # more threads than faulthandler lists (100): the main thread must still show
    crowd = [threading.Thread(target=release.wait, daemon=True) for _ in range(110)]
    for t in crowd:
        t.start()
    clock = Clock()
    wd = Watchdog(0.3, tmp_path / "watchdog", rank=3, poll_s=0.02, exit_fn=exits.append, on_fire=fired.append,
                  exit_grace_s=0.0, backstop_grace_s=0, dump_on_sigterm=False, clock=clock)
    wd.start()
    wd.heartbeat(7)
    clock.advance(0.2)
    _polls(wd)
    assert not exits
    clock.advance(0.2)
    assert wait_until(lambda: exits, 5)
    wd.stop()
    assert exits == [WATCHDOG_EXIT_CODE]
    text = (tmp_path / "watchdog" / "rank3_stacks.txt").read_text()
    assert "rank 3: no progress" in text and "last completed: step 7" in text
    assert "most recent call first" in text and "wait_until" in text  # the main thread's frame
    assert fired and "rank3_stacks.txt" in fired[0]
    release.set()


def test_watchdog_heartbeats_and_allowances_keep_it_quiet_and_clean(tmp_path):
    exits = []
    clock = Clock()
    wd = Watchdog(0.25, tmp_path / "watchdog", rank=0, poll_s=0.02, exit_fn=exits.append, exit_grace_s=0.0,
                  backstop_grace_s=0, dump_on_sigterm=False, clock=clock)
    wd.start()
    for step in range(10):  # 2 s of steps, each well inside the timeout
        clock.advance(0.2)
        _polls(wd, 1)
        wd.heartbeat(step)
    wd.allow(0.5)  # e.g. a checkpoint save: 0.25 + 0.5 s
    clock.advance(0.7)
    _polls(wd)
    assert not exits
    wd.stop()
    assert not (tmp_path / "watchdog").exists()  # nothing happened: no empty files left behind


def test_watchdog_gives_the_first_step_longer(tmp_path):
    exits = []
    clock = Clock()
    wd = Watchdog(0.1, tmp_path, rank=0, first_timeout_s=0.8, poll_s=0.02, exit_fn=exits.append, exit_grace_s=0.0,
                  backstop_grace_s=0, dump_on_sigterm=False, clock=clock)
    wd.start()
    clock.advance(0.7)  # compiling the first step
    _polls(wd)
    assert not exits
    wd.heartbeat(1)  # from now on, 0.1 s
    clock.advance(0.15)
    assert wait_until(lambda: exits, 5)
    wd.stop()


FALLBACK_SCRIPT = """
import re, sys, time
from pathlib import Path
from trainer.observability.watchdog import Watchdog
mode = sys.argv[2]
wd = Watchdog(0.5 if mode == "gil" else 600, Path(sys.argv[1]), rank=5, poll_s=0.05, backstop_grace_s=0.5)
wd.start()
print("started", flush=True)
if mode == "gil":  # catastrophic backtracking: C code that never releases the GIL
    re.match(r"(a+)+$", "a" * 40 + "b")
else:
    time.sleep(60)
"""


def test_watchdog_fallbacks_work_while_the_gil_is_held_and_on_sigterm(tmp_path):
    """faulthandler's C timer fires although the watchdog thread cannot run (exit code 1), and SIGTERM
    (what torchrun sends to surviving ranks) writes the stacks before the process dies."""
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    gil = popen([sys.executable, "-c", FALLBACK_SCRIPT, str(tmp_path / "gil"), "gil"], env=env,
                           stdout=subprocess.PIPE, text=True)
    term = popen([sys.executable, "-c", FALLBACK_SCRIPT, str(tmp_path / "term"), "term"], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert term.stdout.readline().strip() == "started"
    term.send_signal(signal.SIGTERM)
    assert term.wait(30) == -signal.SIGTERM
    assert gil.wait(60) == 1
    assert time.monotonic() - start < 50
    gil_text = (tmp_path / "gil" / "rank5_stacks.txt").read_text()
    assert "Timeout" in gil_text and "most recent call first" in gil_text and "<module>" in gil_text
    term_text = (tmp_path / "term" / "rank5_stacks.txt").read_text()
    assert "most recent call first" in term_text and "<module>" in term_text


# --------------------------------------------------------------------------------------------------
# Memory snapshots, OOM, summary, W&B
# --------------------------------------------------------------------------------------------------


def test_cuda_oom_dumps_a_snapshot_writes_the_summary_and_reraises(tmp_path, monkeypatch, trainer_log):
    dumped = []
    monkeypatch.setattr(profiling, "dump_cuda_snapshot", lambda p: (dumped.append(p), p.write_bytes(b"x")))
    trainer = fake_trainer(tmp_path, "--comm.watchdog_timeout_seconds", "0", device="cuda")
    with pytest.raises(torch.cuda.OutOfMemoryError):
        with Observability(trainer) as obs:
            with obs.step(1):
                trainer.state.step, trainer.state.tokens_seen = 1, 100
            obs.step_done(1)
            with obs.step(2):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    assert dumped == [tmp_path / "memory_snapshot" / "iteration_2_exit" / "rank0_memory_snapshot.pickle"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "OutOfMemoryError" in summary["error"]
    assert summary["memory_snapshots"] == [str(dumped[0])]
    assert any("memory_viz" in line for line in trainer_log)
    assert any(line.startswith("run summary: failed") for line in trainer_log)


def test_memory_snapshot_request_on_cpu_warns_and_skips(tmp_path, trainer_log):
    cfg = types.SimpleNamespace(enable_memory_snapshot=True, profile_freq=1)
    snaps = MemorySnapshots(cfg, tmp_path, 0, use_cuda=False)
    snaps.start()
    snaps.maybe_dump(1)
    assert snaps.on_oom(1) is None and not snaps.recording and not any(tmp_path.iterdir())
    assert any("need a GPU" in line for line in trainer_log)


def test_summary_json_and_line(tmp_path, trainer_log):
    trainer = fake_trainer(tmp_path, "--comm.watchdog_timeout_seconds", "30")
    with Observability(trainer) as obs:
        for step in (1, 2, 3):
            with obs.step(step):
                time.sleep(0.01)
                trainer.state.step, trainer.state.tokens_seen = step, trainer.state.tokens_seen + 512
            trainer.metrics.write({"step": step, "loss": 5.0 - step, "lr": 1e-3})
            with obs.checkpoint():
                pass
            obs.step_done(step)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "completed" and s["error"] is None
    assert (s["step"], s["steps_total"], s["steps_this_run"], s["tokens_seen"]) == (3, 3, 3, 1536)
    assert s["checkpoints_saved"] == 2 and s["skipped_steps"] == 0 and s["last_loss"] == 2.0
    assert s["tps_mean"] > 0 and s["mfu_mean"] > 0  # mean over steps 2-3 (after the first)
    assert s["outputs"]["metrics"].endswith("metrics.jsonl") and "watchdog" not in s["outputs"]
    line = next(x for x in trainer_log if x.startswith("run summary:"))
    assert "completed; step 3/3 (3 this run)" in line and "1,536 tokens" in line and "2 checkpoint(s)" in line


def test_config_checks(tmp_path):
    for args in (["--profiling.enable_profiling", "--profiling.profile_freq", "3", "--profiling.profiler_warmup", "3"],
                 ["--comm.watchdog_timeout_seconds", "-1"]):
        with pytest.raises(ConfigError):
            validate(fake_trainer(tmp_path, *args, metrics=False).config)


def test_wandb_missing_package_warns_and_continues(tmp_path, monkeypatch, trainer_log):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    config = load_config(["--metrics.enable_wandb", "--job.dump_folder", str(tmp_path)], env={})
    assert build_wandb_writer(config, tmp_path) is None
    assert any("wandb package is not installed" in line for line in trainer_log)


def test_wandb_writer_logs_numbers_and_resumes_the_same_run(tmp_path, monkeypatch):
    calls = []
    run = types.SimpleNamespace(finish=lambda: calls.append(("finish",)))
    fake = types.SimpleNamespace(init=lambda **kw: (calls.append(("init", kw)), run)[1],
                                 log=lambda values, step: calls.append(("log", step, values)))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    config = load_config(["--metrics.enable_wandb", "--job.dump_folder", str(tmp_path)], env={})
    metrics = MetricsWriter(tmp_path, enabled=True, tensorboard_dir=None)
    metrics.add_sink(build_wandb_writer(config, tmp_path))
    metrics.write({"step": 4, "loss": 1.5, "skipped": False, "skip_reason": "x", "mfu": None})
    metrics.close()
    assert calls[1] == ("log", 4, {"loss": 1.5, "skipped": 0.0}) and calls[2] == ("finish",)
    first_id = calls[0][1]["id"]
    build_wandb_writer(config, tmp_path)
    assert calls[3][1]["id"] == first_id and calls[3][1]["resume"] == "allow"


# --------------------------------------------------------------------------------------------------
# Console logging
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def restore_logging():
    logger = logging.getLogger("trainer")
    saved = (list(logger.handlers), logger.level, logger.propagate, warnings.showwarning)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
    warnings.showwarning = saved[3]


def test_console_lines_have_time_and_rank_warnings_once_no_color_off_terminal(capsys, monkeypatch, restore_logging):
    monkeypatch.setenv("RANK", "2")
    logger = logs.setup()
    for _ in range(3):
        logger.warning("same warning")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = logs._show_warning
        for _ in range(3):
            warnings.warn("library says something", UserWarning)
    record = {"step": 5, "loss": 2.5, "grad_norm": 0.5, "lr": 1e-3, "tps": 1234.0, "tflops": 1.0, "mfu": 40.0,
              "memory": 3.2, "eta": "00:01:00"}
    logger.info(console_line(record, use_color(False)))
    lines = capsys.readouterr().out.splitlines()
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[rank 2\] ", line) for line in lines), lines
    assert sum("same warning" in line for line in lines) == 1
    assert sum("UserWarning: library says something" in line for line in lines) == 1
    step_line = lines[-1]
    assert "\033[" not in step_line  # not a terminal: no color
    for part in ("step      5", "loss 2.5000", "grad_norm 0.500", "lr 1.00e-03", "tps 1,234", "mfu 40.0%",
                 "mem 3.20GiB", "eta 00:01:00"):
        assert part in step_line
    assert "\033[" in console_line(record, True)


# --------------------------------------------------------------------------------------------------
# GPU only (skipped on CPU machines)
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_memory_history_snapshot_and_real_oom(tmp_path):
    cfg = types.SimpleNamespace(enable_memory_snapshot=True, profile_freq=2)
    snaps = MemorySnapshots(cfg, tmp_path, 0, use_cuda=True)
    snaps.start()
    try:
        x = torch.randn(1024, 1024, device="cuda")
        snaps.maybe_dump(2)
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB
        except torch.cuda.OutOfMemoryError:
            snaps.on_oom(3)
        del x
    finally:
        snaps.stop()
    for name in ("iteration_2", "iteration_3_exit"):
        with open(tmp_path / name / "rank0_memory_snapshot.pickle", "rb") as f:
            snapshot = pickle.load(f)
        assert snapshot["segments"] and any(snapshot["device_traces"])


@pytest.mark.gpu
def test_cuda_profiler_trace_has_kernels(tmp_path):
    cfg = types.SimpleNamespace(enable_profiling=True, profile_freq=2, profiler_warmup=1, profiler_active=1)
    prof = Profiler(cfg, tmp_path, 0, 1, use_cuda=True)
    prof.start()
    x = torch.randn(256, 256, device="cuda")
    for step in (1, 2):
        with record_function("forward"):
            x = torch.tanh(x @ x)
        torch.cuda.synchronize()
        prof.step(step)
    prof.stop()
    events = json.loads((tmp_path / "iteration_2" / "rank0_trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events) and any(e.get("name") == "forward" for e in events)


CRASH_SCRIPT = """
import sys, types
from trainer.observability.session import crash_for_drill
debug = types.SimpleNamespace(crash_at_step=3, crash_rank=1)
for step in (1, 2, 3, 4):
    crash_for_drill(debug, int(sys.argv[1]), step)
    print(step, flush=True)
"""


@pytest.mark.parametrize("rank, restarts, steps, code", [
    (1, "0", "1\n2\n", -signal.SIGKILL), (0, "0", "1\n2\n3\n4\n", 0), (1, "1", "1\n2\n3\n4\n", 0),
], ids=["drilled-rank", "other-rank", "restarted"])
def test_crash_drill_kills_its_rank_before_the_step_on_the_first_attempt_only(rank, restarts, steps, code):
    """debug.crash_at_step (run by the observability session before each step): the drilled rank dies by
    SIGKILL before that step, only on torchrun's first attempt; other ranks and a restarted one go on."""
    env = {**os.environ, "TORCHELASTIC_RESTART_COUNT": restarts}
    proc = popen([sys.executable, "-c", CRASH_SCRIPT, str(rank)], env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=QUICK_S)
    assert proc.returncode == code and out == steps
