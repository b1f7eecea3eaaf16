"""The job-level config sections and the declared ``JobConfig`` that holds every core section.

The string under each field is its documentation: ``--help`` and docs/config.md are generated from it.
Section and key names follow torchtitan v0.2.x wherever the concept exists there. Each layer declares its
own sections next to its code, torch-free (``trainer/<layer>/config.py``, with that layer's rules);
this module keeps the sections of the job as a whole ([job], [training], [validation], [debug]) and
torchtitan's sections for features this trainer does not have (``torchtitan.py``).

Extensions add their sections by subclassing ``JobConfig`` in their own package and registering the
subclass (``trainer/extensions.py``); the parser builds whichever class the registry holds, so extension
code sees its sections as typed attributes and the core never imports it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.checkpoint.config import SECTION_DOC as _CHECKPOINT_DOC, Checkpoint
from trainer.config.torchtitan import (
    SECTION_DOC as _TORCHTITAN_SECTION_DOC, Experimental, LoaderWorkers, MemoryEstimation,
)
from trainer.data.config import Data
from trainer.fault_tolerance.config import SECTION_DOC as _FT_DOC, FaultTolerance
from trainer.models.config import SECTION_DOC as _MODEL_DOC, Model
from trainer.observability.config import SECTION_DOC as _OBSERVABILITY_DOC, Comm, Metrics, Profiling
from trainer.optim.config import SECTION_DOC as _OPTIM_DOC, LossScale, LRScheduler, Optimizer
from trainer.parallel.config import (
    SECTION_DOC as _PARALLEL_DOC, ActivationCheckpoint, Compile, Parallelism, Quantize,
)


@dataclass
class Job:
    config_file: str | None = None
    """TOML file to load before applying command-line overrides (the launcher's CONFIG_FILE)."""
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: resolved config, metrics.jsonl, TensorBoard events, checkpoints."""
    description: str = ""
    """Free text describing the run; saved in config.toml and summary.json."""
    lock_stale_after_s: int = 300
    """One run per dump folder: the run holds <dump_folder>/run.lock (host, pid, start time, a heartbeat
    every 15 s); a lock whose process is gone (same host) or whose heartbeat is older than this is taken
    over with a warning. 0: no lock."""
    print_config: bool = False
    """Log the resolved configuration (JSON) at start-up, then train, as torchtitan does. To print it
    without training: `trainer config [--job.config_file X ...]` (TOML)."""
    dry_run: bool = False
    """Validate the config and build the model on the meta device (no memory allocated), then exit."""
    save_config_file: str | None = None
    """Also write the resolved configuration as JSON to <dump_folder>/<this file> (rank 0); None: only the
    config.toml every run writes there."""
    custom_config_module: str = ""
    """Refused unless empty or "torchtitan.components.ft.config" (whose keys [fault_tolerance] has): torchtitan's
    way to extend JobConfig from a Python module; here extensions add their sections through the registry
    (trainer/extensions.py)."""


@dataclass
class Training:
    dataset: str = "shakespeare"
    """Training data: a registered dataset name (shakespeare: the bundled sample corpus), torchtitan's c4 or
    c4_test (read from dataset_path: an allenai/c4 folder or JSON-lines/parquet files, gzipped or not), or
    a source kind with dataset_path."""
    dataset_path: str = ""
    """Path or glob of the training data (KIND:PATH names its kind, as in data.sources); empty uses the
    registered dataset's bundled location."""
    local_batch_size: int = 8
    """Sequences per micro-batch on each data-parallel rank."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks. -1: local_batch_size x data-parallel degree. Larger
    values accumulate gradients over global / (local x data-parallel degree) micro-batches."""
    seq_len: int = 2048
    """Tokens per sequence."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    steps: int = 10000
    """Optimizer steps to train for (a resumed run continues up to this step)."""
    mixed_precision_param: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """Parameter dtype for compute under FSDP (and autocast dtype without FSDP on GPU). Runs on CPU use
    float32 unless set explicitly in the config. float16 (GPUs without bf16) trains with dynamic loss
    scaling ([training.loss_scale]): a step whose gradients overflow is skipped and the scale backs off
    (float16 runs on CPU too, slowly: CPUs have few float16 kernels)."""
    mixed_precision_reduce: Literal["float32", "bfloat16", "float16"] = "float32"
    """Gradient reduction dtype under FSDP. float16 only with mixed_precision_param = "float16" (the loss scale
    keeps the sum clear of underflow, and an overflow of it skips the step)."""
    enable_cpu_offload: bool = False
    """Keep FSDP-sharded parameters, gradients and optimizer state in CPU memory."""
    gc_freq: int = 50
    """Run Python's garbage collector every this many steps (automatic GC is disabled during training)."""
    gc_debug: bool = False
    """Collect all generations every step and warn about reference cycles holding tensors (slow; for
    finding leaks)."""
    dtype: Literal["bfloat16", "float32"] = "float32"
    """Refused unless float32: pure bf16 training (parameters and optimizer state in bf16) is not
    supported; mixed_precision_param gives bf16 compute with float32 master weights."""
    dataloader: LoaderWorkers = field(default_factory=LoaderWorkers)
    loss_scale: LossScale = field(default_factory=LossScale)


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the loss on held-out data during training."""
    dataset: str = "shakespeare"
    """Validation data: registered dataset name, torchtitan's c4_validation (with dataset_path), or source
    kind."""
    dataset_path: str = ""
    """Path or glob of the validation data (KIND:PATH names its kind); empty uses the registered dataset's
    validation split."""
    freq: int = 100
    """Validate every this many steps."""
    steps: int = 10
    """Batches per validation; -1 runs the whole validation set."""
    local_batch_size: int = 8
    """Sequences per validation batch on each data-parallel rank."""
    seq_len: int = -1
    """Tokens per validation sequence, at most training.seq_len. -1: training.seq_len, so the validation loss
    compares with the training loss (torchtitan's default is 2048 whatever training.seq_len)."""
    dataloader: LoaderWorkers = field(default_factory=LoaderWorkers)


@dataclass
class Debug:
    seed: int | None = None
    """Random seed for initialisation and dropout-like randomness; None picks 0 (weights are always
    identical across parallel layouts for the same seed)."""
    deterministic: bool = False
    """Use deterministic algorithms so that repeated runs are bitwise identical."""
    deterministic_warn_only: bool = False
    """With deterministic: warn about ops that have no deterministic implementation instead of failing."""
    moe_force_load_balance: bool = False
    """Refused unless false: forced round-robin expert routing is not implemented."""
    stall_at_step: int = 0
    """Hang drill: before this step (0 = never), rank debug.stall_rank sleeps debug.stall_seconds, so that
    the watchdog (comm.watchdog_timeout_seconds) can be seen to fire."""
    stall_rank: int = 0
    """The rank that stalls in the hang drill (debug.stall_at_step)."""
    stall_seconds: float = 3600.0
    """How long the stalled rank sleeps in the hang drill."""
    crash_at_step: int = 0
    """Crash drill: just before this step (0 = never), rank debug.crash_rank kills itself with SIGKILL, on
    the first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT is 0), to practise the automatic restart
    (MAX_RESTARTS) and resume from the latest checkpoint (see docs/multinode.md)."""
    crash_rank: int = 0
    """The global rank that kills itself in the crash drill (debug.crash_at_step)."""
    overflow_at_steps: list[int] = field(default_factory=list)
    """Overflow drill of float16 training: at these steps, after backward, rank debug.overflow_rank sets one
    value of its own gradient shard to infinity, as an fp16 overflow would; every rank must then skip the
    step together and back the loss scale off (training.loss_scale.backoff_factor)."""
    overflow_rank: int = 0
    """The global rank whose gradient overflows in the overflow drill (debug.overflow_at_steps)."""


@dataclass
class JobConfig:
    """Every core section, in the order ``--help`` and docs/config.md list them."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    quantize: Quantize = field(default_factory=Quantize)
    metrics: Metrics = field(default_factory=Metrics)
    data: Data = field(default_factory=Data)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    memory_estimation: MemoryEstimation = field(default_factory=MemoryEstimation)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    experimental: Experimental = field(default_factory=Experimental)
    debug: Debug = field(default_factory=Debug)

    def __post_init__(self) -> None:
        # The dotted keys the user gave (TOML file or command line), recorded by the parser. A plain
        # attribute, not a field: it is no config key and stays out of to_dict(), TOML and JSON dumps.
        self.explicit_keys: set[str] = set()
        # Those of them given on the command line (the rest came from the TOML file).
        self.command_line_keys: set[str] = set()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def explicitly_set(self, dotted: str) -> bool:
        """Whether the user gave this key in the TOML file or on the command line."""
        return dotted in self.explicit_keys


SECTION_DOC = {
    "job": "Run identity and output folder.",
    **_MODEL_DOC,
    **_OPTIM_DOC,
    "training": "Data, batch sizes, steps and precision.",
    **_PARALLEL_DOC,
    **_CHECKPOINT_DOC,
    **_OBSERVABILITY_DOC,
    "data": "Data sources, mixing, packing and loader workers (see docs/data.md).",
    "validation": "Held-out loss during training.",
    "debug": "Seeds, determinism and fault drills.",
    **_FT_DOC,
    **_TORCHTITAN_SECTION_DOC,
}
