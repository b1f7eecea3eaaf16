"""Muon against AdamW on the debug model at equal tokens, each at its best learning rate from a small sweep.

Every run is ``./run_train.sh`` on one process with the same data, batches, steps and schedule (warmup, then
cosine decay to 10 %); only the optimizer and the learning rate change. Muon runs Moonlight's recipe: one
learning rate for both parts (``optimizer.lr``, Muon's ``lr`` unset) with ``adjust_lr_fn =
"match_rms_adamw"``. The score of a run is its validation loss after the last step (``validation.steps``
batches of held-out text), and the mean training loss of its last 20 steps is shown beside it. Prints a table
and writes JSON (docs/benchmarks.md has the command and the result)::

    python scripts/bench_muon.py --json muon_vs_adamw.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUON = ["--optimizer.muon.adjust_lr_fn", "match_rms_adamw"]


def run(dump: Path, optimizer: str, lr: float, args) -> dict:
    cmd = [str(ROOT / "run_train.sh"), "--job.dump_folder", str(dump), "--optimizer.name", optimizer,
           "--optimizer.lr", str(lr), "--training.steps", str(args.steps), "--training.seq_len", str(args.seq_len),
           "--training.local_batch_size", str(args.batch), "--lr_scheduler.warmup_steps", str(args.steps // 10),
           "--lr_scheduler.decay_type", "cosine", "--lr_scheduler.min_lr_factor", "0.1",
           "--metrics.log_freq", "10", "--metrics.enable_tensorboard", "false", "--validation.enable",
           "--validation.freq", str(args.steps), "--validation.steps", str(args.val_steps),
           "--debug.seed", "0", *(MUON + ["--optimizer.muon.ns_dtype", args.ns_dtype] if optimizer == "Muon" else [])]
    env = {**os.environ, "NGPU": "1", "CONFIG_FILE": str(ROOT / "train_configs" / "debug_model.toml"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()] if proc.returncode == 0 \
        else []
    if not records:
        return {"optimizer": optimizer, "lr": lr, "failed": proc.returncode, "seconds": round(seconds, 1)}
    last = [r["loss"] for r in records if r["step"] > args.steps - 20]
    return {"optimizer": optimizer, "lr": lr, "val_loss": records[-1].get("validation_loss"),
            "train_loss_last20": sum(last) / len(last), "tokens": records[-1]["tokens_seen"],
            "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--val-steps", type=int, default=10)
    p.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2")
    p.add_argument("--muon-lrs", default="1e-3,3e-3,1e-2,3e-2")
    p.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="optimizer.muon.ns_dtype (default: bfloat16, torch's)")
    p.add_argument("--json", default="muon_vs_adamw.json")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_muon_") as work:
        for optimizer, lrs in (("AdamW", args.adamw_lrs), ("Muon", args.muon_lrs)):
            for lr in (float(x) for x in lrs.split(",")):
                row = run(Path(work) / f"{optimizer}_{lr:g}", optimizer, lr, args)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    best = {}
    for row in rows:
        if row.get("val_loss") is not None:
            if row["optimizer"] not in best or row["val_loss"] < best[row["optimizer"]]["val_loss"]:
                best[row["optimizer"]] = row
    print(f"debug model, {args.steps} steps x {args.batch} x {args.seq_len} tokens, one process, CPU")
    print("| optimizer | lr | validation loss | train loss (last 20 steps) | wall s |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        mark = " (best)" if best.get(row["optimizer"]) is row else ""
        if "failed" in row:
            print(f"| {row['optimizer']} | {row['lr']:g} | failed (exit {row['failed']}) | | {row['seconds']} |")
        else:
            print(f"| {row['optimizer']} | {row['lr']:g}{mark} | {row['val_loss']:.4f} | "
                  f"{row['train_loss_last20']:.4f} | {row['seconds']} |")
    Path(args.json).write_text(json.dumps({"args": vars(args), "runs": rows,
                                           "best": {k: v["lr"] for k, v in best.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
