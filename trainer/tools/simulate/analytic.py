"""The simulated quantities by formula: parameter bytes per rank, the collectives of one micro-batch, the
FLOPs of one micro-batch, and ``trainer plan``'s memory estimate for the same layout.

Everything is per rank and per micro-batch (one forward and backward of ``local_batch_size`` sequences;
with pipelining, one local batch through the rank's stage); an optimizer step repeats it
``grad_accum_steps`` times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.parallel.dims import ParallelDims
from trainer.tools.plan.memory import Layout as PlanLayout
from trainer.tools.plan.memory import Shape, checkpointed_layers, memory_estimate, muon_exchange_bytes

# The tensor-parallel plan of trainer/parallel/parallelize.py (apply_tp), by parameter name: colwise
# Linear layers and the rowwise-sharded embedding split dim 0 of their weight, rowwise Linear layers dim 1;
# norms are replicated.
TP_DIM0 = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "feed_forward.w1.weight",
           "feed_forward.w3.weight", "output.weight", "tok_embeddings.weight", "shared_experts.w1.weight",
           "shared_experts.w3.weight")
TP_DIM1 = ("attention.wo.weight", "feed_forward.w2.weight", "shared_experts.w2.weight", "moe.experts.w1",
           "moe.experts.w3")
TP_DIM2 = ("moe.experts.w2",)  # the routed experts ([experts, out, in]) split on their hidden units

# The matmuls selective "op" checkpointing recomputes: a block runs wq, wk, wv, wo, w1, w3, w2 and the
# policy in parallelize._op_policy saves every other matmul output (the 1st, 3rd, ...), so wk, wo and w3
# are recomputed in backward; SDPA outputs are saved.
SELECTIVE_OP_RECOMPUTED = ("wk", "wo", "w3")


@dataclass(frozen=True)
class Stage:
    """The part of the model one rank holds."""

    layers: int
    first: bool
    last: bool


def stage_of(n_layers: int, modules: list[str] | None) -> Stage:
    if modules is None:
        return Stage(n_layers, True, True)
    return Stage(sum(m.startswith("layers.") for m in modules), "tok_embeddings" in modules, "output" in modules)


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


def local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """A parameter's shape on one TP rank (the degrees divide the sharded dimensions)."""
    shape = list(shape)
    for dim, names in enumerate((TP_DIM0, TP_DIM1, TP_DIM2)):
        if tp > 1 and name.endswith(names):
            shape[dim] //= tp
    return tuple(shape)


def sharded_elements(param_shapes: dict[str, tuple[int, ...]], dims: ParallelDims) -> int:
    """Elements of this rank's parameter shards: each parameter's TP-local shape, split over the FSDP
    shards along dim 0 with FSDP2's padding (every shard holds ceil(dim0 / dp_shard) rows); routed experts
    fewer than the shards along dim 1. Under expert parallel a rank's routed experts are ``1 / ep`` of them,
    sharded over the ``dp_shard x cp / ep`` ranks that hold the same ones."""
    total = 0
    shard = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1  # FSDP shards over dp_shard x cp
    for name, shape in param_shapes.items():
        local = list(local_shape(name, shape, dims.tp))
        routed = ".moe.experts." in name
        over = shard
        if routed and dims.ep > 1:
            local[0] //= dims.ep
            over = dims.dp_shard * dims.cp // dims.ep
        # A mixture of experts' routed weights ([experts, out, in]) with fewer experts than shards: FSDP shards
        # them on dim 1 instead (trainer/parallel/parallelize.py).
        dim = 1 if routed and local[0] < over else 0
        total += math.ceil(local[dim] / over) * math.prod(local) // local[dim]
    return total


# --------------------------------------------------------------------------------------------------
# Collectives of one micro-batch
# --------------------------------------------------------------------------------------------------


def _units(s: Shape, stage: Stage, tp: int) -> tuple[int, int]:
    """Elements per rank (before FSDP) of one block and of the root module (embedding, final norm, output)."""
    block = int(s.layer_matrices) // tp + s.layer_norms
    root = (s.embedding // tp if stage.first else 0) + ((s.vocab * s.dim) // tp + s.dim if stage.last else 0)
    return block, root


def fsdp_collectives(s: Shape, dims: ParallelDims, stage: Stage, compute_bytes: int, reduce_bytes: int,
                     reshard_after_forward: str, last_moe: bool = False) -> dict[tuple[str, str], float]:
    """FSDP2/HSDP bytes of one micro-batch without pipelining (``apply_fsdp``'s units and resharding):
    every unit all-gathered in forward (compute dtype), again in backward unless it stayed gathered (by
    default: every block but the last, and the embeddings, are gathered again; the last block and
    [norm, output] stay gathered; "always" gathers everything again, "never" nothing), its gradient
    reduce-scattered once (reduce dtype) and, with HSDP, the reduced shard all-reduced over the replicas.
    Under expert parallel a block's routed experts are a unit of their own: ``1 / ep`` of them on this rank,
    sharded over the ``dp_shard x cp / ep`` ranks holding the same ones. ``last_moe``: whether the last block
    has an MoE (it stays gathered). FSDP2's padding is not counted."""
    if not dims.fsdp_enabled or dims.pp > 1:
        return {}
    block, root = _units(s, stage, dims.tp)
    layers = stage.layers
    blocks = layers * block  # every block of the stage (an average times their number: their sum)
    last = block
    if s.moe_layers:  # the last block as it is, dense or MoE
        ffn = s.moe_ffn_matrices if last_moe else 3 * s.dim * s.ffn
        last = (s.attention_matrices + ffn) / dims.tp + s.layer_norms
    # Expert parallel: the routed experts of each MoE block, on this rank, apart from the rest.
    routed = s.routed_expert_matrices / dims.tp if dims.ep > 1 else 0.0
    moe_blocks = layers * s.moe_layers / s.n_layers if s.moe_layers else 0
    experts_held = moe_blocks * routed / dims.ep
    experts_last = routed / dims.ep if last_moe else 0.0
    blocks -= moe_blocks * routed
    last -= routed if last_moe else 0.0
    embedding = s.embedding // dims.tp if stage.first else 0
    held = blocks + root
    if reshard_after_forward == "always":
        regathered, experts_regathered = held, experts_held
    elif reshard_after_forward == "never":
        regathered = experts_regathered = 0
    else:
        regathered, experts_regathered = blocks - last + embedding, experts_held - experts_last
    out: dict[tuple[str, str], float] = {}
    shard = dims.dp_shard * dims.cp  # context parallel: FSDP shards over the flattened dp_shard x cp
    shard_group = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
    if shard > 1:
        out[("all_gather", shard_group)] = compute_bytes * (held + regathered)
        out[("reduce_scatter", shard_group)] = reduce_bytes * held
    expert_shard = shard // dims.ep
    if experts_held and expert_shard > 1:
        group = "efsdp_cp" if dims.cp > 1 else "efsdp"
        out[("all_gather", group)] = compute_bytes * (experts_held + experts_regathered)
        out[("reduce_scatter", group)] = reduce_bytes * experts_held
    if dims.dp_replicate > 1:
        out[("all_reduce", "dp_replicate")] = reduce_bytes * (held / shard + experts_held / expert_shard)
    return out


def ep_collectives(s: Shape, dims: ParallelDims, stage: Stage, tokens: int, compute_bytes: int,
                   ac: str) -> dict[tuple[str, str], float]:
    """Expert-parallel bytes of one micro-batch (trainer/parallel/expert.py), evenly routed, as the simulator
    counts them (each all-to-all's whole input, the share staying on the rank included): per MoE block the
    token counts (``experts`` int64), the ``top_k x tokens x dim`` copies out and their outputs back, and in
    backward their gradients both ways. A recomputed block repeats its forward's (its experts' outputs are
    recomputed: see :func:`step_flops`)."""
    if dims.ep == 1 or not s.moe_layers:
        return {}
    layers = stage.layers * s.moe_layers / s.n_layers
    recomputed = 0 if ac == "selective_op" else checkpointed_layers(stage.layers, ac) * s.moe_layers / s.n_layers
    forward = 2 * s.top_k * tokens * s.dim * compute_bytes + 8 * s.experts
    backward = 2 * s.top_k * tokens * s.dim * compute_bytes
    return {("all_to_all", "ep"): forward * (layers + recomputed) + backward * layers}


def cp_collectives(s: Shape, dims: ParallelDims, stage: Stage, sequences: int, seq_len: int, compute_bytes: int,
                   ac: str, method: str) -> dict[tuple[str, str], float]:
    """Context-parallel bytes of one micro-batch (trainer/parallel/context.py), per block as ``trainer plan``
    counts them (``context_parallel_traffic``): ``allgather`` all-gathers keys and values in forward and
    returns their gradients in backward (an all-to-all, then a sum); ``alltoall`` exchanges q, k, v and the
    output both ways.
    Recomputation repeats the forward's collectives of every checkpointed block (activation checkpointing
    saves no collective's output)."""
    from trainer.tools.plan.memory import Layout as PlanLayout
    from trainer.tools.plan.memory import context_parallel_traffic

    if dims.cp == 1:
        return {}
    layout = PlanLayout(dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, sequences, seq_len, cp=dims.cp,
                        cp_method=method)
    per_block = context_parallel_traffic(s, layout, compute_bytes, sequences)
    layers = stage.layers
    recomputed = checkpointed_layers(layers, ac)
    forward = per_block["forward"] * (layers + recomputed)
    if method == "allgather":
        return {("all_gather", "cp"): forward, ("all_to_all", "cp"): per_block["backward"] * layers}
    return {("all_to_all", "cp"): forward + per_block["backward"] * layers}


def tp_collectives(s: Shape, dims: ParallelDims, stage: Stage, tokens: int, compute_bytes: int,
                   ac: str) -> dict[tuple[str, str], float]:
    """Tensor-parallel bytes of one micro-batch (sequence parallel, ``apply_tp``): each block all-gathers
    the normalised input of attention and of the MLP and reduce-scatters the outputs of wo and w2, each a
    ``tokens x dim`` tensor; backward does the converse. The embedding's output is reduce-scattered and
    the final norm's output all-gathered for the output layer. Recomputation repeats the forward's
    collectives: under full AC the two all-gathers and wo's reduce-scatter per block (torch's checkpoint
    stops recomputing once backward has all it needs, before w2 and its reduce-scatter), under selective
    "op" AC the two all-gathers (it saves reduce-scatter outputs). The loss-parallel and norm-gradient
    all-reduces (a few numbers per token) are not counted."""
    if dims.tp == 1:
        return {}
    a = compute_bytes * tokens * s.dim
    layers = stage.layers
    gathers = 2 * layers * 2  # forward + backward
    scatters = 2 * layers * 2
    if stage.first:
        scatters += 1  # embedding output, forward
        gathers += 1  # its gradient, backward
    if stage.last:
        gathers += 1  # final norm output into the output layer
        scatters += 1  # its gradient
    if ac == "selective_op":
        gathers += 2 * layers
    elif ac != "none":
        recomputed = checkpointed_layers(layers, ac)
        gathers, scatters = gathers + 2 * recomputed, scatters + recomputed
    return {("all_gather", "tp"): a * gathers, ("reduce_scatter", "tp"): a * scatters}


def pipeline_p2p(s: Shape, dims: ParallelDims, stage: Stage, microbatches: int, mb_tokens: int,
                 act_bytes: int) -> dict[tuple[str, str], float]:
    """Per local batch: a stage that is not first receives each micro-batch's activations and sends back
    their gradient; one that is not last sends its output and receives its gradient. Under TP the
    activations between stages are sequence-sharded."""
    count = (0 if stage.first else 1) + (0 if stage.last else 1)
    if dims.pp == 1 or count == 0:
        return {}
    one = act_bytes * mb_tokens * s.dim / dims.tp
    return {("send", "pp"): microbatches * one * count, ("recv", "pp"): microbatches * one * count}


# --------------------------------------------------------------------------------------------------
# FLOPs of one micro-batch
# --------------------------------------------------------------------------------------------------


def muon_collectives(s: Shape, dims: ParallelDims, stage: Stage, coordinate: dict[str, int], ns_bytes: int,
                     ) -> dict[tuple[str, str], float]:
    """Muon's two all-to-alls of one optimizer step over the shard group (dp_shard x tp), the bytes this rank
    (at mesh ``coordinate``) sends: its shards of every block matrix, then the whole matrices it owns
    (``trainer.tools.plan.memory.muon_exchange_bytes``)."""
    n = dims.dp_shard * dims.tp
    if n <= 1:
        return {}
    label = "+".join(d for d in ("dp_shard", "tp") if getattr(dims, d) > 1)
    group_rank = coordinate.get("dp_shard", 0) * dims.tp + coordinate.get("tp", 0)
    exchange = muon_exchange_bytes(s, stage.layers, n, group_rank, ns_bytes)
    return {("all_to_all", label): exchange["gather"] + exchange["scatter"]}


def step_flops(s: Shape, stage: Stage, tokens: int, seq_len: int, tp: int, ac: str) -> dict[str, float]:
    """FLOPs one rank runs: ``model`` is the PaLM count (``flops_per_token``: 6 per matmul parameter per
    token, 12 L H Q T for attention; forward + backward) of this rank's share; ``flash_recompute`` is
    what torch's SDPA backward formula adds (it counts flash attention recomputing the scores: backward
    2.5x forward instead of 2x); ``ac_recompute`` is the forward work activation checkpointing repeats:
    a checkpointed block's forward up to w2 (torch's non-reentrant checkpoint stops recomputing once
    backward has every tensor it needs, and w2's output is not one; an MoE block's routed w2 is), or under
    selective "op" AC the matmuls it does not save."""
    h, kv, ffn = s.dim, s.kv_dim, s.ffn
    sizes = {"wq": h * h, "wk": h * kv, "wv": h * kv, "wo": h * h, "w1": h * ffn, "w3": h * ffn, "w2": h * ffn}
    layer_fwd = 2 * tokens * sum(sizes.values()) / tp
    attn_fwd = 4 * tokens * seq_len * h / tp  # QK^T and AV, full (non-causal) count as in PaLM
    output_fwd = 2 * tokens * s.vocab * h / tp if stage.last else 0
    L = stage.layers
    model = 3 * (L * (layer_fwd + attn_fwd) + output_fwd)
    if ac == "selective_op":
        recompute = L * 2 * tokens * sum(sizes[m] for m in SELECTIVE_OP_RECOMPUTED) / tp
    elif ac != "none":
        recomputed = checkpointed_layers(L, ac)
        recompute = recomputed * (layer_fwd - 2 * tokens * sizes["w2"] / tp + attn_fwd)
        # An MoE block's routed experts' w2 is recomputed too: the unsorting of their outputs saves its index
        # after it (the shared experts run last, so their w2 is not).
        recompute += recomputed * s.moe_layers / s.n_layers * 2 * tokens * h * s.top_k * s.expert_ffn / tp
    else:
        recompute = 0.0
    flash = L * attn_fwd / 2
    return {"model": model, "flash_recompute": flash, "ac_recompute": recompute,
            "total": model + flash + recompute}


# --------------------------------------------------------------------------------------------------
# trainer plan's memory estimate
# --------------------------------------------------------------------------------------------------


def plan_memory(s: Shape, dims: ParallelDims, config, stage: Stage) -> dict:
    """``trainer.tools.plan.memory.memory_estimate`` for this layout and this rank's pipeline stage, with its terms
    grouped as the simulation reports them."""
    from trainer.tools.plan.cli import ac_name

    t, p = config.training, config.parallelism
    layout = PlanLayout(dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, t.local_batch_size, t.seq_len,
                        ac_name(config), p.pipeline_parallel_microbatch_size, cp=dims.cp,
                        cp_method=p.context_parallel_rotate_method,
                        block_causal=config.model.attn_mask_type == "block_causal", ep=dims.ep)
    compute = "float32" if t.mixed_precision_param == "float32" else "bfloat16"
    which = "first" if stage.first else "last" if stage.last else "middle"
    est = memory_estimate(s, layout, compute_dtype=compute, cpu_offload=t.enable_cpu_offload,
                          reshard_after_forward=p.fsdp_reshard_after_forward, stage=which,
                          optimizer=config.optimizer.name)
    return {
        "params": est["params"], "grads": est["grads"], "optimizer": est["optimizer"],
        "weight_copies": est["weight_copies"],
        "activations": est["activations"] + est["recompute"] + est["final_norm"] + est["loss"],
        "total": est["total"], "sum": est["sum"], "precision": est["precision"], "stage_layers": est["stage_layers"],
    }
