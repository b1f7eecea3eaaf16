"""``trainer bench eval``: ``trainer eval`` wall time on the same requests with 1 and with 2 processes.

The suite trains the configured model for one step with a checkpoint (``python -m trainer.train``), writes a
perplexity task over passages of the bundled Shakespeare sample into the work folder, then runs
``NGPU=N trainer eval`` on that checkpoint for N = 1 and 2, ``--checkpoint-repeats`` times each, alternating
which goes first. The time compared (median of the repeats; also the fastest of each) is lm-eval's own ``total_evaluation_time_seconds`` (the evaluation,
without the process start and the checkpoint load, which do not shrink with the number of processes). Each
process runs with OMP_NUM_THREADS=1, so 2 processes use 2 cores where 1 uses one: the ratio shows the split,
not extra threads. On a shared machine the wall time follows the other jobs' load; the CPU seconds of the
busiest process (``eval_cpu_ratio_2_over_1``) do not, and are what the wall time would be on idle cores.
The scores of the two must be identical (``same_scores``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import ROOT, _free_port, child_env

SAMPLE = ROOT / "trainer" / "data" / "sample" / "shakespeare_train.jsonl"
TASK = """task: bench_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    validation: bench_ppl.jsonl
output_type: loglikelihood_rolling
validation_split: validation
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: bits_per_byte
"""


def _write_task(folder: Path, docs: int, chars: int) -> None:
    """``docs`` passages of about ``chars`` characters each from the bundled sample, as a local task."""
    folder.mkdir(parents=True, exist_ok=True)
    text = " ".join(json.loads(line)["text"] for line in SAMPLE.read_text().splitlines()[:4000])
    with open(folder / "bench_ppl.jsonl", "w") as f:
        for i in range(docs):
            f.write(json.dumps({"text": text[i * chars:(i + 1) * chars]}) + "\n")
    (folder / "bench_ppl.yaml").write_text(TASK)


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")


def _evaluate(nproc: int, checkpoint: Path, tasks: Path, out: Path, batch: int, max_length: str,
              env: dict[str, str]) -> tuple:
    """(evaluation seconds, CPU seconds of the busiest process, bits per byte) of one ``NGPU=nproc trainer
    eval`` run."""
    _run([sys.executable, "-m", "trainer.cli", "eval", "--model_args", f"checkpoint={checkpoint}",
          "--tasks", "bench_ppl", "--include_path", str(tasks), "--batch_size", str(batch), "--device", "cpu",
          "--max_length", max_length, "--output_path", str(out)], {**env, "NGPU": str(nproc)}, timeout=1800)
    [path] = list(out.rglob("results_*.json"))
    results = json.loads(path.read_text())
    return (float(results["total_evaluation_time_seconds"]), max(results["eval_cpu_seconds_per_process"]),
            results["results"]["bench_ppl"]["bits_per_byte,none"])


def bench_eval(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    small = args.steps == "small"
    work = Path(workdir) / "eval"
    seq_len = "64" if small else "256"
    docs, chars, batch = (8, 200, 4) if small else (128, 2000, 8)
    repeats = 1 if small else max(1, args.checkpoint_repeats)
    env = child_env()
    dump = work / "run"
    _run([sys.executable, "-m", "trainer.train", "--job.config_file", args.config, "--job.dump_folder", str(dump),
          "--training.steps", "1", "--training.seq_len", seq_len, "--training.local_batch_size", "2",
          "--checkpoint.enable", "--checkpoint.interval", "1", "--metrics.enable_tensorboard", "false",
          *overrides], {**env, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port())}, timeout=900)
    _write_task(work / "tasks", docs, chars)
    times: dict[int, list[float]] = {1: [], 2: []}
    cpu: dict[int, list[float]] = {1: [], 2: []}
    scores: dict[int, set] = {1: set(), 2: set()}
    for r in range(repeats):
        for n in ((1, 2) if r % 2 == 0 else (2, 1)):
            seconds, cpu_seconds, bpb = _evaluate(n, dump, work / "tasks", work / f"out_{n}_{r}", batch, seq_len,
                                                  env)
            times[n].append(seconds)
            cpu[n].append(cpu_seconds)
            scores[n].add(bpb)
    one, two = statistics.median(times[1]), statistics.median(times[2])
    return {"eval_requests": f"{docs} passages of ~{chars} characters (bits per byte), max_length {seq_len}",
            "eval_s_1_process": one, "eval_s_2_processes": two, "eval_ratio_2_over_1": two / one,
            # The fastest run of each: on a shared machine, the one least slowed by other work.
            "eval_ratio_2_over_1_fastest": min(times[2]) / min(times[1]),
            "eval_s_each_run": f"1 process: {times[1]}; 2 processes: {times[2]}",
            # CPU seconds of the busiest process: what the wall time would be on otherwise idle cores.
            "eval_cpu_ratio_2_over_1": statistics.median(cpu[2]) / statistics.median(cpu[1]),
            "eval_cpu_s_each_run": f"1 process: {cpu[1]}; 2 processes (busiest): {cpu[2]}",
            "eval_repeats": repeats,
            "same_scores": "yes" if scores[1] == scores[2] and len(scores[1]) == 1 else f"NO: {scores}"}
