"""The core config sections: one dataclass per TOML section.

The string under each field is its documentation: ``--help`` and docs/config.md are generated from it.
Section and key names follow torchtitan v0.2.x wherever the concept exists there. Extensions add their
own sections through the registry (trainer/extensions.py); ``JobConfig`` is assembled from both.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer import extensions
from trainer.config.torchtitan import (
    SECTION_DOC as _TORCHTITAN_SECTION_DOC, Experimental, FaultTolerance, LoaderWorkers, MemoryEstimation, MXLinear,
    QuantizeGroupedMM,
)
from trainer.data.config import Data

# checkpoint.checksum's default: xxh3_128 when the xxhash package is installed (a dependency), else sha256.
_DEFAULT_CHECKSUM = "xxh3_128" if importlib.util.find_spec("xxhash") is not None else "sha256"

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
    """Refused unless empty: torchtitan's way to extend JobConfig from a Python module; here extensions add
    their sections through the registry (trainer/extensions.py)."""


@dataclass
class Model:
    name: Literal["llama2", "llama3"] = "llama3"
    """Model family. Both use the same Llama architecture; the family picks the flavor table."""
    flavor: str = "debugmodel"
    """Model size, a key of the flavor table: debugmodel, llama2_7b, llama2_13b, llama2_70b, llama3_1b,
    llama3_3b, llama3_8b, llama3_70b, llama3_405b; or custom: no base, the shape comes from model.dim,
    n_layers and n_heads (required) and the keys below (what `trainer import` writes)."""
    hf_assets_path: str = ""
    """A Hugging Face assets folder, as torchtitan uses it: tokenizer.json with tokenizer_config.json (BOS,
    EOS and other special tokens it declares are honoured), optionally config.json and safetensors weights
    (loaded when checkpoint.initial_load_in_hf is set without initial_load_path). Empty: the bundled debug
    tokenizer (torchtitan's default is its test folder ./tests/assets/tokenizer)."""
    tokenizer_path: str = ""
    """tokenizer.json (HF tokenizers) or a folder holding one, sentencepiece tokenizer.model (Llama 2) or
    tiktoken file (Llama 3); wins over hf_assets_path for the tokenizer. Empty: hf_assets_path, else the
    bundled debug BPE tokenizer."""
    vocab_size: int = -1
    """Embedding rows. -1: the flavor's published vocabulary, or for flavors without one (debugmodel) the
    tokenizer's vocabulary rounded up to a multiple of 64 (faster matmuls)."""
    # Shape overrides (docs/export_eval.md, "Custom shapes"): -1 / unset keeps the flavor's value.
    dim: int = -1
    """Hidden size (Hugging Face hidden_size). -1: the flavor's. Must be a multiple of n_heads."""
    n_layers: int = -1
    """Transformer blocks (num_hidden_layers). -1: the flavor's."""
    n_heads: int = -1
    """Attention (query) heads (num_attention_heads). -1: the flavor's. dim / n_heads (the head size) must
    be even; tensor_parallel_degree must divide it."""
    n_kv_heads: int = -1
    """Key/value heads (num_key_value_heads; fewer than n_heads: grouped-query attention). -1: the
    flavor's, or n_heads when n_heads is set. Must divide n_heads; tensor_parallel_degree must divide it."""
    ffn_dim: int = -1
    """SwiGLU hidden size (intermediate_size), given outright. -1: from multiple_of and
    ffn_dim_multiplier (Meta's rule: int(8 dim / 3), times the multiplier, rounded up to multiple_of)."""
    multiple_of: int = -1
    """SwiGLU hidden size rounding (Meta's rule, when ffn_dim is -1). -1: the flavor's."""
    ffn_dim_multiplier: float | None = None
    """SwiGLU hidden size multiplier (Meta's rule, when ffn_dim is -1). Unset: the flavor's."""
    rope_theta: float | None = None
    """RoPE base frequency. Unset: the flavor's."""
    rope_scaling_factor: float | None = None
    """Llama 3.1 RoPE scaling (Hugging Face rope_type "llama3"): the factor; 0 turns scaling off. Unset: the
    flavor's scaling."""
    rope_scaling_low_freq_factor: float | None = None
    """Llama 3.1 RoPE scaling's low_freq_factor. Unset: the flavor's, else 1."""
    rope_scaling_high_freq_factor: float | None = None
    """Llama 3.1 RoPE scaling's high_freq_factor. Unset: the flavor's, else 4."""
    rope_scaling_original_max_position_embeddings: int = -1
    """Llama 3.1 RoPE scaling's original context length. -1: the flavor's, else 8192."""
    norm_eps: float | None = None
    """RMSNorm epsilon (rms_norm_eps). Unset: the flavor's."""
    tie_word_embeddings: bool | None = None
    """Output layer shares the embedding matrix. Unset: the flavor's. Trained tied on one process, under
    FSDP and tensor parallel; refused with pipeline parallel (the two ends live on different stages)."""
    max_seq_len: int = -1
    """Context length the model is meant for (exported as max_position_embeddings). -1: the flavor's. The
    RoPE table itself is built for training.seq_len."""
    converters: list[str] = field(default_factory=list)
    """Model transformations applied before parallelization, e.g. ["quantize.linear.float8"]."""
    print_after_conversion: bool = False
    """Log the model structure after converters and parallelization."""


@dataclass
class Optimizer:
    name: Literal["AdamW"] = "AdamW"
    """Optimizer class."""
    lr: float = 8e-4
    """Peak learning rate (reached at the end of warmup)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to 2-D weights only (matrices and embeddings; not norms)."""
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """AdamW kernel: fused (one kernel per step where the device supports it), foreach, or for-loop."""
    early_step_in_backward: bool = False
    """Refused unless false: stepping the optimizer inside backward is not implemented (it also rules out
    gradient clipping)."""


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from lr/warmup_steps to lr; longer than the schedule (total_steps) is clamped
    to it with a warning, as torchtitan does."""
    total_steps: int | None = None
    """Steps the schedule spans; None: training.steps. Lets a short run follow a long run's curve."""
    decay_ratio: float | None = None
    """Fraction of the schedule spent decaying at the end (warmup-stable-decay). None: decay over all
    steps after warmup."""
    decay_type: Literal["linear", "cosine", "sqrt", "constant"] = "linear"
    """Shape of the decay from lr to lr * min_lr_factor; constant keeps lr after warmup. The schedule is
    torchtitan's step for step: the decay ends one step past the schedule, so the last step's lr is just
    above lr * min_lr_factor."""
    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of optimizer.lr."""


@dataclass
class Training:
    dataset: str = "shakespeare"
    """Training data: a registered dataset name (shakespeare: the bundled sample corpus), torchtitan's c4 or
    c4_test (read from dataset_path: an allenai/c4 folder or JSON-lines/parquet files, gzipped or not), or
    a source kind with dataset_path."""
    dataset_path: str = ""
    """Path or glob of the training data; empty uses the registered dataset's bundled location."""
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
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"
    """Parameter dtype for compute under FSDP (and autocast dtype without FSDP on GPU). Runs on CPU use
    float32 unless set explicitly in the config."""
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """Gradient reduction dtype under FSDP."""
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
    z_loss_weight: float = 0.0
    """Weight of the z-loss (log of the softmax normaliser, squared) added to the loss; 0 disables."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas of the model (the replicate dimension of HSDP; across nodes in multi-node presets). -1:
    whatever is left of the world size (then data_parallel_shard_degree must be set)."""
    data_parallel_shard_degree: int = -1
    """Ranks a model replica is sharded over with FSDP2. -1: whatever is left of the world size."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: always (least memory), never (no re-gather in backward), or
    default: always, except for the last block and the output layer, whose backward follows at once, and
    never with pipeline parallel (each micro-batch's forward would gather them again)."""
    tensor_parallel_degree: int = 1
    """Ranks each layer's matrices are split over (Megatron-style, with sequence parallel norms)."""
    disable_loss_parallel: bool = False
    """Gather the full logits before the loss instead of computing it on vocabulary shards."""
    enable_async_tensor_parallel: bool = False
    """Overlap tensor-parallel communication with matmuls (GPU and torch.compile only)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages over ranks."""
    pipeline_parallel_schedule: str = "1F1B"
    """Pipeline schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or
    DualPipeV (see docs/pipeline.md)."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per pipeline micro-batch."""
    pipeline_parallel_layers_per_stage: int | None = None
    """Transformer blocks per (virtual) stage; None: split the blocks evenly over the stages."""
    module_fqns_per_model_part: list[list[str]] = field(default_factory=list)
    """Explicit module names for each (virtual) stage, e.g. [["tok_embeddings","layers.0"],["layers.1","norm","output"]]."""
    pipeline_parallel_first_stage_less_layers: int = 1
    """Refused unless 1. The automatic split already gives the first stage (which also holds the embedding)
    no more blocks than the middle ones; use module_fqns_per_model_part for an exact split."""
    pipeline_parallel_last_stage_less_layers: int = 1
    """Refused unless 1. The automatic split already gives the last stage (which also holds norm and output)
    no more blocks than the middle ones; use module_fqns_per_model_part for an exact split."""
    pipeline_parallel_schedule_csv: str | None = ""
    """Refused unless empty: schedules are chosen by name (pipeline_parallel_schedule), not read from CSV."""
    pipeline_parallel_expert_parallel_overlap: bool = True
    """Refused unless true: expert parallelism (and with it this overlap) is not supported."""
    context_parallel_degree: int = 1
    """Refused unless 1: context parallelism is not implemented (torch's context-parallel SDPA has no CPU
    kernel; what a GPU build needs is in docs/coming_from_torchtitan.md)."""
    context_parallel_load_balancer: str | None = "headtail"
    """Refused unless "headtail" (context parallelism only, see context_parallel_degree)."""
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """Refused unless "allgather" (context parallelism only, see context_parallel_degree)."""
    expert_parallel_degree: int = 1
    """Refused unless 1: the Llama models here have no mixture-of-experts layers."""
    expert_tensor_parallel_degree: int = 1
    """Refused unless 1: the Llama models here have no mixture-of-experts layers."""
    expert_parallel_comm_backend: Literal["standard", "deepep"] = "standard"
    """Refused unless "standard": the Llama models here have no mixture-of-experts layers."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the latest complete one found in the dump folder."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = 500
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 10
    """Keep this many newest checkpoints and delete older ones; 0 keeps all."""
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
    """Save in the background: async copies state to CPU then writes in another thread; with pinned
    memory the copy uses reusable pinned buffers."""
    last_save_model_only: bool = True
    """The final checkpoint holds only model weights (no optimizer state)."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of the weights in a model-only final checkpoint."""
    load_step: int = -1
    """Resume from this step instead of the latest checkpoint; -1: latest."""
    initial_load_path: str | None = None
    """Checkpoint to start from when the dump folder has none (e.g. a pretrained model)."""
    initial_load_model_only: bool = True
    """Load only the model weights from initial_load_path (fresh optimizer, step 0)."""
    initial_load_in_hf: bool = False
    """initial_load_path is a Hugging Face safetensors Llama folder."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """State keys not to restore on resume, e.g. ["optimizer", "dataloader"]."""
    create_seed_checkpoint: bool = False
    """Initialise the model, save it as step 0, and exit (run on one process)."""
    max_failed_saves: int = 1
    """Stop the run (non-zero exit) after this many consecutive failed saves."""
    checksum: Literal["xxh3_128", "sha256", "none"] = _DEFAULT_CHECKSUM
    """Checksum of every checkpoint file, computed while it is written and recorded in the commit marker
    (xxh3_128 needs the xxhash package; none records sizes only)."""
    verify_on_load: bool = True
    """Verify the checksums before loading a checkpoint; a mismatch refuses it as corrupt and the previous
    checkpoint is loaded instead."""
    start_fresh_if_unloadable: bool = False
    """When the checkpoint folder holds checkpoints and none can be loaded, start from step 0 anyway
    (nothing is deleted) instead of stopping with exit code 3."""
    preemption_check_steps: int = 5
    """On SIGTERM/SIGINT the run saves a full checkpoint and stops (exit 128 + signal); the ranks agree on
    a received signal every this many steps (one small CPU all-reduce), so the stop comes at most this
    many steps after the signal."""
    timeout_seconds: int = 1800
    """Collective timeout while saving or loading a checkpoint (ranks wait for the slowest writer); a save
    that takes longer counts as failed."""
    drill_save_delay_s: float = 0.0
    """Fault drill: rank 0 waits this long inside each save before writing (the save stays uncommitted
    meanwhile), to practise killing a run in the middle of a save."""
    drill_fail_save_steps: list[int] = field(default_factory=list)
    """Fault drill: the saves at these steps fail with an injected I/O error on the last rank."""
    drill_disk_bytes: int = -1
    """Fault drill: pretend the checkpoint folder sits on a filesystem of this many bytes (free space is
    this minus what the folder holds); -1 measures the real filesystem."""
    enable_ft_dataloader_checkpoints: bool = True
    """Refused unless true (TorchFT only; the data-loader state is in every checkpoint anyway)."""
    initial_load_in_hf_quantized: bool = False
    """Refused unless false: quantized Hugging Face checkpoints are not read."""
    last_save_in_hf: bool = False
    """Refused unless false: the final save is a DCP checkpoint; `trainer export` writes Hugging Face
    safetensors from it."""
    enable_first_step_checkpoint: bool = False
    """Refused unless false: not implemented; checkpoint.interval = 1 with training.steps = 1 checks saving
    on a new cluster."""
    load_only: bool = False
    """Refused unless false: not implemented; checkpoint.enable = false with checkpoint.initial_load_path
    starts from a checkpoint without saving."""


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective", "memory_budget"] = "none"
    """Recompute activations in backward: none, full (every block), or selective; memory_budget (torch.compile's
    partitioner) is refused. torchtitan's default is selective with option "2"; ours is none, the fastest
    choice for the small models one starts with."""
    selective_ac_option: str = "op"
    """For selective mode: "op" saves the results of expensive ops (matmuls, attention) and recomputes the
    rest; an integer N checkpoints every N-th block. (torchtitan's default: "2".)"""
    per_op_sac_force_recompute_mm_shapes_by_fqns: list[str] = field(default_factory=lambda: ["moe.router.gate"])
    """Refused unless ["moe.router.gate"]: forcing the recomputation of chosen matmul shapes is not implemented
    (the default names a mixture-of-experts router, which these models do not have)."""
    early_stop: bool = False
    """Refused unless false: not wired to torch.utils.checkpoint's early stop."""
    memory_budget: float = 0.5
    """Refused unless 0.5 (mode memory_budget only, which is refused)."""
    visualize_memory_budget_pareto: bool = False
    """Refused unless false (mode memory_budget only, which is refused)."""
    preserve_rng_state: bool = True
    """Stash and restore the RNG state around each recomputation (torch.utils.checkpoint's option)."""
    determinism_check: str = "default"
    """torch.utils.checkpoint's check that the recomputation matches the original ("default" or "none")."""
    debug: bool = False
    """torch.utils.checkpoint's debug mode: on a mismatch, report the ops that ran (slow)."""


@dataclass
class Compile:
    enable: bool = False
    """Compile each transformer block (and the loss) with torch.compile."""
    components: list[Literal["model", "loss"]] = field(default_factory=lambda: ["model", "loss"])
    """What to compile when enabled: each transformer block ("model") and the cross-entropy ("loss"; fuses
    the float32 upcast of the logits, saving memory; not under tensor-parallel loss parallel)."""
    backend: str = "inductor"
    """torch.compile backend."""
    cache_dir: str = ""
    """Inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR), e.g. on a shared filesystem so that later runs and
    other nodes reuse compiled kernels; empty keeps PyTorch's default (or the variable already set)."""


@dataclass
class Float8:
    recipe_name: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao float8 scaling recipe."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose name contains any of these stay in high precision."""
    enable_fsdp_float8_all_gather: bool = False
    """All-gather FSDP parameters in float8 (tensorwise only; needs NCCL)."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """After each optimizer step, compute the float8 scales of all FSDP-sharded weights at once (one amax
    all-reduce instead of one per weight at each all-gather). Needs enable_fsdp_float8_all_gather."""
    emulate: bool = False
    """Emulate float8 matmuls in high precision (for testing on hardware without float8)."""


@dataclass
class QuantizeLinear:
    float8: Float8 = field(default_factory=Float8)
    mx: MXLinear = field(default_factory=MXLinear)


@dataclass
class Quantize:
    linear: QuantizeLinear = field(default_factory=QuantizeLinear)
    grouped_mm: QuantizeGroupedMM = field(default_factory=QuantizeGroupedMM)


@dataclass
class Metrics:
    log_freq: int = 10
    """Log a console line and a metrics.jsonl record every this many steps (and at the last step)."""
    enable_tensorboard: bool = True
    """Write TensorBoard events under <dump_folder>/<save_tb_folder>."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""
    enable_wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package)."""
    save_for_all_ranks: bool = False
    """Refused unless false: TensorBoard and W&B records are written once per run, not per rank."""
    disable_color_printing: bool = False
    """Never color console output (color is only used on a terminal anyway)."""
    peak_tflops: float = -1.0
    """Peak dense bf16 TFLOPS of one device for MFU; -1 looks the GPU up by name (unknown: MFU is null)."""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the loss on held-out data during training."""
    dataset: str = "shakespeare"
    """Validation data: registered dataset name, torchtitan's c4_validation (with dataset_path), or source
    kind."""
    dataset_path: str = ""
    """Path or glob of the validation data; empty uses the registered dataset's validation split."""
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
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces (CPU and CUDA activity, with ranges named data, forward, loss, backward,
    optimizer, log and checkpoint): one Chrome/Perfetto trace per rank at
    <dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json."""
    save_traces_folder: str = "profile_traces"
    """Trace folder, relative to job.dump_folder."""
    profile_freq: int = 100
    """Record a trace every this many steps: each window ends at a multiple of profile_freq (also the
    interval of memory snapshots)."""
    profiler_warmup: int = 3
    """Steps of profiler warmup (not recorded) before each recorded window."""
    profiler_active: int = 1
    """Steps recorded in each window (the last ones before each multiple of profile_freq); warmup + active
    must not exceed profile_freq."""
    enable_memory_snapshot: bool = False
    """Record the CUDA allocator's history and dump a snapshot every profile_freq steps and on out-of-memory,
    to <dump_folder>/<save_memory_snapshot_folder>/iteration_<step>[_exit]/rank<r>_memory_snapshot.pickle
    (view at https://pytorch.org/memory_viz). GPU only; a CPU run warns and skips it."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Snapshot folder, relative to job.dump_folder."""


@dataclass
class Comm:
    init_timeout_seconds: int = 300
    """Collective timeout until the first step completes (start-up, compilation, checkpoint loading)."""
    train_timeout_seconds: int = 100
    """Collective timeout after the first step, so a hung rank is noticed within minutes."""
    trace_buf_size: int = 20000
    """Flight-recorder entries (the most recent collectives, NCCL and gloo) kept per rank for hang
    diagnosis; dumped by NCCL on a collective timeout and by the watchdog (0 disables)."""
    save_traces_folder: str = "comm_traces"
    """Flight-recorder dumps, relative to job.dump_folder: one file per rank, <save_traces_file_prefix><rank>;
    analyse NCCL's with `torchfrtrace <folder>` (see docs/observability.md)."""
    save_traces_file_prefix: str = "rank_"
    """File-name prefix of the flight-recorder dumps (the rank follows)."""
    watchdog_timeout_seconds: int = 600
    """Hang watchdog: when no training step completes for this many seconds, every rank writes its Python
    stacks to <dump_folder>/watchdog/rank<r>_stacks.txt (and the flight recorder), the run summary is
    written, and the process exits with code 124 instead of hanging. The first step may take
    comm.init_timeout_seconds if that is longer, a checkpoint save checkpoint.timeout_seconds more. Set it
    below comm.train_timeout_seconds to get every rank's stacks before a collective timeout ends the run.
    0 disables."""
    mode: Literal["default", "fake_backend", "local_tensor"] = "default"
    """Refused unless "default": torchtitan's fake-backend and local-tensor modes are not here; job.dry_run
    checks a layout without devices, and parity tests run layouts on CPU with gloo."""


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
    """Refused unless false: the Llama models here have no mixture-of-experts layers."""
    inject_bad_data_steps: list[int] = field(default_factory=list)
    """Fault drill: replace the batch at these steps with uniformly random tokens."""
    inject_nonfinite_loss_steps: list[int] = field(default_factory=list)
    """Fault drill: force a non-finite loss at these steps."""
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


SECTION_DOC = {
    "job": "Run identity and output folder.",
    "model": "Architecture, size and tokenizer.",
    "optimizer": "AdamW settings.",
    "lr_scheduler": "Learning-rate warmup and decay.",
    "training": "Data, batch sizes, steps and precision.",
    "parallelism": "How the model is spread over ranks.",
    "checkpoint": "Saving and resuming (DCP).",
    "activation_checkpoint": "Trading compute for activation memory.",
    "compile": "torch.compile.",
    "quantize.linear.float8": "float8 matmuls via torchao.",
    "metrics": "Logging: console, metrics.jsonl, TensorBoard.",
    "data": "Data sources, mixing, packing and loader workers (see docs/data.md).",
    "validation": "Held-out loss during training.",
    "profiling": "Profiler traces and CUDA memory snapshots (see docs/observability.md).",
    "comm": "Process-group timeouts, the hang watchdog and the collective flight recorder (see docs/observability.md).",
    "debug": "Seeds, determinism and fault drills.",
}


class _JobConfigBase:
    """Methods of the assembled ``JobConfig``."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def explicitly_set(self, dotted: str) -> bool:
        """Whether the user gave this key in the TOML file or on the command line."""
        return dotted in getattr(self, "_explicit", set())


_CORE_SECTIONS: list[tuple[str, type]] = [
    ("job", Job), ("model", Model), ("optimizer", Optimizer), ("lr_scheduler", LRScheduler),
    ("training", Training), ("parallelism", Parallelism), ("checkpoint", Checkpoint),
    ("activation_checkpoint", ActivationCheckpoint), ("compile", Compile), ("quantize", Quantize),
    ("metrics", Metrics), ("data", Data), ("validation", Validation), ("profiling", Profiling),
    ("comm", Comm), ("memory_estimation", MemoryEstimation), ("fault_tolerance", FaultTolerance),
    ("experimental", Experimental), ("debug", Debug),
]
SECTION_DOC.update(_TORCHTITAN_SECTION_DOC)


def _assemble() -> type:
    """The core sections followed by every registered extension's sections, as one dataclass."""
    sections = list(_CORE_SECTIONS)
    for name, (cls, doc) in extensions.registry().sections.items():
        sections.append((name, cls))
        SECTION_DOC[name] = doc
    fields = [(name, cls, field(default_factory=cls)) for name, cls in sections]
    cls = dataclasses.make_dataclass("JobConfig", fields, bases=(_JobConfigBase,))
    cls.__module__ = __name__
    return cls


JobConfig = _assemble()
