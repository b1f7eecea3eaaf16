"""What every ``trainer bench`` suite shares: the environment, the benchmark config, the trainer stepped as
``Trainer.train`` steps it, the bare PyTorch loop it is compared with, and interleaved timing."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import platform
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from trainer.config import load_config, validate
from trainer.parallel import clean_fqn

logger = logging.getLogger("trainer")

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CONFIG = ROOT / "train_configs" / "debug_model.toml"
SMALL = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.log_freq", "2"]


# --------------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_rank_env() -> None:
    """Environment for a one-process gloo/NCCL group (a free port, so parallel runs do not collide)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if os.environ["WORLD_SIZE"] != "1":
        raise SystemExit("trainer bench runs as a single process (WORLD_SIZE=1)")


def child_env() -> dict[str, str]:
    """The environment of a suite's own training or evaluation processes: one thread each (so N processes use
    N cores), this checkout importable, quiet logging, and none of this process's own torchrun variables."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "LOGLEVEL": "WARNING"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    with contextlib.suppress(OSError):
        info["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    with contextlib.suppress(Exception):
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                            text=True, timeout=10).stdout.strip() or None
    return info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _quiet():
    """Keep the trainer's per-step console lines out of the benchmark table (they are still formatted)."""
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_bench_config(args, overrides: list[str], extra: list[str], dump: str):
    """The benchmark's config: the file, then the suite's settings, then the user's overrides."""
    base = ["--job.config_file", str(args.config), "--job.dump_folder", dump,
            "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false"]
    config = load_config(base + extra + list(overrides), env={})
    validate(config)
    return config


def build_trainer(config, single_rank: bool = True):
    """The real Trainer for ``config``, its data iterator started; ``single_rank``: in a one-process group of its
    own (else in the one torchrun's variables describe)."""
    from trainer.train import Trainer

    if single_rank:
        single_rank_env()
    with _quiet():
        trainer = Trainer(config)
    trainer.data_iter = iter(trainer.train_loader)
    return trainer


def close_trainer(trainer) -> None:
    with contextlib.suppress(Exception):
        trainer.checkpointer.finish()
    with contextlib.suppress(Exception):
        trainer.metrics.close()
    with contextlib.suppress(Exception):
        trainer.train_loader.close()


class _NoObservability:
    """Stands in for trainer.observability.Observability where a suite runs steps outside a session."""

    @contextlib.contextmanager
    def step(self, step):
        yield

    @contextlib.contextmanager
    def checkpoint(self):
        yield

    def step_done(self, step):
        pass


def trainer_steps(trainer, first: int, n: int, obs=None) -> int:
    """Steps first .. first+n-1 exactly as ``Trainer.train`` runs them (``Trainer.run_step``). ``obs``: an
    entered ``trainer.observability.Observability``, as ``Trainer.train`` holds one; None skips its hooks."""
    obs = obs if obs is not None else _NoObservability()
    step = first
    for step in range(first, first + n):
        trainer.run_step(step, obs)
    return step


@contextlib.contextmanager
def observed(trainer):
    """``Trainer.train``'s observability session (profiler, memory snapshots, watchdog) around a block of
    benchmark steps, when this version of the trainer has one."""
    try:
        from trainer.observability.session import Observability
    except ImportError:
        yield None
        return
    with Observability(trainer.observed_run()) as obs:
        yield obs


# --------------------------------------------------------------------------------------------------
# The bare loop
# --------------------------------------------------------------------------------------------------


def bare_state(trainer) -> dict[str, torch.Tensor]:
    return {clean_fqn(k): v.detach().clone() for k, v in trainer.model.state_dict().items()}


def lr_factors(trainer, steps: int) -> list[float]:
    schedule = trainer.lr_schedule  # a pure function of the step: the same learning rates
    return [schedule.factor(i + 1) for i in range(steps + 1)]


class BareLoop:
    """A training loop with no framework: the model class, AdamW, clipping, a list of batches."""

    def __init__(self, config, model_args, state: dict[str, torch.Tensor], lr_factors: list[float],
                 device: torch.device, dtype: torch.dtype, accum: int, batches: list[dict[str, torch.Tensor]]):
        """``state``: the initial weights (plain FQNs); ``lr_factors[i]``: the schedule's factor of step i+1."""
        from trainer.models.llama.model import Transformer

        self.device = device
        self.accum = accum
        self.log_freq = config.metrics.log_freq
        self.max_norm = config.training.max_norm
        with torch.device(self.device):
            model = Transformer(model_args)
        # Model-level choices that change the computation are mirrored, so that both loops compute the same:
        # float8 Linear layers, activation checkpointing, per-block compile (thin wrappers over torchao,
        # torch.utils.checkpoint and torch.compile).
        if config.model.converters:
            from trainer.setup import apply_converters

            apply_converters(model, config)
        model.load_state_dict(state)
        if config.activation_checkpoint.mode != "none":
            from trainer.parallel.parallelize import apply_ac

            apply_ac(model, config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option)
        if config.compile.enable:
            for name, block in list(model.layers.items()):
                model.layers[name] = torch.compile(block, backend=config.compile.backend, fullgraph=True)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        o = config.optimizer
        kind = {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(o.implementation, {"foreach": False})
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in self.params if p.ndim >= 2], "weight_decay": o.weight_decay},
             {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **kind)
        last = len(lr_factors) - 1
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda i: lr_factors[min(i, last)])
        self.autocast = (torch.autocast(self.device.type, dtype=dtype) if dtype != torch.float32
                         else contextlib.nullcontext())
        if self.device.type == "cuda":
            batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
        self.data = itertools.cycle(batches)
        self.last_loss: float | None = None

    @classmethod
    def from_trainer(cls, trainer, batches: list[dict[str, torch.Tensor]], steps: int) -> "BareLoop":
        """The bare loop of a trainer's model: its initial weights, settings and learning rates."""
        return cls(trainer.config, trainer.model_args, bare_state(trainer), lr_factors(trainer, steps),
                   trainer.device, trainer.compute_dtype, trainer.accum_steps, batches)

    def step(self, step: int) -> torch.Tensor:
        batches = [next(self.data) for _ in range(self.accum)]
        tokens = sum(b["labels"].numel() for b in batches)
        total = torch.zeros((), device=self.device)
        for b in batches:
            inputs = b["input"].to(self.device, non_blocking=True)
            labels = b["labels"].to(self.device, non_blocking=True)
            with self.autocast:
                logits = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum") / tokens
            loss.backward()
            total += loss.detach()
            del logits
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm if self.max_norm > 0 else float("inf"),
                                       foreach=True)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if step % self.log_freq == 0:
            self.last_loss = total.item()  # what printing the loss costs
        return total

    def steps(self, first: int, n: int) -> None:
        for step in range(first, first + n):
            self.step(step)


# --------------------------------------------------------------------------------------------------
# Suite: framework overhead
# --------------------------------------------------------------------------------------------------


def _timed_cycles(contenders: dict[str, Callable[[int, int], None]], cycles: int, cycle_len: int, device,
                  first_step: int, chunk: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall-clock and process-CPU seconds per step of each contender, one value per cycle of ``cycle_len``
    steps (= metrics.log_freq, so every cycle of every contender holds one logged step).

    Within a cycle the contenders take turns every ``chunk`` steps, in an order that rotates each turn: on
    a shared machine a burst of load then slows all of them alike. (On CPU chunk is 1; on a GPU a whole
    cycle, so that the host can run ahead of the device as in training.) CPU time counts this process's
    threads only: what the contender itself costs, whatever else runs on the machine."""
    names = list(contenders)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    steps = {n: first_step for n in names}
    turn = 0
    gc.collect()
    gc.disable()
    try:
        for _ in range(cycles):
            w = dict.fromkeys(names, 0.0)
            c = dict.fromkeys(names, 0.0)
            for _ in range(0, cycle_len, chunk):
                order = names[turn % len(names):] + names[:turn % len(names)]
                turn += 1
                for name in order:
                    _sync(device)
                    t0, c0 = time.perf_counter(), time.process_time()
                    contenders[name](steps[name], chunk)
                    _sync(device)
                    w[name] += time.perf_counter() - t0
                    c[name] += time.process_time() - c0
                    steps[name] += chunk
            for name in names:
                wall[name].append(w[name] / cycle_len)
                cpu[name].append(c[name] / cycle_len)
    finally:
        gc.enable()
    return wall, cpu
