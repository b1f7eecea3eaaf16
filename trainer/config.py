"""Job configuration: dataclass sections, TOML + command-line merge, validation.

Every key lives in one dataclass below; the string under each field is its documentation, used for
``--help`` and for the generated reference ``docs/config.md``. Precedence: command line > TOML file >
defaults. Anything a user can get wrong (unknown key, wrong type, impossible value) raises
:class:`ConfigError` with a message naming the key, before any work starts.

Section and key names follow torchtitan v0.2.x wherever the concept exists there.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torchtitan_ext.stability.config import Stability
from trainer.data.config import Data

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration the user must fix; the message names the key and what would be valid."""


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


@dataclass
class Job:
    config_file: str | None = None
    """TOML file to load before applying command-line overrides (the launcher's CONFIG_FILE)."""
    dump_folder: str = "./outputs"
    """Folder for everything a run writes: resolved config, metrics.jsonl, TensorBoard events, checkpoints."""
    description: str = ""
    """Free text describing the run; saved with the resolved config."""
    print_config: bool = False
    """Print the resolved configuration and exit without training."""
    dry_run: bool = False
    """Validate the config and build the model on the meta device (no memory allocated), then exit."""


@dataclass
class Model:
    name: Literal["llama2", "llama3"] = "llama3"
    """Model family. Both use the same Llama architecture; the family picks the flavor table."""
    flavor: str = "debugmodel"
    """Model size, a key of the flavor table: debugmodel, llama2_7b, llama2_13b, llama2_70b, llama3_1b,
    llama3_3b, llama3_8b, llama3_70b, llama3_405b."""
    tokenizer_path: str = ""
    """tokenizer.json (HF tokenizers), sentencepiece tokenizer.model (Llama 2) or tiktoken file (Llama 3).
    Empty: the bundled debug BPE tokenizer."""
    vocab_size: int = -1
    """Embedding rows. -1: the flavor's published vocabulary, or for flavors without one (debugmodel) the
    tokenizer's vocabulary rounded up to a multiple of 64 (faster matmuls)."""
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


@dataclass
class LRScheduler:
    warmup_steps: int = 200
    """Steps of linear warmup from lr/warmup_steps to lr."""
    decay_ratio: float | None = None
    """Fraction of training.steps spent decaying at the end (warmup-stable-decay). None: decay over all
    steps after warmup."""
    decay_type: Literal["linear", "cosine", "sqrt", "constant"] = "linear"
    """Shape of the decay from lr to lr * min_lr_factor; constant keeps lr after warmup."""
    min_lr_factor: float = 0.0
    """Final learning rate as a fraction of optimizer.lr."""


@dataclass
class Training:
    dataset: str = "shakespeare"
    """Training data: a registered dataset name (shakespeare: the bundled sample corpus) or a source kind
    with dataset_path."""
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
    default (always, except for the last block whose backward follows immediately)."""
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


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, full (every block), or selective."""
    selective_ac_option: str = "op"
    """For selective mode: "op" saves the results of expensive ops (matmuls, attention) and recomputes the
    rest; an integer N checkpoints every N-th block."""


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
    """Inductor cache directory shared between runs; empty keeps PyTorch's default."""


@dataclass
class Float8:
    recipe_name: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao float8 scaling recipe."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers whose name contains any of these stay in high precision."""
    enable_fsdp_float8_all_gather: bool = False
    """All-gather FSDP parameters in float8 (tensorwise only; needs NCCL)."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """Compute float8 scales for all parameters in one kernel after the optimizer step."""
    emulate: bool = False
    """Emulate float8 matmuls in high precision (for testing on hardware without float8)."""


@dataclass
class QuantizeLinear:
    float8: Float8 = field(default_factory=Float8)


@dataclass
class Quantize:
    linear: QuantizeLinear = field(default_factory=QuantizeLinear)


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
    disable_color_printing: bool = False
    """Never color console output (color is only used on a terminal anyway)."""
    peak_tflops: float = -1.0
    """Peak dense bf16 TFLOPS of one device for MFU; -1 looks the GPU up by name (unknown: MFU is null)."""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate the loss on held-out data during training."""
    dataset: str = "shakespeare"
    """Validation data (registered dataset name or source kind)."""
    dataset_path: str = ""
    """Path or glob of the validation data; empty uses the registered dataset's validation split."""
    freq: int = 100
    """Validate every this many steps."""
    steps: int = 10
    """Batches per validation; -1 runs the whole validation set."""
    local_batch_size: int = 8
    """Sequences per validation batch on each data-parallel rank."""


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


@dataclass
class Debug:
    seed: int | None = None
    """Random seed for initialisation and dropout-like randomness; None picks 0 (weights are always
    identical across parallel layouts for the same seed)."""
    deterministic: bool = False
    """Use deterministic algorithms so that repeated runs are bitwise identical."""
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


@dataclass
class JobConfig:
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
    stability: Stability = field(default_factory=Stability)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    debug: Debug = field(default_factory=Debug)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def explicitly_set(self, dotted: str) -> bool:
        """Whether the user gave this key in the TOML file or on the command line."""
        return dotted in getattr(self, "_explicit", set())


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
    "stability": "Skipping steps, spike and NaN guards, embedding-gradient shrink (see docs/stability.md).",
    "profiling": "Profiler traces and CUDA memory snapshots (see docs/observability.md).",
    "comm": "Process-group timeouts, the hang watchdog and the collective flight recorder (see docs/observability.md).",
    "debug": "Seeds, determinism and fault drills.",
}


# --------------------------------------------------------------------------------------------------
# Introspection: field docs and leaf keys
# --------------------------------------------------------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """The string literal written under each field of a dataclass, by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def iter_sections(cls: type = JobConfig, prefix: str = ""):
    """Yield (dotted section name, dataclass type) for every section holding leaf keys."""
    hints = _hints(cls)
    leaves = [f for f in dataclasses.fields(cls) if not _is_section(hints[f.name])]
    if prefix and leaves:
        yield prefix, cls
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            yield from iter_sections(hints[f.name], f"{prefix}.{f.name}" if prefix else f.name)


def leaf_keys() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every configurable key, dotted (e.g. "training.steps"), with its owning section and field."""
    keys = {}
    for section, cls in iter_sections():
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if not _is_section(hints[f.name]):
                keys[f"{section}.{f.name}"] = (cls, f)
    return keys


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


# --------------------------------------------------------------------------------------------------
# Value conversion
# --------------------------------------------------------------------------------------------------

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert(key: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Check (TOML) or parse (command-line string) one value against a field's type."""
    origin = typing.get_origin(tp)
    expected = type_name(tp)

    def fail(extra: str = "") -> typing.NoReturn:
        raise ConfigError(f"{key}: expected {expected}, got {value!r}{extra}")

    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if type(None) in args and (value is None or (from_cli and str(value).lower() in ("none", "null"))):
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(key, arg, value, from_cli)
            except ConfigError as e:
                errors.append(e)
        fail()
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        if from_cli:
            for c in choices:
                if str(c) == str(value):
                    return c
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        fail(f" (did you mean {close[0]!r}?)" if close else "")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if from_cli and isinstance(value, str):
            value = _split_cli_list(value, item_tp)
        if not isinstance(value, list):
            fail()
        return [_convert(f"{key}[{i}]", item_tp, v, from_cli) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        fail(" (use true or false)")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli:
            try:
                return int(str(value).replace("_", ""))
            except ValueError:
                pass
        fail()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli:
            try:
                return float(value)
            except ValueError:
                pass
        fail()
    if tp is str:
        if isinstance(value, str):
            return value
        if from_cli:
            return str(value)
        fail()
    raise TypeError(f"unsupported config type {tp} for {key}")  # a bug in this file, not user input


def _split_cli_list(value: str, item_tp: Any) -> list:
    """CLI lists are comma-separated; nested lists use JSON (e.g. '[["a","b"],["c"]]')."""
    value = value.strip()
    if value.startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"cannot parse list {value!r}: {e}") from None
    if value == "":
        return []
    items = [v.strip() for v in value.split(",")]
    if typing.get_origin(item_tp) is list:
        # Inclusive integer ranges: "10-20,25" -> [[10, 20], [25, 25]].
        ranges = []
        for item in items:
            lo, _, hi = item.partition("-")
            try:
                ranges.append([int(lo), int(hi or lo)])
            except ValueError:
                raise ConfigError(f"cannot parse range {item!r} in {value!r}; use e.g. 10-20,25-30") from None
        return ranges
    return items


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _unknown_key(key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:
        # A typo in the section name but a correct key name: match on the last part.
        tail = key.rsplit(".", 1)[-1]
        close = [k for k in known if k.rsplit(".", 1)[-1] == tail][:1] or difflib.get_close_matches(
            tail, [k.rsplit(".", 1)[-1] for k in known], n=1
        )
        close = [k for k in known if k.endswith("." + close[0])][:1] if close else []
    hint = f"; did you mean '{close[0]}'?" if close else "; run with --help for the list of keys"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _flatten_toml(data: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    sections = {s for s, _ in iter_sections()}
    for k, v in data.items():
        dotted = f"{prefix}.{k}" if prefix else k
        is_section_prefix = any(s == dotted or s.startswith(dotted + ".") for s in sections)
        if isinstance(v, dict) and is_section_prefix:
            flat.update(_flatten_toml(v, dotted))
        else:
            flat[dotted] = v
    return flat


def parse_cli(argv: list[str]) -> dict[str, str | bool]:
    """``--section.key value``, ``--section.key=value`` or a bare ``--section.bool_key`` -> {key: value}."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.key value")
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
            i += 1
        else:
            key = body
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or (nxt.startswith("--") and len(nxt) > 2 and not _is_number(nxt)):
                value = True  # bare flag; only valid for booleans (checked on conversion)
                i += 1
            else:
                value = nxt
                i += 2
        out[key.replace("-", "_")] = value
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def load_config(argv: list[str] | None = None, env: dict[str, str] | None = None) -> JobConfig:
    """Build the JobConfig from defaults, the TOML file (``--job.config_file`` or $CONFIG_FILE) and CLI."""
    argv = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if env is None else env
    known = leaf_keys()
    cli = parse_cli(argv)
    for key in cli:
        if key not in known:
            raise _unknown_key(key, list(known))

    values: dict[str, tuple[Any, bool]] = {}
    config_file = cli.get("job.config_file") or env.get("CONFIG_FILE") or None
    if config_file:
        path = Path(str(config_file))
        if not path.is_file():
            raise ConfigError(f"job.config_file: no such file '{path}'")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"job.config_file: '{path}' is not valid TOML: {e}") from None
        for key, value in _flatten_toml(data).items():
            if key not in known:
                raise ConfigError(f"{path}: {_unknown_key(key, list(known))}")
            values[key] = (value, False)
        values["job.config_file"] = (str(path), True)
    for key, value in cli.items():
        values[key] = (value, True)

    config = JobConfig()
    for key, (value, from_cli) in values.items():
        cls, f = known[key]
        tp = _hints(cls)[f.name]
        if value is True and from_cli and tp is not bool and typing.get_origin(tp) is None:
            raise ConfigError(f"{key}: expected a value ({type_name(tp)})")
        converted = _convert(key, tp, value, from_cli)
        section = config
        for part in key.split(".")[:-1]:
            section = getattr(section, part)
        setattr(section, f.name, converted)
    object.__setattr__(config, "_explicit", set(values))
    validate(config)
    return config


def validate(config: JobConfig) -> None:
    """Checks that need no knowledge of the world size (see trainer.parallel for those that do)."""

    def positive(key: str, minimum: int = 1) -> None:
        section, name = key.rsplit(".", 1)
        value = getattr(_get_section(config, section), name)
        if value < minimum:
            raise ConfigError(f"{key} must be >= {minimum}, got {value}")

    for key in ("training.local_batch_size", "training.seq_len", "training.steps", "metrics.log_freq",
                "checkpoint.interval", "validation.freq", "parallelism.tensor_parallel_degree",
                "parallelism.pipeline_parallel_degree",
                "parallelism.pipeline_parallel_microbatch_size", "profiling.profile_freq",
                "checkpoint.max_failed_saves", "checkpoint.timeout_seconds", "comm.init_timeout_seconds",
                "comm.train_timeout_seconds"):
        positive(key)
    positive("lr_scheduler.warmup_steps", 0)
    positive("checkpoint.keep_latest_k", 0)
    t = config.training
    if t.global_batch_size != -1 and (t.global_batch_size < 1 or t.global_batch_size % t.local_batch_size):
        raise ConfigError(
            f"training.global_batch_size ({t.global_batch_size}) must be -1 or a positive multiple of "
            f"training.local_batch_size ({t.local_batch_size})"
        )
    for key in ("data_parallel_shard_degree", "data_parallel_replicate_degree"):
        value = getattr(config.parallelism, key)
        if value == 0 or value < -1:
            raise ConfigError(f"parallelism.{key} must be -1 or >= 1, got {value}")
    if config.optimizer.lr <= 0:
        raise ConfigError(f"optimizer.lr must be > 0, got {config.optimizer.lr}")
    if not 0.0 <= config.lr_scheduler.min_lr_factor <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_factor must be in [0, 1], got {config.lr_scheduler.min_lr_factor}")
    if config.lr_scheduler.decay_ratio is not None and not 0.0 <= config.lr_scheduler.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio must be in [0, 1] or None, got {config.lr_scheduler.decay_ratio}")
    if config.activation_checkpoint.mode == "selective":
        opt = config.activation_checkpoint.selective_ac_option
        if opt != "op" and not (opt.isdigit() and int(opt) >= 1):
            raise ConfigError(f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer, got {opt!r}")
    if config.parallelism.pipeline_parallel_degree > 1 and config.validation.enable:
        raise ConfigError("validation.enable is not supported with pipeline_parallel_degree > 1 yet; "
                          "evaluate checkpoints with `trainer eval` instead")
    schedules = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                 "DualPipeV")
    if config.parallelism.pipeline_parallel_schedule.lower() not in {x.lower() for x in schedules}:
        close = difflib.get_close_matches(config.parallelism.pipeline_parallel_schedule, schedules, n=1)
        raise ConfigError(f"parallelism.pipeline_parallel_schedule: unknown schedule "
                          f"{config.parallelism.pipeline_parallel_schedule!r}"
                          + (f" (did you mean {close[0]!r}?)" if close else "") + f"; valid: {', '.join(schedules)}")
    valid_converters = {"quantize.linear.float8"}
    for c in config.model.converters:
        if c not in valid_converters:
            raise ConfigError(f"model.converters: unknown converter {c!r}; valid: {sorted(valid_converters)}")


def resolve_degrees(cfg: Parallelism, world_size: int) -> tuple[int, int, int, int]:
    """(dp_replicate, dp_shard, tp, pp) with -1 resolved; raises ConfigError unless they multiply to
    the world size."""
    rep, shard, tp, pp = (cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree,
                          cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree)
    if rep == -1 and shard == -1:
        raise ConfigError("only one of parallelism.data_parallel_replicate_degree and "
                          "data_parallel_shard_degree may be -1")
    if -1 in (rep, shard):
        fixed = (shard if rep == -1 else rep) * tp * pp
        if world_size % fixed:
            raise ConfigError(
                f"world size {world_size} is not divisible by the fixed degrees: data_parallel_"
                f"{'shard' if rep == -1 else 'replicate'}_degree ({shard if rep == -1 else rep}) x "
                f"tensor_parallel_degree ({tp}) x pipeline_parallel_degree ({pp}) = {fixed}"
            )
        if rep == -1:
            rep = world_size // fixed
        else:
            shard = world_size // fixed
    if rep * shard * tp * pp != world_size:
        raise ConfigError(
            f"parallel degrees must multiply to the world size {world_size}: "
            f"data_parallel_replicate_degree ({rep}) x data_parallel_shard_degree ({shard}) x "
            f"tensor_parallel_degree ({tp}) x pipeline_parallel_degree ({pp}) = {rep * shard * tp * pp}"
        )
    return rep, shard, tp, pp


def grad_accum_steps(config: JobConfig, dp: int) -> int:
    """Micro-batches per optimizer step so that training.global_batch_size is honoured."""
    t = config.training
    per_pass = t.local_batch_size * dp
    global_batch = per_pass if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_pass:
        raise ConfigError(
            f"training.global_batch_size ({global_batch}) must be a multiple of training.local_batch_size "
            f"({t.local_batch_size}) x data-parallel degree ({dp}) = {per_pass}"
        )
    return global_batch // per_pass


def check_for_world(config: JobConfig, world_size: int) -> None:
    """The checks that need the world size (run by the launcher before any process starts)."""
    rep, shard, _, _ = resolve_degrees(config.parallelism, world_size)
    grad_accum_steps(config, rep * shard)


def _get_section(config: JobConfig, dotted: str) -> Any:
    section: Any = config
    for part in dotted.split("."):
        section = getattr(section, part)
    return section


# --------------------------------------------------------------------------------------------------
# Output: TOML dump, --help text, markdown reference
# --------------------------------------------------------------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)


def to_toml(config: JobConfig) -> str:
    """The resolved config as TOML (keys whose value is None are written as comments)."""
    lines = []
    for section, _ in iter_sections():
        obj = _get_section(config, section)
        lines.append(f"[{section}]")
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                continue
            lines.append(f"# {f.name} = None" if v is None else f"{f.name} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def documented_keys():
    """Yield (section, field name, type, default, doc) for every key, in declaration order."""
    defaults = JobConfig()
    for section, cls in iter_sections():
        docs = field_docs(cls)
        obj = _get_section(defaults, section)
        for f in dataclasses.fields(cls):
            tp = _hints(cls)[f.name]
            if not _is_section(tp):
                yield section, f.name, tp, getattr(obj, f.name), docs.get(f.name, "")


def help_text() -> str:
    lines = [
        "usage: run_train.sh [--section.key value | --section.key=value | --section.bool_key] ...",
        "",
        "Keys are read from the TOML file given by CONFIG_FILE (or --job.config_file), then overridden on",
        "the command line. Lists are comma-separated. Every key, with its default:",
    ]
    current = None
    for section, name, tp, default, doc in documented_keys():
        if section != current:
            lines += ["", f"[{section}]  {SECTION_DOC.get(section, '')}"]
            current = section
        lines.append(f"  --{section}.{name}  ({type_name(tp)}, default {default!r})")
        lines += [f"      {doc_line}" for doc_line in doc.splitlines()]
    return "\n".join(lines) + "\n"


def markdown_reference() -> str:
    """docs/config.md; a test checks the committed file equals this output."""
    out = [
        "# Configuration reference",
        "",
        "Generated from `trainer/config.py` by `python -m trainer.config --markdown > docs/config.md`;",
        "a test fails when this file and the code disagree.",
        "",
        "Keys are set in a TOML file (`CONFIG_FILE=path ./run_train.sh` or `--job.config_file path`) and",
        "overridden on the command line as `--section.key value` or `--section.key=value` (booleans also as",
        "a bare `--section.key`; lists comma-separated). Precedence: command line > TOML > defaults.",
    ]
    current = None
    for section, name, tp, default, doc in documented_keys():
        if section != current:
            out += ["", f"## [{section}]", "", SECTION_DOC.get(section, ""), "", "| key | type | default | meaning |",
                    "| --- | --- | --- | --- |"]
            current = section
        shown = "None" if default is None else _toml_value(default)
        tname = type_name(tp).replace("|", "\\|")
        doc = doc.replace("\n", " ").replace("|", "\\|")
        out.append(f"| `{name}` | {tname} | `{shown}` | {doc} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--markdown"]:
        print(markdown_reference(), end="")
        return 0
    if any(a in ("-h", "--help") for a in argv):
        print(help_text())
        return 0
    check_only = "--check" in argv
    argv = [a for a in argv if a != "--check"]
    try:
        config = load_config(argv)
        if check_only:
            # The launcher's pre-flight: fail in a fraction of a second, before torchrun starts.
            check_for_world(config, int(os.environ.get("WORLD_SIZE", "1")))
            return 0
        print(to_toml(config))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
