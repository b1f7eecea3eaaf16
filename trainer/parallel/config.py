"""The parallelism config sections and their rules: [parallelism], [activation_checkpoint], [compile] and
[quantize] (float8 matmuls; torchtitan's MX and grouped-GEMM keys, accepted at their defaults).

Also the pure layout arithmetic the rules share with the runtime: degrees against the world size
(``resolve_degrees``), the pipeline split (``schedule_name``, ``plan_stages``) and its micro-batches
(``n_microbatches``). No torch import: the launcher's pre-flight runs these rules before torchrun starts.
``dims.py`` and ``pipeline.py`` build on them. The string under each field is its documentation (``--help``
and docs/config.md).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Literal

from trainer.errors import ConfigError
from trainer.models.config import config_model_args

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
    """Ranks each sequence is split over (context parallelism): every rank holds seq_len / degree tokens of
    each sequence, and attention exchanges keys/values (or heads) between them. Needs training.seq_len
    divisible by 2 x degree (head-tail load balancing). See docs/parallelism.md."""
    context_parallel_load_balancer: str | None = "headtail"
    """How the sequence is split over the context-parallel ranks: "headtail" (the sequence in 2 x degree
    chunks, rank r holding chunks r and 2 x degree - 1 - r, so that causal attention costs every rank the
    same). The only one."""
    context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather"
    """How context-parallel attention exchanges data: "allgather" (every rank gathers all keys and values,
    its own queries attend to them; Llama 3's method) or "alltoall" (Ulysses: sequence and heads are
    exchanged so that each rank attends over the whole sequence with heads / degree heads; needs the heads
    and key/value heads divisible by the degree)."""
    expert_parallel_degree: int = 1
    """Ranks the routed experts of each MoE layer are split over (expert parallelism; a mixture-of-experts model
    only): each holds num_experts / degree of them, and token copies travel to their expert's rank and back by
    all-to-all. The EP ranks are data-parallel ranks: the degree must divide data_parallel_shard_degree (and
    the number of experts); FSDP then shards each rank's experts over the dp_shard / degree ranks holding the
    same ones. See docs/moe.md."""
    expert_tensor_parallel_degree: int = 1
    """Tensor-parallel ranks each routed expert is split over under expert parallel: 1 or tensor_parallel_degree,
    and with both expert and tensor parallel it must be tensor_parallel_degree (each rank's experts split on their
    hidden units over the TP ranks, as torchtitan's ETP = TP; borrowing the TP ranks for expert parallel, its ETP = 1,
    is not implemented). Without expert parallel, tensor parallel always splits the experts. See docs/moe.md."""
    expert_parallel_comm_backend: Literal["standard", "deepep"] = "standard"
    """Refused unless "standard" (torch.distributed's all-to-all; DeepEP is not here)."""


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
    (with selective "op" checkpointing the router's matmul output is saved like any other)."""
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
class MXLinear:
    mxfp8_dim1_cast_kernel_choice: Literal["triton", "cuda", "torch"] = "triton"
    """Refused unless "triton": MX (microscaling) training is not implemented here."""
    recipe_name: str = "mxfp8_cublas"
    """Refused unless "mxfp8_cublas": MX (microscaling) training is not implemented here."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """The modules MX quantisation would leave alone. Read only with quantize.linear.mx in model.converters,
    which is refused (MX training is not implemented here), so any value loads and changes nothing."""


@dataclass
class QuantizeLinear:
    float8: Float8 = field(default_factory=Float8)
    mx: MXLinear = field(default_factory=MXLinear)


@dataclass
class Float8GroupedMM:
    fqns: list[str] | str = field(default_factory=list)
    """The modules float8 grouped GEMMs would convert (torchtitan: ["experts"]). Read only with
    quantize.grouped_mm.float8 in model.converters, which is refused (not implemented yet), so any value
    loads and changes nothing."""


@dataclass
class MXGroupedMM:
    recipe_name: Literal["mxfp8"] = "mxfp8"
    """Accepted (its only value); read only with quantize.grouped_mm.mx in model.converters, which is refused."""
    fqns: list[str] | str = field(default_factory=list)
    """The modules MX grouped GEMMs would convert. Read only with quantize.grouped_mm.mx in model.converters,
    which is refused (MX training is not implemented here), so any value loads and changes nothing."""


@dataclass
class QuantizeGroupedMM:
    float8: Float8GroupedMM = field(default_factory=Float8GroupedMM)
    mx: MXGroupedMM = field(default_factory=MXGroupedMM)


@dataclass
class Quantize:
    linear: QuantizeLinear = field(default_factory=QuantizeLinear)
    grouped_mm: QuantizeGroupedMM = field(default_factory=QuantizeGroupedMM)


SECTION_DOC = {
    "parallelism": "How the model is spread over ranks.",
    "activation_checkpoint": "Trading compute for activation memory.",
    "compile": "torch.compile.",
    "quantize.linear.float8": "float8 matmuls via torchao.",
    "quantize.linear.mx": "torchtitan's MX quantisation (not implemented here; its converter is refused).",
    "quantize.grouped_mm.float8": "torchtitan's float8 grouped GEMMs for the experts (not implemented yet; its "
                                  "converter is refused).",
    "quantize.grouped_mm.mx": "torchtitan's MX grouped GEMMs for the experts (not implemented; its converter is "
                              "refused).",
}


# Schedules with one stage per rank; the others run several (virtual) stages per rank.
SINGLE_STAGE = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B"}
# Looped: rank r holds stages r, r + pp, r + 2 pp, ...
LOOPED = {"Interleaved1F1B": "ScheduleInterleaved1F1B", "LoopedBFS": "ScheduleLoopedBFS",
          "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble"}
# V-shaped: rank r holds stages r and 2 pp - 1 - r, so the first and last stage share rank 0.
V_SHAPED = {"ZBVZeroBubble": "ScheduleZBVZeroBubble", "DualPipeV": "ScheduleDualPipeV"}
SCHEDULES = {**SINGLE_STAGE, **LOOPED, **V_SHAPED}

# Converters model.converters may name (each one is applied by trainer/parallel/float8.py).
CONVERTERS = {"quantize.linear.float8"}


def check_config(config) -> None:
    """The rules of these sections that need no world size."""
    p = config.parallelism
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "pipeline_parallel_microbatch_size",
                "context_parallel_degree"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallelism.{key} must be >= 1, got {getattr(p, key)}")
    for key in ("data_parallel_shard_degree", "data_parallel_replicate_degree"):
        value = getattr(p, key)
        if value == 0 or value < -1:
            raise ConfigError(f"parallelism.{key} must be -1 or >= 1, got {value}")
    if config.activation_checkpoint.mode == "selective":
        opt = config.activation_checkpoint.selective_ac_option
        if opt != "op" and not (opt.isdigit() and int(opt) >= 1):
            raise ConfigError(f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer, got {opt!r}")
    if p.pipeline_parallel_degree > 1 and config.validation.enable:
        raise ConfigError("validation.enable is not supported with pipeline_parallel_degree > 1 yet; "
                          "evaluate checkpoints with `trainer eval` instead")
    schedule_name(p.pipeline_parallel_schedule)
    if p.context_parallel_load_balancer != "headtail":
        raise ConfigError(f"parallelism.context_parallel_load_balancer = {p.context_parallel_load_balancer!r} is not "
                          "supported: the only load balancer is \"headtail\"")
    f8 = config.quantize.linear.float8
    if f8.enable_fsdp_float8_all_gather and f8.recipe_name != "tensorwise":
        raise ConfigError('quantize.linear.float8.enable_fsdp_float8_all_gather needs recipe_name = "tensorwise"')
    if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
        raise ConfigError("quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp precomputes the scales of "
                          "float8 all-gathers: it needs enable_fsdp_float8_all_gather = true")
    for c in config.model.converters:
        if c not in CONVERTERS:
            raise ConfigError(f"model.converters: unknown converter {c!r}; valid: {sorted(CONVERTERS)}")


def check_layout(config, world_size: int) -> int:
    """Degrees against the world size, and the model's heads and layers against tensor and pipeline
    parallel; returns the data-parallel degree (for the data layer's batch and shard rules)."""
    rep, shard, tp, pp = resolve_degrees(config.parallelism, world_size)
    args = config_model_args(config)
    kv = args.num_kv_heads
    if tp > 1 and (args.n_heads % tp or kv % tp):
        raise ConfigError(f"parallelism.tensor_parallel_degree ({tp}) must divide the number of attention heads "
                          f"({args.n_heads}) and key/value heads ({kv})")
    if tp > 1 and config.training.seq_len % tp:
        raise ConfigError(f"training.seq_len ({config.training.seq_len}) must be a multiple of "
                          f"tensor_parallel_degree ({tp}): sequence parallel splits the sequence over the TP ranks")
    if tp > 1 and args.ffn_hidden_dim % tp:
        raise ConfigError(f"parallelism.tensor_parallel_degree ({tp}) must divide the SwiGLU hidden size "
                          f"({args.ffn_hidden_dim})")
    etp = config.parallelism.expert_tensor_parallel_degree
    if etp not in (1, tp):
        raise ConfigError(f"parallelism.expert_tensor_parallel_degree ({etp}) must be 1 or tensor_parallel_degree "
                          f"({tp})")
    check_context_parallel(config, args, tp)
    check_expert_parallel(config, args, shard)
    if pp > 1 and args.tie_word_embeddings:
        raise ConfigError(f"model.tie_word_embeddings (flavor {config.model.flavor}) cannot be trained with "
                          f"pipeline_parallel_degree {pp}: the embedding and the output layer live on different "
                          "stages; set model.tie_word_embeddings = false (trains them untied) or drop pipeline "
                          "parallel")
    if pp > 1:
        plan_stages(config, args.n_layers)
        n_microbatches(config, schedule_name(config.parallelism.pipeline_parallel_schedule))
    return rep * shard


def check_expert_parallel(config, args, dp_shard: int) -> None:
    """An expert-parallel degree that cannot split this model's experts or these data-parallel ranks."""
    ep = config.parallelism.expert_parallel_degree
    if ep < 1:
        raise ConfigError(f"parallelism.expert_parallel_degree must be >= 1, got {ep}")
    if ep == 1:
        return
    if args.moe is None:
        raise ConfigError(f"parallelism.expert_parallel_degree ({ep}) splits the experts of a mixture of experts, and "
                          f"flavor {config.model.flavor} has none: set it to 1, or choose an MoE flavor (debug_moe, "
                          "llama4's) or model.moe.num_experts")
    if args.moe.num_experts % ep:
        raise ConfigError(f"parallelism.expert_parallel_degree ({ep}) must divide the number of experts "
                          f"({args.moe.num_experts})")
    if dp_shard % ep:
        raise ConfigError(f"parallelism.expert_parallel_degree ({ep}) must divide data_parallel_shard_degree "
                          f"({dp_shard}): the expert-parallel ranks are data-parallel ranks")


def check_context_parallel(config, args, tp: int) -> None:
    """A context-parallel degree that cannot split this sequence (head-tail: 2 x degree chunks) or, with
    Ulysses (alltoall), these heads."""
    p = config.parallelism
    cp = p.context_parallel_degree
    if cp == 1:
        return
    seq_len = config.training.seq_len
    if seq_len % (2 * cp):
        raise ConfigError(f"training.seq_len ({seq_len}) must be a multiple of 2 x context_parallel_degree "
                          f"({2 * cp}): the head-tail split gives each rank two of 2 x {cp} equal chunks")
    if tp > 1 and (seq_len // cp) % tp:
        raise ConfigError(f"training.seq_len / context_parallel_degree ({seq_len // cp}) must be a multiple of "
                          f"tensor_parallel_degree ({tp}): sequence parallel splits each CP rank's tokens over the "
                          "TP ranks")
    if p.context_parallel_rotate_method == "alltoall" and (args.n_heads // tp) % cp:
        raise ConfigError(f"parallelism.context_parallel_rotate_method = \"alltoall\" needs the attention heads per "
                          f"tensor-parallel rank ({args.n_heads // tp}) divisible by context_parallel_degree ({cp}): "
                          "Ulysses gives each CP rank heads / degree heads; use \"allgather\" or another degree")


def resolve_degrees(cfg: Parallelism, world_size: int) -> tuple[int, int, int, int]:
    """(dp_replicate, dp_shard, tp, pp) with -1 resolved; raises ConfigError unless they multiply, with
    context_parallel_degree, to the world size."""
    rep, shard, tp, pp = (cfg.data_parallel_replicate_degree, cfg.data_parallel_shard_degree,
                          cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree)
    cp = cfg.context_parallel_degree
    if rep == -1 and shard == -1:
        raise ConfigError("only one of parallelism.data_parallel_replicate_degree and "
                          "data_parallel_shard_degree may be -1")
    if -1 in (rep, shard):
        fixed = (shard if rep == -1 else rep) * tp * pp * cp
        if world_size % fixed:
            raise ConfigError(
                f"world size {world_size} is not divisible by the fixed degrees: data_parallel_"
                f"{'shard' if rep == -1 else 'replicate'}_degree ({shard if rep == -1 else rep}) x "
                f"tensor_parallel_degree ({tp}) x pipeline_parallel_degree ({pp})"
                + (f" x context_parallel_degree ({cp})" if cp > 1 else "") + f" = {fixed}"
            )
        if rep == -1:
            rep = world_size // fixed
        else:
            shard = world_size // fixed
    if rep * shard * tp * pp * cp != world_size:
        raise ConfigError(
            f"parallel degrees must multiply to the world size {world_size}: "
            f"data_parallel_replicate_degree ({rep}) x data_parallel_shard_degree ({shard}) x "
            f"tensor_parallel_degree ({tp}) x pipeline_parallel_degree ({pp})"
            + (f" x context_parallel_degree ({cp})" if cp > 1 else "") + f" = {rep * shard * tp * pp * cp}"
        )
    return rep, shard, tp, pp


def schedule_name(name: str) -> str:
    """The canonical schedule name (case-insensitive match) or a ConfigError listing the valid ones."""
    for valid in SCHEDULES:
        if valid.lower() == name.lower():
            return valid
    close = difflib.get_close_matches(name, list(SCHEDULES), n=1)
    raise ConfigError(f"parallelism.pipeline_parallel_schedule: unknown schedule {name!r}"
                      + (f" (did you mean {close[0]!r}?)" if close else "") + f"; valid: {', '.join(SCHEDULES)}")


def n_microbatches(config, schedule: str) -> int:
    """Pipeline micro-batches per step (local_batch_size / pipeline_parallel_microbatch_size), or a
    ConfigError when the schedule cannot run that many over pipeline_parallel_degree stages."""
    t, p = config.training, config.parallelism
    if t.local_batch_size % p.pipeline_parallel_microbatch_size:
        raise ConfigError(f"training.local_batch_size ({t.local_batch_size}) must be a multiple of "
                          f"parallelism.pipeline_parallel_microbatch_size ({p.pipeline_parallel_microbatch_size})")
    n = t.local_batch_size // p.pipeline_parallel_microbatch_size
    pp = p.pipeline_parallel_degree
    if schedule not in SINGLE_STAGE and n % pp:
        raise ConfigError(f"schedule {schedule} needs the number of pipeline micro-batches ({n} = local_batch_size / "
                          f"pipeline_parallel_microbatch_size) to be a multiple of pipeline_parallel_degree ({pp})")
    if schedule == "1F1B" and n < pp:
        raise ConfigError(f"schedule 1F1B needs at least as many micro-batches ({n}) as stages ({pp}); "
                          "lower pipeline_parallel_microbatch_size or raise local_batch_size")
    return n


@dataclass
class StagePlan:
    num_stages: int  # over all ranks (virtual stages included)
    modules: list[list[str]]  # module names per stage, e.g. ["tok_embeddings", "layers.0", ...]

    def stages_of_rank(self, pp_rank: int, pp: int, schedule: str) -> list[int]:
        per_rank = self.num_stages // pp
        if schedule in V_SHAPED:
            return [pp_rank, self.num_stages - 1 - pp_rank]
        return [pp_rank + k * pp for k in range(per_rank)]


def plan_stages(config, n_layers: int) -> StagePlan:
    """Decide how many (virtual) stages there are and which modules each holds."""
    p = config.parallelism
    pp = p.pipeline_parallel_degree
    schedule = schedule_name(p.pipeline_parallel_schedule)
    if p.module_fqns_per_model_part:
        modules = [list(m) for m in p.module_fqns_per_model_part]
        _check_explicit(modules, n_layers)
        num_stages = len(modules)
    else:
        if p.pipeline_parallel_layers_per_stage is not None:
            per = p.pipeline_parallel_layers_per_stage
            if per < 1 or n_layers % per:
                raise ConfigError(f"parallelism.pipeline_parallel_layers_per_stage ({per}) must divide the model's "
                                  f"{n_layers} layers")
            num_stages = n_layers // per
        else:
            num_stages = pp * (1 if schedule in SINGLE_STAGE else 2)
        if num_stages > n_layers:
            raise ConfigError(f"{num_stages} pipeline stages for {n_layers} layers: every stage needs a layer")
        modules = _even_split(n_layers, num_stages)
    if num_stages % pp:
        raise ConfigError(f"{num_stages} pipeline stages do not divide over pipeline_parallel_degree {pp}")
    per_rank = num_stages // pp
    if schedule in SINGLE_STAGE and per_rank != 1:
        raise ConfigError(f"schedule {schedule} runs one stage per rank, but the split gives {per_rank}; "
                          f"use an interleaved or V schedule ({', '.join([*LOOPED, *V_SHAPED])}) or fewer stages")
    if schedule in V_SHAPED and per_rank != 2:
        raise ConfigError(f"schedule {schedule} runs exactly two stages per rank, but the split gives {per_rank}")
    if schedule in LOOPED and per_rank < 2:
        raise ConfigError(f"schedule {schedule} needs at least two stages per rank, but the split gives {per_rank}")
    return StagePlan(num_stages=num_stages, modules=modules)


def _even_split(n_layers: int, num_stages: int) -> list[list[str]]:
    """Layers as even as possible; the remainder goes to the middle stages, since the first stage also
    holds the embedding and the last one the output layer."""
    base, extra = divmod(n_layers, num_stages)
    counts = [base] * num_stages
    order = sorted(range(num_stages), key=lambda i: (i in (0, num_stages - 1), abs(i - num_stages / 2)))
    for i in order[:extra]:
        counts[i] += 1
    modules, start = [], 0
    for i, count in enumerate(counts):
        names = [f"layers.{j}" for j in range(start, start + count)]
        start += count
        if i == 0:
            names.insert(0, "tok_embeddings")
        if i == num_stages - 1:
            names += ["norm", "output"]
        modules.append(names)
    return modules


def _check_explicit(modules: list[list[str]], n_layers: int) -> None:
    flat = [m for stage in modules for m in stage]
    expected = ["tok_embeddings", *[f"layers.{i}" for i in range(n_layers)], "norm", "output"]
    if sorted(flat) != sorted(expected) or len(flat) != len(set(flat)):
        missing = sorted(set(expected) - set(flat))
        unknown = sorted(set(flat) - set(expected))
        raise ConfigError(
            "parallelism.module_fqns_per_model_part must name every module exactly once, in order "
            f"(missing: {missing or 'none'}, unknown: {unknown or 'none'})"
        )
    if flat != expected:
        raise ConfigError("parallelism.module_fqns_per_model_part must list the modules in model order")
