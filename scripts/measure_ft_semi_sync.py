"""The loss of semi-synchronous training (local_sgd, diloco) against plain HSDP on the debug model.

    .venv/bin/python scripts/measure_ft_semi_sync.py [--steps 50] [--sync-steps 5] [--folder /tmp/ft_semi_sync]

Plain HSDP: one launch of 2 processes (data_parallel_replicate_degree 2, local batch 4: global batch 8).
local_sgd and diloco: a lighthouse and 2 replica groups of 1 process (run_train.sh each, local batch 4, the
same global batch and data). Printed per method: the mean loss of the last 5 steps (over both groups for the
semi-synchronous runs, each of which logs its own loss) and its ratio to plain HSDP's.

--outer LR,MOMENTUM also runs diloco with that outer optimizer (fault_tolerance.outer_lr and outer_momentum:
SGD, Nesterov when MOMENTUM > 0) instead of the default lr 0.7, momentum 0.9 (torchtitan's). With --outer 1,0
DiLoCo's update is the average of the groups' parameters, which is exactly local_sgd: its loss must match
local_sgd's, which checks the fragments, the pseudo-gradients' averaging and the sync_steps counting.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_ft_recovery import free_port, launch  # noqa: E402


def losses(metrics: Path) -> dict[int, float]:
    out = {}
    for line in metrics.read_text().splitlines():
        if line.strip().endswith("}"):
            r = json.loads(line)
            if "loss" in r:
                out[r["step"]] = r["loss"]
    return out


def last_mean(per_group: list[dict[int, float]], total: int, last: int = 5) -> float:
    values = [g[s] for g in per_group for s in range(total - last + 1, total + 1)]
    return sum(values) / len(values)


def plain(folder: Path, total: int) -> float:
    dump = folder / "hsdp"
    proc = launch(["--job.dump_folder", str(dump), "--training.steps", str(total),
                   "--parallelism.data_parallel_replicate_degree", "2"], {}, folder / "hsdp.log", nproc=2)
    if proc.wait():
        raise SystemExit(f"plain HSDP failed: see {folder / 'hsdp.log'}")
    return last_mean([losses(dump / "metrics.jsonl")], total)


def semi_sync(folder: Path, total: int, method: str, sync_steps: int, outer: str | None = None) -> float:
    port = free_port()
    lighthouse = subprocess.Popen([sys.executable, "-m", "trainer.cli", "lighthouse", "--port", str(port)],
                                  stdout=(folder / f"lighthouse_{method}.log").open("w"), stderr=subprocess.STDOUT)
    name = method if outer is None else f"{method}_outer_{outer.replace(',', '_')}"
    dump = folder / name
    env = {"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
    extra = []
    if outer is not None:
        lr, momentum = outer.split(",")
        extra = ["--fault_tolerance.outer_lr", lr, "--fault_tolerance.outer_momentum", momentum]
    try:
        groups = [launch(["--job.dump_folder", str(dump), "--training.steps", str(total), "--fault_tolerance.enable",
                          "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", str(r),
                          "--fault_tolerance.semi_sync_method", method, "--fault_tolerance.sync_steps",
                          str(sync_steps), *extra], env,
                         folder / f"{name}_{r}.log") for r in (0, 1)]
        if any(g.wait() for g in groups):
            raise SystemExit(f"{name} failed: see {folder}/{name}_*.log")
    finally:
        lighthouse.kill()
    return last_mean([losses(dump / f"replica_{r}" / "metrics.jsonl") for r in (0, 1)], total)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--sync-steps", type=int, default=5)
    parser.add_argument("--methods", default="local_sgd,diloco")
    parser.add_argument("--outer", action="append", default=[], metavar="LR,MOMENTUM")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/ft_semi_sync"))
    args = parser.parse_args()
    shutil.rmtree(args.folder, ignore_errors=True)
    args.folder.mkdir(parents=True)
    base = plain(args.folder, args.steps)
    print(f"steps {args.steps}, sync_steps {args.sync_steps}; mean loss of the last 5 steps")
    print(f"{'plain HSDP 2 x 1':<18} {base:.4f}", flush=True)
    for method in filter(None, args.methods.split(",")):
        loss = semi_sync(args.folder, args.steps, method, args.sync_steps)
        print(f"{method:<18} {loss:.4f}  {100 * (loss / base - 1):+.1f} %", flush=True)
    for outer in args.outer:
        loss = semi_sync(args.folder, args.steps, "diloco", args.sync_steps, outer)
        print(f"{'diloco outer ' + outer:<18} {loss:.4f}  {100 * (loss / base - 1):+.1f} %", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
