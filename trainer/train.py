"""Training entry point: ``torchrun ... -m trainer.train --job.config_file X [--section.key value ...]``.

``Trainer.__init__`` builds everything in the order it is needed and reads top to bottom:
config -> process group and mesh -> tokenizer and data -> model on the meta device -> parallelize ->
materialise and initialise -> optimizer and LR schedule -> checkpoints (resume) -> metrics.
``Trainer.train`` is the loop: data -> forward/backward per micro-batch -> clip -> step -> log -> save.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer import logs
from trainer.callbacks import CallbackList, build_callbacks
from trainer.checkpoint import CheckpointManager, TrainState
from trainer.config import ConfigError, JobConfig, grad_accum_steps, help_text, load_config, to_toml
from trainer.data import build_train_loader, build_val_loader
from trainer.fingerprint import sequence_fingerprint
from trainer.metrics import MetricsWriter, Throughput, console_line, format_eta, memory_gib, peak_tflops, use_color
from trainer.models.llama import Transformer, flops_per_token, get_llama_args, model_num_params
from trainer.optim import LRSchedule, build_optimizer
from trainer.parallel.dims import ParallelDims, device_type
from trainer.parallel.init import init_weights
from trainer.parallel.parallelize import DTYPES, parallelize, validate_tp

logger = logging.getLogger("trainer")


def model_args_for(config: JobConfig, tokenizer_vocab: int | None):
    """The flavor's architecture with its embedding sized for the tokenizer.

    Rows: model.vocab_size if set, else the flavor's published vocabulary, else the tokenizer's
    vocabulary rounded up to a multiple of 64 (faster matmuls). ``tokenizer_vocab`` None skips the check
    that the tokenizer fits (dry runs of presets whose tokenizer file is not on this machine).
    """
    try:
        flavor_args = get_llama_args(config.model.flavor)
    except ValueError as e:
        raise ConfigError(f"model.flavor: {e}") from None
    if config.model.vocab_size > 0:
        vocab, source = config.model.vocab_size, "model.vocab_size"
    elif flavor_args.vocab_size > 0:
        vocab, source = flavor_args.vocab_size, f"flavor {config.model.flavor}"
    elif tokenizer_vocab is not None:
        vocab, source = -(-tokenizer_vocab // 64) * 64, "tokenizer"
    else:
        raise ConfigError(f"model.flavor {config.model.flavor} takes its vocabulary size from the tokenizer; "
                          "set model.tokenizer_path or model.vocab_size")
    if tokenizer_vocab is not None and vocab < tokenizer_vocab:
        raise ConfigError(f"{source} gives {vocab} embedding rows but the tokenizer has {tokenizer_vocab} ids; "
                          "use a matching tokenizer (model.tokenizer_path) or raise model.vocab_size")
    return get_llama_args(flavor_args, vocab_size=vocab, max_seq_len=config.training.seq_len)


def load_tokenizer(config: JobConfig):
    from tokenizer import DEBUG_TOKENIZER_PATH, build_tokenizer

    path = config.model.tokenizer_path or DEBUG_TOKENIZER_PATH
    try:
        return build_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.tokenizer_path: {e}") from None


class Trainer:
    def __init__(self, config: JobConfig):
        self.config = config
        self.dump_folder = Path(config.job.dump_folder)

        # Process group, device and mesh.
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.dims = ParallelDims.from_config(config.parallelism, self.world_size)
        self.device = init_device()
        init_process_group(self.device, config.comm.init_timeout_seconds)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dp_rank = self.dims.dp_mesh.get_local_rank()
        self.is_logging_rank = self.rank == 0
        configure_determinism(config, self.device)
        self.seed = 0 if config.debug.seed is None else config.debug.seed
        self.accum_steps = grad_accum_steps(config, self.dims.dp)
        if self.is_logging_rank:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
            (self.dump_folder / "config.toml").write_text(to_toml(config))

        # Tokenizer and data.
        self.tokenizer = load_tokenizer(config)
        self.train_loader = build_train_loader(config, self.tokenizer, dp_rank=self.dp_rank,
                                               dp_world_size=self.dims.dp)
        self.val_loader = (build_val_loader(config, self.tokenizer, dp_rank=self.dp_rank, dp_world_size=self.dims.dp)
                           if config.validation.enable else None)

        # Model: built on the meta device (no memory), transformed, then materialised shard by shard.
        self.model_args = model_args_for(config, self.tokenizer.vocab_size)
        validate_tp(self.dims, self.model_args.n_heads, self.model_args.num_kv_heads)
        with torch.device("meta"):
            template = Transformer(self.model_args)
            model = Transformer(self.model_args)
        self.num_params = model_num_params(template)
        self.flops_per_token = flops_per_token(self.model_args, config.training.seq_len)
        self.callbacks: CallbackList = build_callbacks(config)
        apply_converters(model, config)
        parallelize(model, self.dims, self.mesh, config)
        model.to_empty(device=self.device)
        init_weights(model, template, self.seed, self.device)
        self.model = model
        self.model_parts = [model]
        self.callbacks.on_model_built(self)
        if config.model.print_after_conversion:
            logger.info("model after conversion and parallelization:\n%s", model)

        # Precision: FSDP casts parameters itself; otherwise autocast on GPU, or on CPU when asked.
        compute_dtype = DTYPES[config.training.mixed_precision_param]
        if self.device.type == "cpu" and not config.explicitly_set("training.mixed_precision_param"):
            compute_dtype = torch.float32
        self.autocast = (
            torch.autocast(self.device.type, dtype=compute_dtype)
            if compute_dtype != torch.float32 and not self.dims.fsdp_enabled
            else contextlib.nullcontext()
        )

        # Optimizer and schedule.
        self.optimizer = build_optimizer(list(model.named_parameters()), config.optimizer)
        self.lr_schedule = LRSchedule(config.lr_scheduler, config.optimizer.lr, config.training.steps)

        # State that checkpoints carry, then resume if the dump folder has a checkpoint.
        self.state = TrainState()
        self.checkpointer = CheckpointManager(config, self)
        self.checkpointer.load()

        # Metrics.
        self.metrics = MetricsWriter(
            self.dump_folder, enabled=self.is_logging_rank,
            tensorboard_dir=self.dump_folder / config.metrics.save_tb_folder if config.metrics.enable_tensorboard else None,
        )
        self.throughput = Throughput(self.flops_per_token, peak_tflops(self.device, config.metrics.peak_tflops))
        self.color = use_color(config.metrics.disable_color_printing)
        logger.info(
            "model %s %s: %s parameters, %s training FLOPs/token at seq_len %d; %s; %d micro-batch(es) of %d "
            "x %d tokens per rank per step",
            config.model.name, config.model.flavor, f"{self.num_params:,}", f"{self.flops_per_token:,}",
            config.training.seq_len, self.dims.describe(), self.accum_steps, config.training.local_batch_size,
            config.training.seq_len,
        )

    # ------------------------------------------------------------------------------------------------
    # One step
    # ------------------------------------------------------------------------------------------------

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of token cross-entropies (float32); callers divide by the step's token count."""
        loss_parallel = self.dims.tp > 1 and not self.config.parallelism.disable_loss_parallel
        ctx = torch.distributed.tensor.parallel.loss_parallel() if loss_parallel else contextlib.nullcontext()
        with ctx:
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")

    def next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        t0 = time.perf_counter()
        batches = [next(self.data_iter) for _ in range(self.accum_steps)]
        self.throughput.data_wait += time.perf_counter() - t0
        return batches

    def forward_backward(self, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Accumulate gradients over the micro-batches; returns this rank's mean token loss (detached)."""
        tokens_per_rank = sum(b["labels"].numel() for b in batches)
        loss_parallel = self.dims.tp > 1 and not self.config.parallelism.disable_loss_parallel
        ctx = torch.distributed.tensor.parallel.loss_parallel() if loss_parallel else contextlib.nullcontext()
        total = torch.zeros((), device=self.device)
        for batch in batches:
            inputs = batch["input"].to(self.device, non_blocking=True)
            labels = batch["labels"].to(self.device, non_blocking=True)
            with self.autocast:
                logits = self.model(inputs)
            # Loss parallel needs backward inside its context too.
            with ctx:
                loss = self.loss_fn(logits, labels) / tokens_per_rank
                loss = self.callbacks.extra_loss(self, logits, loss, tokens_per_rank)
                loss.backward()
            total += loss.detach()
            del logits
        return total

    def clip_grad_norm(self) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(norm, torch.distributed.tensor.DTensor):
            norm = norm.full_tensor()
        if self.config.training.max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.config.training.max_norm, norm, foreach=True)
        return norm

    def train_step(self, step: int) -> dict:
        batches = self.next_micro_batches()
        batches = self.callbacks.on_batches(self, step, batches)
        fingerprint = sum(sequence_fingerprint(b["input"], b["labels"]) for b in batches)
        lr = self.lr_schedule.apply(self.optimizer, step)
        torch.manual_seed(self.seed + step)
        loss = self.forward_backward(batches)
        grad_norm = self.clip_grad_norm()
        skip, reason = self.callbacks.should_skip(self, step, loss, grad_norm)
        if skip:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        tokens = sum(b["labels"].numel() for b in batches)
        self.state.step = step
        self.state.tokens_seen += tokens * self.dims.dp
        if skip:
            self.state.skipped_steps += 1
        self.throughput.tokens += tokens * self.dims.dp / self.world_size  # per device
        self.throughput.steps += 1
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "fingerprint": fingerprint, "skipped": skip,
                "skip_reason": reason}

    # ------------------------------------------------------------------------------------------------
    # Logging and validation
    # ------------------------------------------------------------------------------------------------

    def log_step(self, step: int, out: dict) -> None:
        """All-reduce the step's loss over data-parallel ranks and write one record."""
        dp_group = self.dims.dp_mesh.get_group()
        loss = out["loss"].detach().clone()
        if self.dims.dp > 1:
            dist.all_reduce(loss, group=dp_group)
            loss /= self.dims.dp
        fp = torch.tensor([out["fingerprint"]], dtype=torch.int64)
        if self.dims.dp > 1:
            dist.all_reduce(fp, group=dp_group)  # a CPU tensor: gloo, also on GPU machines
        speed = self.throughput.summary()
        self.throughput.reset()
        remaining = self.config.training.steps - step
        record = {
            "step": step,
            "loss": loss.item(),
            "grad_norm": float(out["grad_norm"]),
            "lr": out["lr"],
            "tokens_seen": self.state.tokens_seen,
            "tps": speed["tps"],
            "mfu": speed["mfu"],
            "tflops": speed["tflops"],
            "step_time_s": speed["step_time_s"],
            "data_wait_s": speed["data_wait_s"],
            "memory": memory_gib(self.device),
            "data_fingerprint": int(fp.item()) % (1 << 53),
            "skipped": bool(out["skipped"]),
            "skipped_steps": self.state.skipped_steps,
            "eta": format_eta(remaining * speed["step_time_s"]),
        }
        if out.get("skip_reason"):
            record["skip_reason"] = out["skip_reason"]
        record.update(self.callbacks.metrics(self, step))
        if self.val_loader is not None and step % self.config.validation.freq == 0:
            record["validation_loss"] = self.validate()
        if self.is_logging_rank:
            logger.info(console_line(record, self.color))
            self.metrics.write({k: v for k, v in record.items() if k != "eta"})

    @torch.no_grad()
    def validate(self) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        for i, batch in enumerate(self.val_loader):
            if 0 <= self.config.validation.steps <= i:
                break
            inputs = batch["input"].to(self.device)
            labels = batch["labels"].to(self.device)
            with self.autocast:
                logits = self.model(inputs)
            total += self.loss_fn(logits, labels)
            count += labels.numel()
        self.model.train()
        if self.dims.dp > 1:
            both = torch.stack([total, count])
            dist.all_reduce(both, group=self.dims.dp_mesh.get_group())
            total, count = both[0], both[1]
        return (total / count.clamp(min=1)).item()

    # ------------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------------

    def train(self) -> None:
        config = self.config
        self.data_iter = iter(self.train_loader)
        gc.disable()
        start_step = self.state.step
        t_start = time.perf_counter()
        if start_step >= config.training.steps:
            logger.info("checkpoint is already at step %d of %d: nothing to train", start_step, config.training.steps)
        self.throughput.reset()
        for step in range(start_step + 1, config.training.steps + 1):
            if step % config.training.gc_freq == 0:
                gc.collect(1)
            out = self.train_step(step)
            last = step == config.training.steps
            if step % config.metrics.log_freq == 0 or last or out["skipped"]:
                self.log_step(step, out)
            self.checkpointer.maybe_save(step, last=last)
            if step == start_step + 1:
                set_train_timeout(config.comm.train_timeout_seconds)
        self.checkpointer.finish()
        self.metrics.close()
        elapsed = time.perf_counter() - t_start
        if self.is_logging_rank:
            logger.info(
                "done: %d steps (%d this run, %.1f s), %s tokens seen, %d skipped; outputs in %s "
                "(metrics.jsonl, %s/, config.toml%s)",
                self.state.step, self.state.step - start_step, elapsed, f"{self.state.tokens_seen:,}",
                self.state.skipped_steps, self.dump_folder.resolve(), config.metrics.save_tb_folder,
                f", {config.checkpoint.folder}/" if config.checkpoint.enable else "",
            )


# --------------------------------------------------------------------------------------------------
# Process setup
# --------------------------------------------------------------------------------------------------


def init_device() -> torch.device:
    if device_type() == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_process_group(device: torch.device, timeout_s: int) -> None:
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    # CPU collectives (fingerprints, loader state) go over gloo even when the GPUs use NCCL.
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def set_train_timeout(seconds: int) -> None:
    """After the first step, a collective that waits this long means a hung rank: fail fast."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timedelta(seconds=seconds), None)
    except Exception as e:  # older/other backends: keep the start-up timeout
        logger.debug("could not shorten the collective timeout: %s", e)


def configure_determinism(config: JobConfig, device: torch.device) -> None:
    seed = 0 if config.debug.seed is None else config.debug.seed
    torch.manual_seed(seed)
    if config.debug.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def apply_converters(model: torch.nn.Module, config: JobConfig) -> None:
    if "quantize.linear.float8" in config.model.converters:
        from trainer.parallel.float8 import convert_to_float8

        convert_to_float8(model, config)


def dry_run(config: JobConfig) -> None:
    """Validate the config and build the model on the meta device without allocating it."""
    tokenizer_vocab = None
    if config.model.tokenizer_path == "" or Path(config.model.tokenizer_path).exists():
        tokenizer_vocab = load_tokenizer(config).vocab_size
    else:
        logger.warning("tokenizer %s not found: checking the model without it", config.model.tokenizer_path)
    args = model_args_for(config, tokenizer_vocab)
    with torch.device("meta"):
        model = Transformer(args)
    world = int(os.environ.get("WORLD_SIZE", 1))
    dims = ParallelDims.from_config(config.parallelism, world)
    validate_tp(dims, args.n_heads, args.num_kv_heads)
    print(json.dumps({
        "flavor": config.model.flavor, "params": model_num_params(model),
        "flops_per_token": flops_per_token(args, config.training.seq_len), "vocab_size": args.vocab_size,
        "layout": dims.describe(), "grad_accum_steps": grad_accum_steps(config, dims.dp), "status": "ok",
    }))


def main(argv: list[str] | None = None) -> int:
    logs.setup()
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    try:
        config = load_config(argv)
        if config.job.print_config:
            print(to_toml(config))
            return 0
        if config.job.dry_run:
            dry_run(config)
            return 0
        trainer = Trainer(config)
        trainer.train()
    except ConfigError as e:
        logger.error("config error: %s", e)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
