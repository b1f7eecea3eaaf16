"""Apply tensor parallel, activation checkpointing, torch.compile and FSDP2/HSDP to a Llama model.

The order matters and is fixed here: TP first (it rewrites Linear layers into DTensor shards), then
activation checkpointing (wraps each block), then compile (compiles each wrapped block), then FSDP
(shards whatever parameters the previous steps left, per block). Everything runs on the meta device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import logging
import os
from collections import defaultdict

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.errors import ConfigError

from trainer.parallel import distribute_parameter
from trainer.parallel.dims import ParallelDims
from trainer.torch_compat import checkpoint_wrapper, enable_async_tensor_parallel

if TYPE_CHECKING:
    from trainer.config import JobConfig

logger = logging.getLogger("trainer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh, config: JobConfig,
                param_dtype: torch.dtype) -> nn.Module:
    """Apply every configured transformation to ``model`` (a whole model or one pipeline stage).
    ``param_dtype`` is the compute dtype FSDP casts parameters to."""
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], loss_parallel=not config.parallelism.disable_loss_parallel,
                 float8="quantize.linear.float8" in config.model.converters,
                 float8_rowwise=config.quantize.linear.float8.recipe_name == "rowwise")
        if config.parallelism.enable_async_tensor_parallel:
            if not config.compile.enable or mesh.device_type != "cuda":
                raise ConfigError("parallelism.enable_async_tensor_parallel needs compile.enable and GPUs")
            enable_async_tensor_parallel()
    if dims.ep > 1 or dims.tp > 1:
        from trainer.parallel.expert import shard_experts

        shard_experts(model, dims.ep_mesh, mesh["tp"] if dims.tp > 1 else None, dims.ep_tp_mesh)
    if config.activation_checkpoint.mode != "none":
        apply_ac(model, config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option,
                 config.activation_checkpoint)
    if config.compile.enable and "model" in config.compile.components:
        apply_compile(model, config.compile.backend)
    if dims.cp > 1:
        from trainer.parallel.context import ContextParallel

        model.context_parallel = ContextParallel(mesh["cp"].get_group(), dims.cp, mesh["cp"].get_local_rank(),
                                                 config.parallelism.context_parallel_rotate_method,
                                                 sequence_shards=dims.tp)
    if dims.fsdp_enabled:
        # dp_shard x cp (flattened), with dp_replicate as HSDP's outer dimension: ParallelDims.build_mesh.
        apply_fsdp(
            model,
            dims.fsdp_mesh,
            param_dtype=param_dtype,
            reduce_dtype=DTYPES[config.training.mixed_precision_reduce],
            reshard_after_forward=config.parallelism.fsdp_reshard_after_forward,
            cpu_offload=config.training.enable_cpu_offload,
            pp_enabled=dims.pp > 1,
            experts=dims.expert_fsdp_mesh,
        )
    return model


def _tied(model: nn.Module) -> bool:
    """Whether ``model`` holds both ends of tied word embeddings (pipeline stages never do: refused)."""
    args = getattr(model, "args", None)
    return bool(getattr(args, "tie_word_embeddings", False)) and getattr(model, "tok_embeddings", None) is not None \
        and getattr(model, "output", None) is not None


# --------------------------------------------------------------------------------------------------
# Tensor parallel
# --------------------------------------------------------------------------------------------------


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, float8: bool = False,
             float8_rowwise: bool = False) -> None:
    """Megatron-style TP with sequence parallel: activations between blocks are sharded on the sequence
    dimension (norms run on sequence shards), attention heads and MLP columns are sharded inside blocks."""
    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8 and not float8_rowwise:
        # float8 tensorwise Linear layers need float8-aware TP styles so the all-gathers carry float8.
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise, prepare_input = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

    top: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "norm", None) is not None:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    if "tok_embeddings" in top:
        model.tok_embeddings.register_forward_hook(_detach_view)
    if _tied(model):
        # Each module got its own sharded copy; both are Shard(0) over the vocabulary (row-wise embedding,
        # column-wise output), so the output layer takes the embedding's DTensor and the tie holds.
        model.output.weight = model.tok_embeddings.weight

    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": prepare_input(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            ),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": rowwise(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if getattr(block, "moe_enabled", False):
            _tp_moe(block.moe, plan, tp_mesh)
        else:
            plan.update({
                "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": colwise(),
                "feed_forward.w2": rowwise(output_layouts=Shard(1)),
                "feed_forward.w3": colwise(),
            })
        parallelize_module(block, tp_mesh, plan)


def _detach_view(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output as a tensor of its own instead of a view of the DTensor's local shard. A compiled
    first block given that view sends its gradient past the DTensor's ``to_local`` (the backward then fails
    with "'Tensor' object has no attribute '_local_tensor'"); a copy of ``batch x seq / tp x dim`` avoids it."""
    return output.clone()


def _tp_moe(moe: nn.Module, plan: dict, tp_mesh: DeviceMesh) -> None:
    """Tensor parallel for a block's mixture of experts (trainer/models/moe.py runs it on local tensors): the
    layer takes its TP group's whole sequence (all-gathered) and its partial output is reduce-scattered back to
    sequence shards; the router is replicated, the shared experts split as the dense feed-forward is (the
    routed experts: trainer/parallel/expert.py's ``shard_experts``)."""
    plan["moe"] = PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
        output_layouts=(Partial(),), desired_output_layouts=(Shard(1),), use_local_output=True)
    distribute_parameter(moe.router.gate, "weight", tp_mesh, [Replicate()])
    if moe.shared_experts is not None:
        for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            distribute_parameter(getattr(moe.shared_experts, name), "weight", tp_mesh, [Shard(dim)])
    moe.tensor_parallel = tp_mesh


# --------------------------------------------------------------------------------------------------
# Activation checkpointing
# --------------------------------------------------------------------------------------------------

# Results worth keeping under selective "op" checkpointing: the expensive ops. Everything else
# (norms, activations, RoPE) is recomputed in backward. Operators are named by their registered names
# (aten::_scaled_dot_product_..., as in torchtitan's list), not through a private Python module.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    # float8: the amax of each cast is a cheap op but a reduction over the whole tensor, and with
    # tensor-parallel float8 an all-reduce follows it; recomputing it would repeat both.
    torch.ops.aten.max.default,
}


def _op_policy():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy_fn(ctx, op, *args, **kwargs):
        # Keep every other matmul: saves half the matmul recompute at half the memory of saving all.
        mode = "recompute" if ctx.is_recompute else "forward"
        if op == torch.ops.aten.mm.default:
            meta = ctx_counts[mode]
            meta["mm"] += 1
            if meta["mm"] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    ctx_counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def context_fn():
        ctx_counts.clear()
        return create_selective_checkpoint_contexts(policy_fn)

    return context_fn


def apply_ac(model: nn.Module, mode: str, selective_option: str, ac=None) -> None:
    """Wrap transformer blocks with activation checkpointing (full, every N-th block, or per op). ``ac``
    (the [activation_checkpoint] section) passes torch.utils.checkpoint's own options through."""
    options = dict(preserve_rng_state=False, determinism_check="none")  # callers without the section
    if ac is not None:
        options = dict(preserve_rng_state=ac.preserve_rng_state, determinism_check=ac.determinism_check,
                       debug=ac.debug)

    every = int(selective_option) if mode == "selective" and selective_option != "op" else 1
    for i, (name, block) in enumerate(list(model.layers.items())):
        if i % every:
            continue
        if mode == "selective" and selective_option == "op":
            wrapped = checkpoint_wrapper(block, context_fn=_op_policy(), **options)
        else:
            wrapped = checkpoint_wrapper(block, **options)
        model.layers[name] = wrapped


# --------------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------------


def set_compile_cache(cache_dir: str) -> None:
    """compile.cache_dir: Inductor's on-disk cache, shared between runs (set before anything compiles)."""
    if not cache_dir:
        return
    path = os.path.abspath(os.path.expanduser(cache_dir))
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if previous and os.path.abspath(previous) != path:
        logger.warning("compile.cache_dir %s replaces TORCHINDUCTOR_CACHE_DIR=%s from the environment", path, previous)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


def apply_compile(model: nn.Module, backend: str) -> None:
    """Compile each block separately: identical blocks share one compiled graph, and compile time does
    not grow with depth. A block whose experts are exchanged between ranks (expert parallel) compiles in
    pieces around the exchange, which runs eagerly (its sizes come from the routing, read on the host)."""
    from trainer.models.moe import moe_layers

    for name, block in list(model.layers.items()):
        exchange = any(layer.expert_parallel is not None for layer in moe_layers(block))
        model.layers[name] = torch.compile(block, backend=backend, fullgraph=not exchange)


# --------------------------------------------------------------------------------------------------
# FSDP2 / HSDP
# --------------------------------------------------------------------------------------------------


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: str, cpu_offload: bool, pp_enabled: bool,
               experts: DeviceMesh | None = None) -> None:
    """Shard the embeddings, each block, the output layer, then the root (the final norm), each a group of
    its own (tied embeddings: the shared matrix stays in the root's group, with the final norm): the first all-gather (embeddings) is small and overlaps with nothing, the next ones
    overlap with the compute before them, and the output layer's gradient is reduce-scattered while the
    last block's backward runs instead of after everything. A 2-D ``dp_mesh`` (replicate, shard) gives
    HSDP: reduce-scatter inside a replica group, all-reduce across replicas.

    Under expert parallel, ``experts`` is the mesh of the ranks holding the same experts: each block's routed
    experts are a group of their own over it (trainer/parallel/expert.py)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = {"mesh": dp_mesh, "mp_policy": mp}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if reshard_after_forward == "default":
        # With pipelining every micro-batch runs the stage's forward again before its backward: freeing the
        # gathered parameters after each forward would all-gather them once more per micro-batch.
        reshard = not pp_enabled
    else:
        reshard = reshard_after_forward == "always"
    tied = _tied(model)  # one matrix used first and last: it must be in one group, the root's
    if model.tok_embeddings is not None and not tied:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard, **kwargs)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's backward starts right after the forward ends: keep its parameters gathered.
        last = i == len(blocks) - 1 and reshard_after_forward == "default"
        if experts is not None:
            _shard_experts(block, experts, reshard and not last, kwargs)
        fully_shard(block, reshard_after_forward=reshard and not last,
                    shard_placement_fn=_expert_placement(block, dp_mesh), **kwargs)
    if model.output is not None and not tied:
        # Used first in backward, right after forward: resharding it would only gather it again. (The final
        # norm, a vector, stays with the root.)
        fully_shard(model.output, reshard_after_forward=reshard_after_forward == "always", **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward == "always", **kwargs)


def _expert_placement(block: nn.Module, mesh: DeviceMesh):
    """FSDP's placement for ``block``'s routed experts when it shards them (no expert parallel) over more ranks
    than there are experts: on the hidden dimension, since dim 0 would leave most ranks an expert-sized slice of
    padding (16 experts over 64 ranks: 4x the memory); None (dim 0, FSDP's default) otherwise."""
    from trainer.models.moe import moe_layers

    ranks = mesh.size(mesh.ndim - 1)  # HSDP: the shard dimension
    narrow = {id(p) for layer in moe_layers(block) if layer.expert_parallel is None and layer.num_experts < ranks
              for p in layer.experts.parameters()}
    if not narrow:
        return None
    return lambda param: Shard(1) if id(param) in narrow else None


def _shard_experts(block: nn.Module, mesh: DeviceMesh, reshard: bool, kwargs: dict) -> None:
    """FSDP over the expert mesh for each expert-parallel MoE layer of ``block`` (see :func:`apply_fsdp`). Each rank's
    experts are sharded on the expert dimension, or on the hidden one when there are fewer local experts than
    ranks to shard them over."""
    from trainer.models.moe import moe_layers

    for layer in moe_layers(block):
        if layer.expert_parallel is None:
            continue
        local = layer.num_experts // layer.expert_parallel.degree
        placement = (lambda param: Shard(1)) if local < mesh.size(mesh.ndim - 1) else None
        fully_shard(layer.experts, reshard_after_forward=reshard, shard_placement_fn=placement,
                    **{**kwargs, "mesh": mesh})
