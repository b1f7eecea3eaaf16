"""``trainer bench context-parallel``: one long sequence split over 1, 2 and 4 context-parallel ranks.

The configured model (the debug model by default) trains on a global batch of one sequence of
``--cp-seq-len`` tokens (8192 by default) at CP 1, 2 and 4, with causal and with ``block_causal`` attention,
CP > 1 with both rotate methods (``allgather``, ``alltoall``). Each case is a real ``torchrun`` job over
gloo (``trainer.train.Trainer``, stepped as ``Trainer.train`` steps it), each rank one process with
``OMP_NUM_THREADS=1``: CP 2 runs on two cores where CP 1 runs on one, so the step-time ratio shows what the
split buys, not extra threads.

Per case:

* **step time**: after ``--cp-warmup`` steps, the wall time of ``--cp-steps`` steps, each between two
  barriers (the slowest rank's), median; ``cp_time_ratio`` is that over CP 1's with the same mask. On a
  machine with fewer cores than ranks (CP 4 on two cores) the ranks share cores and the ratio says nothing.
* **memory per rank**: one more step under torch's memory tracker (``FSDPMemTracker``, the one
  ``trainer simulate`` uses under fake tensors), here over the real tensors: the peak of every live tensor
  (parameters, gradients, optimizer state, gathered weights, activations), the largest over the ranks;
  ``trainer plan``'s estimate for the same config and CP degree beside it (``plan_over_measured``). The
  processes' peak resident memory (libraries and allocator included) is recorded too.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import ROOT, _free_port, _quiet, child_env

DEGREES = (1, 2, 4)
MASKS = ("causal", "block_causal")
METHODS = ("allgather", "alltoall")


def cases(degrees=DEGREES) -> list[tuple[str, int, str | None]]:
    """(mask, CP degree, rotate method; None at CP 1) of every case."""
    return [(mask, cp, method) for mask in MASKS for cp in degrees
            for method in ((None,) if cp == 1 else METHODS)]


def case_argv(config: str, dump: Path, seq_len: int, mask: str, cp: int, method: str | None,
              overrides: list[str]) -> list[str]:
    argv = ["--job.config_file", config, "--job.dump_folder", str(dump), "--training.seq_len", str(seq_len),
            "--training.local_batch_size", "1", "--training.global_batch_size", "1",
            "--training.mixed_precision_param", "float32", "--training.steps", "1000",
            "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1000", "--checkpoint.enable", "false",
            "--model.attn_mask_type", mask, "--parallelism.context_parallel_degree", str(cp)]
    if method is not None:
        argv += ["--parallelism.context_parallel_rotate_method", method]
    return argv + list(overrides)


def rank_worker(spec: dict) -> dict[str, Any]:
    """One rank of a case (started by torchrun): warm up, time steps between barriers, then one step under
    the memory tracker. Writes its result to ``<out>/rank<k>.json``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from trainer import torch_compat
    from trainer.config import load_config
    from trainer.config.validate import validate
    from trainer.tools.simulate.step import buckets

    from .common import _NoObservability, build_trainer, close_trainer, trainer_steps

    config = load_config(spec["argv"], env={})
    validate(config, int(os.environ["WORLD_SIZE"]))
    trainer = build_trainer(config, single_rank=False)
    obs, step, times = _NoObservability(), 1, []
    with _quiet():
        trainer_steps(trainer, 1, spec["warmup"])
        for step in range(spec["warmup"] + 1, spec["warmup"] + spec["steps"] + 1):
            dist.barrier()
            t0 = time.perf_counter()
            trainer.run_step(step, obs)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        part = trainer.model_parts[0]
        tracker = torch_compat.phase_memory_tracker(part if isinstance(part, FSDPModule) else None,
                                                    trainer.model_parts, trainer.optimizer, lambda: "step")
        with tracker:
            trainer.run_step(step + 1, obs)
    peak = buckets(next(iter(tracker.get_tracker_snapshot("peak").values())))
    rank = dist.get_rank()
    result = {"rank": rank, "step_s": times, "peak_bytes": peak,
              "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    close_trainer(trainer)
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    return result


def _run_case(argv: list[str], nproc: int, out: Path, warmup: int, steps: int, timeout: float) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    spec = {"argv": argv, "out": str(out), "warmup": warmup, "steps": steps}
    env = child_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "-m", "trainer.tools.bench",
           "_cp_rank", json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"CP {nproc} case failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def plan_total_gib(argv: list[str], cp: int) -> float:
    """``trainer plan --device cpu``'s memory per rank (GiB) for the case's config on ``cp`` ranks."""
    from trainer.config import load_config
    from trainer.tools.plan.cli import plan

    return float(plan(load_config(argv, env={}), cp, device="cpu")["configured"]["estimate_gib"]["total"])


def bench_context_parallel(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    small = args.steps == "small"
    seq_len = 256 if small else args.cp_seq_len
    degrees = (1, 2) if small else DEGREES
    warmup, steps = (1, 1) if small else (args.cp_warmup, args.cp_steps)
    from trainer.config import load_config
    from trainer.config.validate import validate

    planned = []
    for mask, cp, method in cases(degrees):  # every case's config checked before any runs (ConfigError: one line)
        name = f"{mask}_cp{cp}" + (f"_{method}" if method else "")
        argv = case_argv(args.config, Path(workdir) / "cp" / name / "run", seq_len, mask, cp, method, overrides)
        validate(load_config(argv, env={}), cp)
        planned.append((mask, cp, method, name, argv))
    rows, baseline = [], {}
    for mask, cp, method, name, argv in planned:
        ranks = _run_case(argv, cp, Path(workdir) / "cp" / name, warmup, steps if cp <= 2 or small else 1,
                          timeout=args.case_timeout * (steps + warmup + 2))
        each = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]  # the slowest rank's
        step_s = statistics.median(each)
        peak = max(ranks, key=lambda r: r["peak_bytes"]["total"])["peak_bytes"]
        measured_gib = peak["total"] / 2**30
        planned = plan_total_gib(argv, cp)
        if cp == 1:
            baseline[mask] = step_s
        row = {"case": name, "mask": mask, "cp": cp, "method": method or "-", "step_s": round(step_s, 3),
               "step_s_each": [round(t, 3) for t in each],
               "cp_time_ratio": round(step_s / baseline[mask], 3) if mask in baseline else None,
               "peak_gib_measured": round(measured_gib, 4), "peak_gib_plan": round(planned, 4),
               "plan_over_measured": round(planned / measured_gib, 3),
               "measured_by_kind_gib": {k: round(v / 2**30, 4) for k, v in peak.items() if k != "total"},
               "max_rss_gib": round(max(r["max_rss_gib"] for r in ranks), 3)}
        rows.append(row)
        print(f"  {name:<28} step {row['step_s']:>8.2f} s  x{row['cp_time_ratio']}  peak {measured_gib:.3f} GiB "
              f"(plan {planned:.3f}, {row['plan_over_measured']}x)  rss {row['max_rss_gib']} GiB", flush=True)
    return {"cp_seq_len": seq_len, "cp_steps_timed": steps, "cp_cases": rows,
            "cp_time_ratio_cp2_worst": max(r["cp_time_ratio"] for r in rows if r["cp"] == 2),
            "cp_plan_over_measured_range": [min(r["plan_over_measured"] for r in rows),
                                            max(r["plan_over_measured"] for r in rows)]}
