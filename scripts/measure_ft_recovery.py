"""Kill one replica group and time what it costs, with [fault_tolerance] and with a full torchrun restart.

    .venv/bin/python scripts/measure_ft_recovery.py [--steps 100] [--kill-after 6] [--folder /tmp/ft_recovery]

Fault tolerance: a lighthouse and 2 replica groups of 1 process (run_train.sh each); after step
--kill-after, kill -9 of group 1 (launcher and worker), started again at once. Printed: how long group 0
stalled (kill -> its next step), and kill -> group 1 stepping again (its restart, then the recovery from
group 0). Full restart: the same job as plain HSDP (2 processes, dp_replicate 2) with checkpoints every 5
steps and MAX_RESTARTS=1; rank 1 SIGKILLs itself before step --kill-after + 1 (debug.crash_at_step), torchrun
restarts both, and they resume from the last checkpoint. Printed: kill -> the job back at the step it died
in. Times are wall-clock seconds read by polling metrics.jsonl every 50 ms, on this machine as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false"]


def steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip().endswith("}")]


def wait(predicate, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.05)
    return time.monotonic()


def launch(args: list[str], env: dict, log: Path, nproc: int = 1) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NGPU": str(nproc), "PYTHON": sys.executable, **env}
    return subprocess.Popen([str(ROOT / "run_train.sh"), *FAST, *args], cwd=ROOT, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fault_tolerant(folder: Path, total: int, kill_after: int) -> dict:
    port = free_port()
    lighthouse = subprocess.Popen([sys.executable, "-m", "trainer.cli", "lighthouse", "--port", str(port),
                                   "--heartbeat_timeout_ms", "1000", "--join_timeout_ms", "2000"],
                                  stdout=(folder / "lighthouse.log").open("w"), stderr=subprocess.STDOUT)
    env = {"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
    dump = folder / "ft"

    def group(r: int) -> subprocess.Popen:
        return launch(["--job.dump_folder", str(dump), "--training.steps", str(total), "--fault_tolerance.enable",
                       "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", str(r)], env,
                       folder / f"group{r}.log")

    try:
        g0, g1 = group(0), group(1)
        m0, m1 = dump / "replica_0" / "metrics.jsonl", dump / "replica_1" / "metrics.jsonl"
        wait(lambda: max(steps(m0), default=0) >= kill_after and max(steps(m1), default=0) >= kill_after)
        os.killpg(g1.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        at_kill = max(steps(m0))
        g1.wait()
        g1 = group(1)
        t_survivor = wait(lambda: max(steps(m0), default=0) > at_kill)
        t_back = wait(lambda: m1.exists() and steps(m1) and steps(m1)[0] != 1 and steps(m1)[0] > kill_after
                      or g0.poll() is not None)
        if g0.poll() is not None:
            raise SystemExit("group 0 finished before group 1 was back: raise --steps")
        g0.wait(), g1.wait()
        return {"survivor_stall_s": round(t_survivor - t_kill, 2), "kill_to_stepping_s": round(t_back - t_kill, 2),
                "steps_missed_by_group1": steps(m1)[0] - 1 - at_kill}
    finally:
        lighthouse.kill()


def full_restart(folder: Path, total: int, kill_after: int) -> dict:
    dump = folder / "restart"
    proc = launch(["--job.dump_folder", str(dump), "--training.steps", str(total), "--training.local_batch_size",
                   "4", "--parallelism.data_parallel_replicate_degree", "2", "--checkpoint.enable",
                   "--checkpoint.interval", "5", "--debug.crash_at_step", str(kill_after + 1), "--debug.crash_rank",
                   "1"], {"MAX_RESTARTS": "1"}, folder / "restart.log", nproc=2)
    metrics = dump / "metrics.jsonl"
    t_kill = wait(lambda: kill_after in steps(metrics))  # rank 1 kills itself right after this step
    # Back at the step it died in: the restarted job has logged step kill_after + 1.
    t_back = wait(lambda: kill_after + 1 in steps(metrics))
    proc.wait()
    return {"kill_to_stepping_s": round(t_back - t_kill, 2),
            "steps_redone": kill_after - (kill_after // 5) * 5}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kill-after", type=int, default=6)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/ft_recovery"))
    args = parser.parse_args()
    shutil.rmtree(args.folder, ignore_errors=True)
    args.folder.mkdir(parents=True)
    print(json.dumps({"fault_tolerance": fault_tolerant(args.folder, args.steps, args.kill_after),
                      "full_restart": full_restart(args.folder, args.steps, args.kill_after)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
