"""Training entry point: ``torchrun ... -m trainer.train --job.config_file X [--section.key value ...]``.

``Trainer.__init__`` builds everything in the order it is needed and reads top to bottom:
config -> process group and mesh -> tokenizer and data -> model on the meta device -> parallelize ->
materialise and initialise -> optimizer and LR schedule -> checkpoints (resume) -> metrics.
``Trainer.train`` is the loop: data -> forward/backward per micro-batch -> clip -> step -> log -> save.
The step's pieces are free functions in trainer/step.py, process setup and the model-part builder are in
trainer/setup.py: ``trainer simulate`` calls the same ones. ``main`` is the process: the config, then the dry
run (trainer/dry_run.py) or the run, and a failure's one line (trainer/observability/failures.py).
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch's import, which takes seconds (trainer/startup.py)
    from trainer import startup

    startup.begin()

import functools
import gc
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

from trainer import compat, launch, logs, preemption, runlock
from trainer import step as steps  # as a module (``step`` is the step number here): steps.forward_backward ...
from trainer.callbacks import CallbackList, RunView, build_callbacks
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.replicas import ReplicaGroup
from trainer.checkpoint.state import TrainState
from trainer.config import JobConfig, derive, help_text, load_config, to_toml, validate
from trainer.errors import PeerLost, TrainerError
from trainer.fault_tolerance.config import data_parallel, job_identity
from trainer.fault_tolerance.lighthouse_status import QuorumLost
from trainer.fault_tolerance.replicas import build_replicas, check_lighthouse, checkpointed_loader
from trainer.data.loader import build_train_loader, build_val_loader
from trainer.data.checks import grad_accum_steps
from trainer.data.faults import SkipMonitor
from trainer.data.tokenizer import load_tokenizer
from trainer.dry_run import dry_run
from trainer.fingerprint import sequence_fingerprint, wrap_int64
from trainer.metrics import (
    MetricsWriter,
    Throughput,
    console_line,
    format_eta,
    memory_gib,
    peak_tflops,
    set_aside_previous_records,
    use_color,
)
from trainer.models.config import resolve_model_args
from trainer.models.llama.flops import flops_per_token, model_num_params
from trainer.models.llama.model import Transformer
from trainer.models.moe import balance_experts, experts_kernel_note, moe_layers, moe_metrics
from trainer.observability.failures import output_failure, peer_failure
from trainer.observability.flight_recorder import setup_flight_recorder
from trainer.observability.session import Observability, ObservedRun
from trainer.optim.loss_scale import build_loss_scaler
from trainer.optim.muon import muon_metrics
from trainer.optim.optimizer import LRSchedule, build_optimizer
from trainer.parallel.context import shard_batch
from trainer.parallel.dims import ParallelDims, device_type
from trainer.parallel.float8 import register_float8_scale_precompute
from trainer.parallel.parallelize import DTYPES, set_compile_cache
from trainer.parallel.pipeline import schedule_microbatches
from trainer.setup import (
    build_model_parts,
    close_process_group,
    configure_determinism,
    init_device,
    init_process_group,
    seed_step,
    set_train_timeout,
)

logger = logging.getLogger("trainer")


class Trainer:
    def __init__(self, config: JobConfig):
        # The job's dump folder holds its checkpoints; a replica group's outputs go below it (job.dump_folder
        # of the run's config, which holds the derived values and is frozen: trainer/config/derive.py).
        self.job_dump_folder = config.job.dump_folder
        self.config = derive(config, device_type())
        self.dump_folder = Path(self.config.job.dump_folder)
        self.setup_process()  # process group, device, mesh, seeds; the run's config.toml
        self.build_data()  # tokenizer and loaders
        self.build_model()  # meta device -> parallelize -> materialise and initialise
        self.build_optimizer()  # optimizer, LR schedule
        self.build_state()  # callbacks' view, checkpoint manager, resume
        self.build_metrics()  # metrics.jsonl, TensorBoard, throughput

    def setup_process(self) -> None:
        config = self.config
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.dims = ParallelDims.from_config(config.parallelism, self.world_size)
        self.device = init_device()
        setup_flight_recorder(config)  # before the process group reads its variables
        init_process_group(self.device, config.comm.init_timeout_seconds)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dp_rank = self.dims.dp_mesh.get_local_rank()
        # The loader's degree and rank: over every replica group of a fault-tolerant job.
        self.data_dp, self.data_rank = data_parallel(config.fault_tolerance, self.dims.dp, self.dp_rank)
        # A replica group whose lighthouse does not answer, or whose replica_id a live group has, stops
        # here, before it writes anything.
        self.lighthouse = check_lighthouse(config.fault_tolerance)
        self.is_logging_rank = self.rank == 0
        configure_determinism(config, self.device)
        set_compile_cache(config.compile.cache_dir)
        self.seed = config.debug.seed
        self.accum_steps = grad_accum_steps(config, self.data_dp)
        if self.is_logging_rank:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
            (self.dump_folder / "config.toml").write_text(to_toml(config))

    def build_data(self) -> None:
        config = self.config
        self.tokenizer = load_tokenizer(config)
        self.train_loader = build_train_loader(config, self.tokenizer, dp_rank=self.data_rank,
                                               dp_world_size=self.data_dp)
        self.skip_monitor = SkipMonitor(self.train_loader, config, self.dims.dp_mesh.get_group(), self.dims.dp)
        self.val_loader = (build_val_loader(config, self.tokenizer, dp_rank=self.dp_rank, dp_world_size=self.dims.dp)
                           if config.validation.enable else None)

    def build_model(self) -> None:
        """Built on the meta device (no memory), transformed, then materialised shard by shard."""
        config = self.config
        self.model_args = resolve_model_args(config, self.tokenizer.vocab_size)
        with torch.device("meta"):
            template = Transformer(self.model_args)
        self.num_params = model_num_params(template)
        self.flops_per_token = flops_per_token(self.model_args, config.training.seq_len)
        self.callbacks: CallbackList = build_callbacks(config)
        # float16: the loss scale (its state is checkpointed with the callbacks'; None in other precisions)
        self.loss_scaler = build_loss_scaler(config, self.device, self.rank)
        if self.loss_scaler is not None:
            self.callbacks.append(self.loss_scaler)
        # Precision: FSDP casts parameters itself; without FSDP, autocast. CPU runs stay in float32
        # unless the config asks for bf16 explicitly.
        self.compute_dtype = DTYPES[config.training.mixed_precision_param]
        if self.device.type == "cpu" and not config.explicitly_set("training.mixed_precision_param"):
            self.compute_dtype = torch.float32
        self.parallel_loss = steps.uses_loss_parallel(self.dims.tp, config.parallelism.disable_loss_parallel)
        self.loss_fn = steps.loss_fn
        if config.compile.enable and "loss" in config.compile.components and not self.parallel_loss:
            self.loss_fn = torch.compile(steps.loss_fn, backend=config.compile.backend)
        # Callbacks' loss terms; the view they take is built later, with the optimizer (build_state).
        self.extra_loss = lambda logits, loss, tokens: self.callbacks.extra_loss(self.run_view, logits, loss, tokens)
        self.pipeline_loss = steps.PipelineLoss(self.loss_fn, self.extra_loss)
        built = build_model_parts(template, config, self.dims, self.mesh, device=self.device,
                                  compute_dtype=self.compute_dtype, init_seed=self.seed,
                                  pipeline_loss=self.pipeline_loss)
        self.model_parts, self.pp_schedule = built.parts, built.schedule
        self.experts = moe_layers(*self.model_parts)
        if self.pp_schedule is not None:
            self.pipeline_loss.stage_experts = [(part, moe_layers(part)) for part in self.model_parts]
            self.pipeline_loss.microbatches = schedule_microbatches(config)
        self.pp_has_first, self.pp_has_last = built.has_first, built.has_last
        # Without pipelining the whole model is one part; with it, self.model is None.
        self.model = self.model_parts[0] if self.pp_schedule is None else None
        self.pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
        # The step's loss over all ranks (a collective): for the log and for callbacks.
        self.global_loss = functools.partial(steps.global_loss, pp_group=self.pp_group,
                                             dp_group=self.dims.dp_cp_mesh.get_group(), dp=self.dims.dp_cp)
        # Context parallel: the split every stage of this rank shares (None without it).
        self.context_parallel = getattr(self.model_parts[0], "context_parallel", None)
        if config.model.print_after_conversion:
            logger.info("model after conversion and parallelization:\n%s", self.model_parts)
        self.autocast = steps.autocast_context(self.device.type, self.compute_dtype, self.dims.fsdp_enabled)
        note = experts_kernel_note(self.model_args, self.device.type, self.compute_dtype, config.compile.enable)
        if note is not None:
            logger.warning(note)

    def build_optimizer(self) -> None:
        config = self.config
        self.optimizer = build_optimizer([np for part in self.model_parts for np in part.named_parameters()],
                                         config.optimizer)
        self.lr_schedule = LRSchedule(config.lr_scheduler, config.optimizer.lr, config.training.steps)
        register_float8_scale_precompute(self.optimizer, self.model_parts, config)
        if config.optimizer.name == "Muon":
            logger.info("optimizer Muon on the transformer blocks' weight matrices, AdamW on the rest; a stability "
                        "guard's verdict is read on the host every step")
        elif not self.optimizer.skips_on_device:
            logger.info("optimizer.implementation %s: a stability guard's verdict is read on the host every step "
                        "(fused AdamW applies it on the device, with no synchronisation)",
                        config.optimizer.implementation)

    def build_state(self) -> None:
        """The state checkpoints carry, then resume if the dump folder has a checkpoint."""
        self.state = TrainState()
        self.run_view = self.build_run_view()
        self.callbacks.on_model_built(self.run_view)
        ft = self.config.fault_tolerance
        # The lowest replica group taking part in a save step writes the job's checkpoint (self.replicas is
        # built below, after the resume: it starts from the step loaded here).
        replica = ReplicaGroup(ft.replica_id, ft.group_size, self.job_dump_folder,
                               lambda: self.replicas.saves_job_checkpoint()) if ft.enable else None
        self.checkpointer = CheckpointManager(
            self.config, model_parts=self.model_parts, optimizer=self.optimizer, lr_schedule=self.lr_schedule,
            data_loader=checkpointed_loader(ft, self.train_loader, self.dims.dp), train_state=self.state,
            callbacks=self.callbacks, device=self.device, dp_rank=self.dp_rank, pp_degree=self.dims.pp,
            layout=self.dims.describe(), num_params=self.num_params, replica=replica)
        self.checkpointer.load()
        if self.state.resumed_from_step is not None:
            self.callbacks.on_checkpoint_loaded(self.run_view, self.state.resumed_from_step)
        # The other replica groups of a fault-tolerant job (torchft); a no-op for a job without them.
        self.replicas = build_replicas(self.config, self.device, model_parts=self.model_parts,
                                       optimizer=self.optimizer, state=self.state, callbacks=self.callbacks,
                                       dp=self.dims.dp, **({"lighthouse": self.lighthouse} if ft.enable else {}))

    def build_metrics(self) -> None:
        config = self.config
        tensorboard_dir = self.dump_folder / config.metrics.save_tb_folder if config.metrics.enable_tensorboard else None
        if self.is_logging_rank and self.state.step == 0:  # a new run: an earlier one's records are not its own
            moved = set_aside_previous_records(self.dump_folder, tensorboard_dir)
            if moved is not None:
                logger.info("this dump folder held an earlier run's records and no checkpoint to resume: moved "
                            "them to %s", moved)
        self.metrics = MetricsWriter(self.dump_folder, enabled=self.is_logging_rank, tensorboard_dir=tensorboard_dir)
        self.throughput = Throughput(self.flops_per_token, peak_tflops(self.device, config.metrics.peak_tflops))
        self.color = use_color(config.metrics.disable_color_printing)
        logger.info(
            "model %s %s: %s parameters, %s training FLOPs/token at seq_len %d; %s; %d micro-batch(es) of %d "
            "x %d tokens per rank per step",
            config.model.name, config.model.flavor, f"{self.num_params:,}", f"{self.flops_per_token:,}",
            config.training.seq_len, self.dims.describe(), self.accum_steps, config.training.local_batch_size,
            config.training.seq_len,
        )

    def build_run_view(self) -> RunView:
        """What callbacks see of this run (see trainer/callbacks.py)."""
        return RunView(
            config=self.config, model_parts=self.model_parts, model_args=self.model_args, tokenizer=self.tokenizer,
            optimizer=self.optimizer, lr_schedule=self.lr_schedule, state=self.state, device=self.device,
            dims=self.dims, seed=self.seed, dp_rank=self.dp_rank, accum_steps=self.accum_steps,
            pp_microbatches=None if self.pp_schedule is None else schedule_microbatches(self.config),
            global_loss=self.global_loss,
            finish_checkpoints=lambda: self.checkpointer.finish(), pp_schedule=self.pp_schedule,
            pp_has_first=self.pp_has_first, pp_has_last=self.pp_has_last, pp_group=self.pp_group,
            loss_scaler=self.loss_scaler,
        )

    def observed_run(self) -> ObservedRun:
        """What the observability session around the loop reads (profiler, watchdog, summary.json)."""
        return ObservedRun(
            config=self.config, state=self.state, device=self.device, rank=self.rank, world_size=self.world_size,
            is_logging_rank=self.is_logging_rank, metrics=self.metrics, flops_per_token=self.flops_per_token,
            peak_tflops=self.throughput.peak, checkpointer=self.checkpointer,
            extra_summary=lambda: {**self.replicas.summary(), **(self.loss_scaler.summary() if self.loss_scaler else {})})

    # ------------------------------------------------------------------------------------------------
    # One step
    # ------------------------------------------------------------------------------------------------

    def next_micro_batches(self) -> list[dict[str, torch.Tensor]]:
        t0 = time.perf_counter()
        with record_function("data"):
            batches = [next(self.data_iter) for _ in range(self.accum_steps)]
        self.throughput.data_wait += time.perf_counter() - t0
        return batches

    def train_step(self, step: int) -> dict:
        """One optimizer step. Nothing here reads a device value on the host: a guard's verdict stays a
        tensor that the optimizer applies, and losses are read only when logged."""
        batches = self.next_micro_batches()
        batches = self.callbacks.on_batches(self.run_view, step, batches)
        fingerprint = wrap_int64(sum(batch_fingerprint(b) for b in batches))
        lr = self.lr_schedule.apply(self.optimizer, step)
        seed_step(self.seed + step, self.device)
        reason = self.callbacks.skip_before_forward(self.run_view, step)
        if reason is not None:  # known in advance (e.g. stability.skip_steps): data drawn, nothing computed
            skip: bool | torch.Tensor = self.replicas.commit(True)  # every replica group skips it alike
            loss = grad_norm = torch.full((), float("nan"), device=self.device)
            experts = None
        else:
            scale = self.loss_scaler.scale if self.loss_scaler is not None else None
            if self.pp_schedule is None:
                loss = steps.forward_backward(self.model, batches, device=self.device, autocast=self.autocast,
                                              parallel_loss=self.parallel_loss, loss_fn=self.loss_fn,
                                              extra_loss=self.extra_loss, loss_scale=scale,
                                              context_parallel=self.context_parallel)
            else:
                loss = steps.forward_backward_pipeline(
                    self.pp_schedule, batches, pipeline_loss=self.pipeline_loss, device=self.device,
                    autocast=self.autocast, parallel_loss=self.parallel_loss, has_first=self.pp_has_first,
                    has_last=self.pp_has_last, loss_scale=scale, context_parallel=self.context_parallel)
            loss = self.replicas.average(self.model_parts, loss)  # over the replica groups (fault tolerance)
            with record_function("optimizer"):
                grad_norm, skip = steps.clip_and_step(
                    self.model_parts, self.optimizer, max_norm=self.config.training.max_norm, pp_group=self.pp_group,
                    should_skip=lambda norm: self.replicas.commit(
                        self.callbacks.should_skip(self.run_view, step, loss, norm)), scaler=self.loss_scaler)
                experts = balance_experts(self.experts, self.dims.dp_cp_mesh.get_group(), self.dims.dp_cp)
        tokens = sum(b["labels"].numel() for b in batches)
        self.state.tokens_seen += tokens * self.dims.dp * self.replicas.groups_taking_part
        if self.replicas.committed:  # a step a replica group failed in is repeated: the count stays, no skip
            self.state.step = step
            self.state.add_skip(skip)
        self.throughput.tokens += tokens * self.dims.dp / self.world_size  # per device
        self.throughput.steps += 1
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "fingerprint": fingerprint, "skipped": skip,
                "skip_reason": reason, "experts": experts, "tokens": tokens * self.dims.dp}

    # ------------------------------------------------------------------------------------------------
    # Logging and validation
    # ------------------------------------------------------------------------------------------------

    def log_step(self, step: int, out: dict) -> None:
        """All-reduce the step's loss over data-parallel ranks and write one record."""
        health = self.node_health()  # before the reductions below, which make every rank wait for the last
        dp_group = self.dims.dp_mesh.get_group()
        loss = self.global_loss(out["loss"])
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
            "skipped": bool(out["skipped"]),  # a device verdict is read here, on a log step
            "skipped_steps": self.state.skipped_steps,
            "eta": format_eta(remaining * speed["step_time_s"]),
        }
        record.update(health)
        if out.get("skip_reason"):
            record["skip_reason"] = out["skip_reason"]
        record.update(self.callbacks.metrics(self.run_view, step))
        record.update(muon_metrics(self.optimizer, self.mesh))
        if self.model_args.moe is not None:  # every stage: a collective under pipeline parallelism
            record.update(moe_metrics(out["experts"], top_k=self.model_args.moe.top_k, tokens=out["tokens"],
                                      device=self.device, pp_group=self.pp_group))
        record.update(self.checkpointer.metrics())
        record.update(self.replicas.metrics())
        record.update(self.skip_monitor.record(self.is_logging_rank))  # may stop: data.max_skipped_fraction
        if self.val_loader is not None and step % self.config.validation.freq == 0:
            record["validation_loss"] = self.validate()
        if self.is_logging_rank:
            logger.info(console_line(record, self.color))
            self.metrics.write({k: v for k, v in record.items() if k != "eta"})

    def node_health(self) -> dict:
        """Node-health fields: each rank's own step time and TFLOPS since the last log, over all ranks (one
        small all-gather): min, max, and the slowest rank and its node (torchrun's GROUP_RANK).

        A rank's time runs until it has finished its own work for the interval (device synchronised),
        before the log step's collectives; the rank the others wait for has the longest time."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tp = self.throughput
        elapsed = max(time.perf_counter() - tp.t0, 1e-9)
        mine = torch.tensor([elapsed / max(tp.steps, 1), tp.tokens * self.flops_per_token / elapsed / 1e12,
                             float(os.environ.get("GROUP_RANK", 0))], dtype=torch.float64)
        rows = [mine]
        if self.world_size > 1:
            rows = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(rows, mine)  # a CPU tensor: gloo, also on GPU machines
        table = torch.stack(rows)
        slowest = int(table[:, 0].argmax())
        return {"step_time_min_s": float(table[:, 0].min()), "step_time_max_s": float(table[:, 0].max()),
                "tflops_min": float(table[:, 1].min()), "tflops_max": float(table[:, 1].max()),
                "slowest_rank": slowest, "slowest_node": int(table[slowest, 2])}

    @torch.no_grad()
    def validate(self) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        count = torch.zeros((), device=self.device)
        for i, batch in enumerate(self.val_loader):
            if 0 <= self.config.validation.steps <= i:
                break
            batch = shard_batch(batch, self.context_parallel)
            inputs = batch["input"].to(self.device)
            labels = batch["labels"].to(self.device)
            with self.autocast:
                logits = self.model(inputs, **steps.model_kwargs(batch, self.device))
            with steps.loss_parallel(self.parallel_loss):
                total += steps.plain(self.loss_fn(logits, labels))
            count += labels.numel()
        self.model.train()
        if self.dims.dp_cp > 1:  # CP ranks hold parts of the same sequences: their sums add up too
            both = torch.stack([total, count])
            dist.all_reduce(both, group=self.dims.dp_cp_mesh.get_group())
            total, count = both[0], both[1]
        return (total / count.clamp(min=1)).item()

    # ------------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------------

    def run_step(self, step: int, obs) -> dict:
        """One iteration of the loop: the step, its log record, a checkpoint if due, the heartbeat."""
        config = self.config
        if config.training.gc_debug:  # every step, all generations: leaks show up at once
            gc.collect()
        elif step % config.training.gc_freq == 0:
            gc.collect(1)
        with obs.step(step):  # the drills; CUDA out-of-memory: memory snapshot, re-raised
            out = self.train_step(step)
        last = step == config.training.steps
        if last:  # a background save still in flight is agreed now (the final save waits for it anyway), so
            with obs.checkpoint():  # the last record counts its outcome whatever the thread's timing
                self.checkpointer.finish()
        # A skip known on the host (a skipped range) is always logged; a guard's verdict stays on the device
        # and is reported at the next log step.
        # Step 1 always (as torchtitan): the first loss line comes at once whatever metrics.log_freq is.
        if step % config.metrics.log_freq == 0 or step == 1 or last or out["skipped"] is True:
            with record_function("log"):
                self.log_step(step, out)
        if self.replicas.committed:  # (a step to be repeated has nothing to save)
            with obs.checkpoint():
                self.checkpointer.maybe_save(step, last=last)
        obs.step_done(step)  # watchdog heartbeat, profiler step
        return out

    def train(self) -> None:
        config = self.config
        self.data_iter = iter(self.train_loader)
        gc.disable()
        if config.training.gc_debug and not torch.cuda.is_available():
            logger.warning("training.gc_debug: reference cycles are reported only when they hold CUDA tensors; on "
                           "this CPU run each step collects every generation, without reports")
        elif config.training.gc_debug:
            from trainer.torch_compat import warn_on_tensor_cycles

            warn_on_tensor_cycles()  # warns whenever a collection frees a reference cycle holding a CUDA tensor
        start_step = self.state.step
        if start_step >= config.training.steps:
            logger.info("checkpoint is already at step %d of %d: nothing to train", start_step, config.training.steps)
        self.callbacks.on_train_start(self.run_view)
        self.throughput.reset()
        # SIGTERM/SIGINT: finish the step, agree, save, stop (trainer/preemption.py).
        stopping = preemption.PreemptionHandler(config.checkpoint.preemption_check_steps, self.checkpointer.comm.pg)
        stopping.install()
        # Profiler, memory snapshots, hang watchdog; the run summary (summary.json) at the end or on failure.
        try:
            with Observability(self.observed_run()) as obs:
                step = start_step
                while self.state.step < config.training.steps:  # (a last step that was not committed is repeated)
                    # The quorum of a fault-tolerant job: a group that rejoined takes the live groups' step.
                    try:
                        step = self.replicas.start_step(step + 1)
                    except QuorumLost as e:
                        with obs.checkpoint():  # the last step applied (not one that was to be repeated)
                            lost = self.stop_without_quorum(e, self.state.step, start_step)
                        raise lost from None
                    try:
                        self.run_step(step, obs)
                    except TrainerError:
                        raise
                    except Exception as e:  # a semi-synchronous job's quorum is taken inside the step
                        lost = self.replicas.quorum_lost(e, f"during step {step}")
                        if lost is None:
                            raise
                        raise type(lost)(f"{lost}; step {step} was interrupted: nothing saved") from None
                    if step == start_step + 1:
                        set_train_timeout(config.comm.train_timeout_seconds)
                    signum = stopping.agreed(step) if step < config.training.steps else 0
                    if signum:
                        with obs.checkpoint():
                            preemption.stop(self.checkpointer, step, signum)
                with obs.checkpoint():
                    self.checkpointer.finish()
                self.replicas.finish(self.model_parts)  # the final weights' checksum, for summary.json
        finally:
            stopping.restore()
            self.replicas.close()
            self.train_loader.close()  # its prefetch thread and worker processes end with the run
            self.metrics.close()  # also when the run stops on an error: main() called in-process keeps no file open


    def stop_without_quorum(self, error: QuorumLost, step: int, start_step: int) -> QuorumLost:
        """No quorum can form any more (the lighthouse died, or the other groups did not come) between two
        steps: ``step``, the last step this group applied, is complete and agreed by every group, so it is
        saved (as for a preemption) before the group stops. A step after it that was not committed (the
        lighthouse died during it) was not applied and is not saved: every group saves the same step."""
        if not self.checkpointer.enabled:
            saved = "checkpoint.enable is false: nothing saved"
        elif step == start_step:
            saved = "no step trained since the start: nothing new to save"
        elif self.checkpointer.save_for_preemption(step):
            saved = f"checkpoint step-{step} saved in {self.checkpointer.folder}"
        else:
            saved = f"the checkpoint of step {step} could not be saved (see the log)"
        return type(error)(f"{error}; {saved}")


def batch_fingerprint(batch: dict) -> int:
    """The loader computes it ahead, off the training thread; a batch replaced by a callback (a fault
    drill) is hashed here."""
    fingerprint = getattr(batch, "fingerprint", None)
    return sequence_fingerprint(batch["input"], batch["labels"]) if fingerprint is None else fingerprint


def main(argv: list[str] | None = None) -> int:
    logs.setup()
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    trainer = lock = None
    if "LOCAL_RANK" in os.environ:
        preemption.die_with_parent()  # no orphan worker when the torchrun agent is killed
    try:
        config = load_config(argv)
        validate(config, int(os.environ.get("WORLD_SIZE", 1)))
        compat.announce(config, int(os.environ.get("RANK", 0)))  # job.print_config, job.save_config_file
        if config.job.dry_run:
            dry_run(config)  # trainer/dry_run.py
            return 0
        lock = runlock.acquire_in_worker(config.job, job_identity(config))  # unless the launcher holds it
        trainer = Trainer(config)
        if trainer.checkpointer.seed_created:
            return 0  # checkpoint.create_seed_checkpoint: step-0 saved, nothing to train
        trainer.train()
    except TrainerError as e:
        logger.error("%s: %s", e.label, e)
        launch.record_failure(e.label, str(e))  # the launcher prints this line and exits with this code
        return e.exit_code
    except OSError as e:
        out = output_failure(e, trainer.dump_folder if trainer else None)
        if out is None:
            raise  # a bug: its traceback
        logger.error("%s: %s", out.label, out)
        launch.record_failure(out.label, str(out))
        return out.exit_code
    except Exception as e:
        line = peer_failure(e, trainer.state.step if trainer else None)
        if line is None:
            raise  # a bug: its traceback
        logger.error(line)  # another rank's or node's failure seen from here: one line, no traceback
        launch.record_failure(PeerLost.label, line)
        return PeerLost.exit_code
    finally:
        if lock is not None:
            lock.release()
        close_process_group()
    return 0


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    startup.imports_done()
    sys.exit(record(main)())  # record: a bug's traceback goes to torchrun's error file (the launcher's report)
