"""``trainer bench vs-torchtitan``: our trainer's steady step against torchtitan's, same shape and settings.

Each trainer runs in a process of its own, one after the other, alternating which goes first, ``repeats``
pairs. Both train torchtitan's ``debugmodel`` flavor, which is the same model in both (dim 256, 6 layers,
16 heads, vocabulary 2048, Llama 3.1 RoPE scaling; the bundled BPE tokenizer) in float32 on one rank, with AdamW (fused, lr 3e-3, weight decay 0.1 on every
parameter, as torchtitan decays: ``optimizer.weight_decay_norms_and_biases`` here), clipping at
1.0, a 5-step warm-up, ``seq_len`` 256 x 8 sequences, no activation checkpointing, no compile, tokenizing
the bundled Shakespeare sample on the fly in the training process, logging every 5 steps:

* *ours*: :class:`trainer.train.Trainer`, ``Trainer.run_step`` inside the observability session (as
  :mod:`trainer.tools.bench.processes` runs it);
* *torchtitan*: ``torchtitan.train.Trainer`` built by its own ``ConfigManager``; the body of its
  ``Trainer.train`` loop per step (``gc_handler.run``, ``train_step``, ``checkpointer.save``).

Each process warms up, then times cycles of ``log_freq`` steps with the GC off; it reports its median
step time (wall clock and process CPU time) and its peak resident memory. Then :func:`compare_losses`
trains both from the same initial weights on the same batches (ours drawn from our loader) and reports
their losses, learning rates and gradient norms step by step. torchtitan is not a dependency:
this suite runs when ``import torchtitan`` works (for example ``pip install --no-deps torchtitan==0.2.2``
into a folder on ``PYTHONPATH``) and otherwise says so in one line. torchtitan 0.2.2 assumes an
accelerator; :func:`_patch_torchtitan_for_cpu` adapts it at run time (its files stay as they are).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import resource
import statistics
import sys
import types
from typing import Any

import torch

from trainer.torch_compat import report_cpu_as_the_device_type

from .common import ROOT, _quiet, single_rank_env
from .processes import _cycle_times, _run_worker, best_cycle_ratio

TOKENIZER_DIR = ROOT / "tokenizer" / "assets" / "debug_bpe"
SETTINGS = {"seq_len": 256, "local_batch_size": 8, "lr": 3e-3, "weight_decay": 0.1, "max_norm": 1.0,
            "warmup_steps": 5, "log_freq": 5}


def torchtitan_version() -> str | None:
    if importlib.util.find_spec("torchtitan") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return "unknown"


class _CpuDevice(types.SimpleNamespace):
    """What torchtitan asks of ``torch.cuda`` that ``torch.cpu`` lacks: a name, a capacity, memory stats."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(*_):
        return "cpu"

    @staticmethod
    def get_device_properties(*_):
        return types.SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(*_):
        from collections import defaultdict

        return defaultdict(int)

    @staticmethod
    def reset_peak_memory_stats(*_):
        pass

    @staticmethod
    def empty_cache(*_):
        pass


def _patch_torchtitan_for_cpu() -> None:
    """torchtitan 0.2.2 on a CPU-only torch, changed in memory only:

    1. its device lookup falls back to ``"cuda"`` when no accelerator exists: it is made to answer ``"cpu"``
       (and gloo follows from torch's default backend map);
    2. its device module then is ``torch.cpu``, which has no device name, properties or memory statistics
       (the memory monitor asks): :class:`_CpuDevice` answers them;
    3. ``torchtitan.models.moe.kernels`` imports Triton at import time (MoE token permutation only, unused by
       Llama 3): a stand-in module without it.
    """
    report_cpu_as_the_device_type()
    stub = types.ModuleType("torchtitan.models.moe.kernels")

    def _no_triton(*_a, **_k):
        raise RuntimeError("MoE kernels need Triton")

    stub.generate_permute_indices = stub.fill_indices_wrapper = _no_triton
    sys.modules["torchtitan.models.moe.kernels"] = stub
    import torchtitan.train  # noqa: F401  (imports every module that holds device_type / device_module)

    device = _CpuDevice()
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(module, "device_module", None) is torch.cpu:
            module.device_module = device
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", device


def _torchtitan_argv(spec: dict) -> list[str]:
    s = SETTINGS
    data_dir = str(ROOT / "trainer" / "data" / "sample")
    return [
        "--model.name", "llama3", "--model.flavor", "debugmodel", "--model.hf_assets_path", str(TOKENIZER_DIR),
        "--job.dump_folder", spec["dump"], "--training.dataset", "c4_test", "--training.dataset_path", data_dir,
        "--training.seq_len", str(s["seq_len"]), "--training.local_batch_size", str(s["local_batch_size"]),
        "--training.steps", str(spec["horizon"]), "--training.max_norm", str(s["max_norm"]),
        "--training.mixed_precision_param", "float32", "--optimizer.lr", str(s["lr"]),
        "--optimizer.weight_decay", str(s["weight_decay"]), "--lr_scheduler.warmup_steps", str(s["warmup_steps"]),
        "--lr_scheduler.decay_type", "cosine", "--lr_scheduler.min_lr_factor", "0.1",
        "--metrics.log_freq", str(s["log_freq"]), "--activation_checkpoint.mode", "none",
    ]


def torchtitan_worker(spec: dict) -> dict[str, Any]:
    """torchtitan's trainer in this process: warm-up, then timed cycles of its training-loop body."""
    _patch_torchtitan_for_cpu()
    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer

    single_rank_env()
    config = ConfigManager().parse_args(_torchtitan_argv(spec))
    trainer = Trainer(config)
    data_iterator = trainer.batch_generator(trainer.dataloader)

    def steps(_first: int, n: int) -> None:
        for _ in range(n):
            trainer.step += 1
            trainer.gc_handler.run(trainer.step)
            trainer.train_step(data_iterator)
            trainer.checkpointer.save(trainer.step, last_step=False)

    with _quiet():
        steps(1, spec["warmup"])
        times, cpu = _cycle_times(steps, 0, spec["cycles"], SETTINGS["log_freq"], torch.device("cpu"))
    params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
    trainer.close()
    return _result("torchtitan", times, cpu, params)


def _our_config(spec: dict):
    from .common import load_bench_config

    import argparse

    s = SETTINGS
    argv = ["--model.flavor", "debugmodel", "--training.seq_len", str(s["seq_len"]), "--training.local_batch_size",
            str(s["local_batch_size"]), "--training.max_norm", str(s["max_norm"]), "--optimizer.lr", str(s["lr"]),
            "--optimizer.weight_decay", str(s["weight_decay"]), "--optimizer.weight_decay_norms_and_biases",
            "--lr_scheduler.warmup_steps", str(s["warmup_steps"]), "--lr_scheduler.decay_type", "cosine",
            "--lr_scheduler.min_lr_factor", "0.1", "--metrics.log_freq", str(s["log_freq"]),
            "--activation_checkpoint.mode", "none", "--data.num_workers", "0", "--training.dataset", "shakespeare"]
    config = load_bench_config(argparse.Namespace(config=spec["config"]), argv, [], spec["dump"])
    config.training.steps = spec["horizon"]
    return config


def ours_losses_worker(spec: dict) -> dict[str, Any]:
    """Our trainer's first ``steps`` losses; writes its initial weights and the steps' batches for torchtitan."""
    from .common import build_trainer, close_trainer

    trainer = build_trainer(_our_config(spec))
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, spec["weights"])
    batches = [trainer.next_micro_batches() for _ in range(spec["steps"])]
    torch.save([[{"input": b["input"], "labels": b["labels"]} for b in step] for step in batches], spec["batches"])
    queue = iter(batches)
    trainer.next_micro_batches = lambda: next(queue)
    with _quiet():
        outs = [trainer.train_step(step) for step in range(1, spec["steps"] + 1)]
    close_trainer(trainer)
    return {"role": "ours", "losses": [float(o["loss"]) for o in outs], "lrs": [float(o["lr"]) for o in outs],
            "grad_norms": [float(o["grad_norm"]) for o in outs]}


def torchtitan_losses_worker(spec: dict) -> dict[str, Any]:
    """torchtitan's losses from our initial weights on our batches: its own train_step, in its own process."""
    _patch_torchtitan_for_cpu()
    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer

    single_rank_env()
    trainer = Trainer(ConfigManager().parse_args(_torchtitan_argv(spec)))
    weights = torch.load(spec["weights"])
    missing, unexpected = trainer.model_parts[0].load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"weights differ by name: missing {missing}, unexpected {unexpected}")
    found: list[torch.Tensor] = []
    step_fn = trainer.forward_backward_step

    def recorded(*args, **kwargs):
        found.append(step_fn(*args, **kwargs).detach())
        return found[-1]

    trainer.forward_backward_step = recorded
    import torchtitan.distributed.utils as tt_dist

    norms: list[float] = []
    clip = tt_dist.clip_grad_norm_

    def recorded_clip(*args, **kwargs):
        norm = clip(*args, **kwargs)
        norms.append(float(norm))
        return norm

    tt_dist.clip_grad_norm_ = recorded_clip
    losses, lrs = [], []
    with _quiet():
        for step, micro in enumerate(torch.load(spec["batches"]), start=1):
            trainer.step = step
            found.clear()
            lrs.append(float(trainer.lr_schedulers.schedulers[0].get_last_lr()[0]))
            trainer.train_step(trainer.batch_generator([({"input": b["input"]}, b["labels"]) for b in micro]))
            losses.append(float(torch.sum(torch.stack(found))))
    trainer.close()
    return {"role": "torchtitan", "losses": losses, "lrs": lrs, "grad_norms": norms}


def compare_losses(workdir: str, config: str, steps: int, timeout: float) -> dict[str, Any]:
    """Both trainers from the same initial weights on the same batches (ours drawn from our loader), settings
    matched (weight decay on every parameter): their losses, step by step, and whether they are bitwise equal."""
    spec = {"config": config, "steps": steps, "horizon": 10 * steps + 10, "weights": f"{workdir}/vs_tt_weights.pt",
            "batches": f"{workdir}/vs_tt_batches.pt"}
    ours = _run_worker({**spec, "role": "ours_losses", "dump": f"{workdir}/vs_tt_losses_ours"}, timeout)
    theirs = _run_worker({**spec, "role": "torchtitan_losses", "dump": f"{workdir}/vs_tt_losses_tt"}, timeout)
    a, b = ours["losses"], theirs["losses"]
    return {"steps": steps, "losses_ours": a, "losses_torchtitan": b, "bitwise_equal": a == b,
            "max_abs_difference": max(abs(x - y) for x, y in zip(a, b)),
            "lr_equal": ours["lrs"] == theirs["lrs"], "grad_norm_equal": ours["grad_norms"] == theirs["grad_norms"],
            "runs": {"ours": ours, "torchtitan": theirs}}


def ours_worker(spec: dict) -> dict[str, Any]:
    from .common import build_trainer, close_trainer, observed, trainer_steps

    s = SETTINGS
    config = _our_config(spec)
    trainer = build_trainer(config)
    with _quiet(), observed(trainer) as obs:
        trainer_steps(trainer, 1, spec["warmup"], obs)
        times, cpu = _cycle_times(lambda first, n: trainer_steps(trainer, first, n, obs), spec["warmup"] + 1,
                                  spec["cycles"], s["log_freq"], trainer.device)
    params = trainer.num_params
    close_trainer(trainer)
    return _result("ours", times, cpu, params)


def _result(role: str, times: list[float], cpu: list[float], params: int) -> dict[str, Any]:
    gc.collect()
    return {"role": role, "step_time_s": statistics.median(times), "cycle_step_times_s": times,
            "cpu_time_per_step_s": statistics.median(cpu), "params": params, "threads": torch.get_num_threads(),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def bench_vs_torchtitan(args, overrides: list[str], workdir: str) -> dict[str, Any]:
    version = torchtitan_version()
    if version is None:
        return {"skipped": "torchtitan is not installed (pip install --no-deps torchtitan==0.2.2; "
                           "see docs/benchmarks.md)"}
    small = args.steps == "small"
    cycles = 1 if small else max(2, int(args.steps) // SETTINGS["log_freq"])
    warmup = 2 if small else 2 * SETTINGS["log_freq"]
    repeats = 1 if small else args.processes
    spec = {"config": str(args.config), "warmup": warmup, "cycles": cycles,
            "horizon": 10 * (warmup + cycles * SETTINGS["log_freq"]) + 10, "threads": args.threads}
    pairs = []
    for r in range(repeats):
        order = ("ours", "torchtitan") if r % 2 == 0 else ("torchtitan", "ours")
        pairs.append({role: _run_worker({**spec, "role": role, "dump": f"{workdir}/vs_tt_{role}_{r}"},
                                        args.case_timeout) for role in order})
    ratios = [p["ours"]["step_time_s"] / p["torchtitan"]["step_time_s"] for p in pairs]
    cpu_ratios = [p["ours"]["cpu_time_per_step_s"] / p["torchtitan"]["cpu_time_per_step_s"] for p in pairs]
    med = statistics.median
    return {
        "torchtitan_version": version, "repeats": repeats, "warmup_steps": warmup, "cycles": cycles,
        "settings": SETTINGS,
        "step_time_ours_s": med(p["ours"]["step_time_s"] for p in pairs),
        "step_time_torchtitan_s": med(p["torchtitan"]["step_time_s"] for p in pairs),
        "ours_vs_torchtitan": med(ratios), "ratio_per_repeat": ratios,
        "ours_vs_torchtitan_best_cycle": best_cycle_ratio(pairs, "ours", "torchtitan"),
        "ours_vs_torchtitan_cpu_time": med(cpu_ratios), "cpu_ratio_per_repeat": cpu_ratios,
        "peak_rss_mib_ours": med(p["ours"]["peak_rss_mib"] for p in pairs),
        "peak_rss_mib_torchtitan": med(p["torchtitan"]["peak_rss_mib"] for p in pairs),
        "params_ours": pairs[0]["ours"]["params"], "params_torchtitan": pairs[0]["torchtitan"]["params"],
        "runs": pairs,
        **_loss_rows(compare_losses(workdir, str(args.config), 3 if small else 10, args.case_timeout)),
    }


def _loss_rows(losses: dict[str, Any]) -> dict[str, Any]:
    """The comparison's numbers as the report's rows (it prints numbers), and the whole comparison."""
    same = lambda key: sum(x == y for x, y in zip(losses["runs"]["ours"][key], losses["runs"]["torchtitan"][key]))  # noqa: E731
    return {"same_weights_steps": losses["steps"], "same_weights_losses_bitwise_equal": same("losses"),
            "same_weights_lrs_bitwise_equal": same("lrs"), "same_weights_grad_norms_bitwise_equal": same("grad_norms"),
            "same_weights_loss_max_abs_difference": losses["max_abs_difference"],
            "losses_from_the_same_weights": losses}
