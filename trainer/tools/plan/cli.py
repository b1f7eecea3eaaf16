"""``trainer plan``: parameters, FLOPs per token and memory per GPU for a config on N GPUs.

    trainer plan --config train_configs/llama3_8b.toml --ngpu 8 [--gpu H100] [--json [FILE]] [--section.key value ...]

It prints the model's size (``count_params``, cross-checked against a model built on the meta device) and
training FLOPs per token (``flops_per_token``, the PaLM formula), then an estimate of the memory one GPU
needs for the configured layout, whether that fits the GPU named, and the layouts (FSDP x TP degree,
activation checkpointing mode, local batch size) that fit, best first. Nothing is allocated.

The memory model is trainer/tools/plan/memory.py.

Measured peaks (``torch.cuda.max_memory_allocated`` from ``trainer bench gpu``) go into ``MEASURED``
below or are read from a bench JSON with ``--measured FILE``; the plan then prints them next to its
estimate. None exist yet: no GPU run of this code has been recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, JobConfig, load_config, validate
from trainer.dry_run import model_args_for_plan
from trainer.parallel.config import resolve_degrees
from trainer.tools.plan.memory import (
    AC_MODES,
    CP_MIN_LOCAL_TOKENS,
    GPU_MEMORY_GIB,
    GiB,
    Layout,
    Precision,
    Shape,
    checkpoint_staging_bytes,
    context_parallel_bytes,
    context_parallel_traffic,
    expert_parallel_traffic,
    gpu_memory_gib,
    _stage_layers,
    memory_estimate,
    muon_exchange_bytes,
    search_layouts,
)

logger = logging.getLogger("trainer")

# Measured peak memory (GiB, torch.cuda.max_memory_allocated) of single-GPU runs, to set against the
# estimate. Keys: (flavor, seq_len, local_batch_size, ac mode, variant). Empty until a GPU run is recorded
# (``trainer bench gpu --json F`` writes them; ``trainer plan --measured F`` reads that file directly).
MEASURED: dict[tuple[str, int, int, str, str], float] = {}


# --------------------------------------------------------------------------------------------------
# The config
# --------------------------------------------------------------------------------------------------


def ac_name(config: JobConfig) -> str:
    """The activation-checkpointing mode as plans and simulations name it: none, full, selective_op or
    selective_N (every N-th block)."""
    mode = config.activation_checkpoint.mode
    if mode == "selective":
        opt = config.activation_checkpoint.selective_ac_option
        return "selective_op" if opt == "op" else f"selective_{int(opt)}"
    return mode


def _model_summary(config: JobConfig, args, shape: Shape) -> dict[str, Any]:
    """The model part of the report: shape, parameters (by formula, cross-checked against a model built on the
    meta device and the memory model's arithmetic), FLOPs per token."""
    import torch

    from trainer.models.llama.flops import count_params, flops_per_token, model_num_params
    from trainer.models.llama.model import Transformer

    with torch.device("meta"):
        meta_params = model_num_params(Transformer(args))
    params, active = count_params(args), count_params(args, active=True)
    assert shape.total_params() == params, "plan's parameter arithmetic disagrees with count_params"
    assert shape.active_params() == active, "plan's active parameters disagree"
    return {"name": config.model.name, "flavor": config.model.flavor, "params": params,
            "params_meta_model": meta_params, "params_non_embedding": count_params(args, exclude_embedding=True),
            "params_active": active, "flops_per_token": flops_per_token(args, config.training.seq_len),
            "seq_len": config.training.seq_len, "vocab_size": args.vocab_size, "dim": args.dim,
            "n_layers": args.n_layers, "n_heads": args.n_heads, "n_kv_heads": args.num_kv_heads,
            "ffn_hidden_dim": args.ffn_hidden_dim, "moe": _moe_summary(args)}


def _moe_summary(args) -> str | None:
    """How a mixture of experts is laid out, in words (None for a dense model)."""
    if args.moe is None or not args.n_moe_layers:
        return None
    m = args.moe
    shared = f" + {m.num_shared_experts} shared" if m.num_shared_experts else ""
    return (f"{m.num_experts} experts{shared} of hidden {args.expert_hidden_dim}, top-{m.top_k}, in "
            f"{args.n_moe_layers} of {args.n_layers} blocks")


def plan(config: JobConfig, ngpu: int, gpu: str = "H100", gpu_memory: float | None = None,
         usable_fraction: float = 0.9, max_local_batch: int | None = None, top: int = 10,
         measured: list[dict] | None = None, device: str = "cuda") -> dict[str, Any]:
    """Everything ``trainer plan`` reports, as a JSON-able dict. ``device``: whose attention kernels the
    estimate counts ("cuda", or "cpu": dense masks where CUDA runs FlexAttention)."""
    args, note = model_args_for_plan(config)
    seq_len = config.training.seq_len
    shape = Shape.from_args(args)
    model = _model_summary(config, args, shape)
    params, fpt = model["params"], model["flops_per_token"]
    capacity = (gpu_memory if gpu_memory is not None else gpu_memory_gib(gpu)) * GiB
    compute_dtype = "float32" if config.training.mixed_precision_param == "float32" else "bfloat16"
    cpu_offload = config.training.enable_cpu_offload

    rep, shard, tp, pp = resolve_degrees(config.parallelism, ngpu)
    cp, cp_method = config.parallelism.context_parallel_degree, config.parallelism.context_parallel_rotate_method
    ep = config.parallelism.expert_parallel_degree
    block_causal = config.model.attn_mask_type == "block_causal"
    configured = Layout(rep, shard, tp, pp, config.training.local_batch_size, seq_len, ac_name(config),
                        config.parallelism.pipeline_parallel_microbatch_size, cp=cp, cp_method=cp_method, ep=ep,
                        block_causal=block_causal, device=device)
    optimizer = config.optimizer.name
    est = memory_estimate(shape, configured, compute_dtype=compute_dtype, cpu_offload=cpu_offload,
                          reshard_after_forward=config.parallelism.fsdp_reshard_after_forward, optimizer=optimizer)
    gb = config.training.global_batch_size
    rows = search_layouts(shape, ngpu, seq_len=seq_len, capacity_bytes=capacity, pp=pp,
                          dp_replicate=rep if config.parallelism.data_parallel_replicate_degree != -1 else 1,
                          global_batch=gb,
                          max_local_batch=max_local_batch or max(16, config.training.local_batch_size),
                          compute_dtype=compute_dtype, cpu_offload=cpu_offload, usable_fraction=usable_fraction,
                          cp=cp, cp_method=cp_method, block_causal=block_causal, optimizer=optimizer, ep=ep,
                          device=device)

    def layout_json(lay: Layout) -> dict:
        return dataclasses.asdict(lay) | {"describe": lay.describe()}

    def est_gib(e: dict) -> dict:
        return {k: (round(v / GiB, 3) if isinstance(v, float) else v) for k, v in e.items()}

    ac_table = _activations_by_ac(config, shape, configured, compute_dtype)
    result: dict[str, Any] = {
        "model": model,
        "flops_formula": "6 * N_non_embedding + 12 * n_layers * n_heads * head_dim * seq_len (PaLM, appendix B)",
        "memory_formula": "per token per layer: norm(3) + 2*c*h + 2*c*kv + 4*n_heads + norm(2) + 4*c*F, norm(k) = "
                          "r*h + 4 + (r*h if r == c else k*c*h); see trainer/tools/plan/memory.py and docs/performance.md",
        "gpu": {"name": gpu, "memory_gib": round(capacity / GiB, 2), "usable_fraction": usable_fraction},
        "ngpu": ngpu,
        "configured": {"layout": layout_json(configured), "estimate_gib": est_gib(est),
                       "fits": est["total"] <= usable_fraction * capacity,
                       "activations_by_ac_gib": ac_table,
                       "tokens_per_step": (gb if gb > 0 else configured.local_batch_size * configured.dp) * seq_len},
        "host": _host_memory(config, shape, configured),
        "recommended": None,
        "candidates": [],
        "notes": [],
    }
    result["configured"].update(_muon_exchange(config, shape, args.n_layers, configured))
    if note:
        result["notes"].append(note)
    if cp > 1:
        _add_context_parallel(result, shape, configured, compute_dtype, args.n_layers)
    if ep > 1:
        result["expert_parallel"] = _expert_parallel(shape, configured, compute_dtype, args.moe.num_experts)
    if "quantize.linear.float8" in config.model.converters or config.compile.enable:
        result["notes"].append("estimate is for eager bf16; compile and float8 usually need less activation memory")
    _recommend(result, rows, configured, gb, ngpu, gpu, layout_json, est_gib)
    for r in rows[:top]:
        result["candidates"].append({"layout": layout_json(r["layout"]), "total_gib": round(r["estimate"]["total"] / GiB, 3),
                                     "fits": r["fits"], "grad_accum_steps": r["grad_accum_steps"]})
    result["measured"] = _measured_rows(config, configured, ngpu, est, measured)
    return result


def _activations_by_ac(config: JobConfig, shape: Shape, layout: Layout, compute_dtype: str) -> dict[str, float]:
    """The activation memory (GiB, recomputation included) of ``layout`` under each activation-checkpointing mode."""
    table = {}
    for ac in AC_MODES:
        e = memory_estimate(shape, dataclasses.replace(layout, ac=ac), compute_dtype=compute_dtype,
                            cpu_offload=config.training.enable_cpu_offload,
                            reshard_after_forward=config.parallelism.fsdp_reshard_after_forward,
                            optimizer=config.optimizer.name)
        table[ac] = round((e["activations"] + e["recompute"]) / GiB, 3)
    return table


def _expert_parallel(shape: Shape, layout: Layout, compute_dtype: str, num_experts: int) -> dict:
    """What expert parallelism does to this layout: experts per rank, the all-to-alls' bytes per MoE block and
    per micro-batch (evenly routed)."""
    per_block = expert_parallel_traffic(shape, layout, 4 if compute_dtype == "float32" else 2)
    layers = math.ceil(shape.moe_layers / layout.pp)
    return {"degree": layout.ep, "experts_per_rank": num_experts // layout.ep,
            "all_to_all_gib_per_block": {k: round(v / GiB, 4) for k, v in per_block.items()},
            "all_to_all_gib_per_micro_batch": round(layers * sum(per_block.values()) / GiB, 3)}


def _add_context_parallel(result: dict, shape: Shape, layout: Layout, compute_dtype: str, n_layers: int) -> None:
    """What context parallelism does to this layout, into ``result``: tokens per rank, the collectives'
    bytes per block and per micro-batch, the activation memory it adds (the gathered keys/values and the
    dense mask), and a warning when the sequence per CP rank is too short (``CP_MIN_LOCAL_TOKENS``)."""
    c = 4 if compute_dtype == "float32" else 2
    per_block = context_parallel_traffic(shape, layout, c, layout.local_batch_size)
    precision = Precision.for_layout(layout, compute_dtype)
    layers = math.ceil(n_layers / layout.pp)
    if layout.local_seq_len < CP_MIN_LOCAL_TOKENS:
        result["notes"].append(
            f"warning: context_parallel_degree {layout.cp} leaves {layout.local_seq_len} tokens of each sequence "
            f"per rank, under {CP_MIN_LOCAL_TOKENS}: the collectives' latency is no longer hidden behind the "
            "attention and matmuls; use a lower degree (or none) at this seq_len")
    result["context_parallel"] = {"degree": layout.cp, "rotate_method": layout.cp_method, "tokens_per_rank_per_sequence": layout.local_seq_len,
            "collective_gib_per_block": {k: round(v / GiB, 4) for k, v in per_block.items()},
            "collective_gib_per_micro_batch": round(layers * sum(per_block.values()) / GiB, 3),
            "added_activations_gib": round(context_parallel_bytes(shape, precision, layout, layers,
                                                                  layout.local_batch_size) / GiB, 3),
            "min_tokens_per_rank": CP_MIN_LOCAL_TOKENS}


# How long each checkpoint.async_mode holds its staging copy of the rank's state, in host memory.
STAGING_HELD = {
    "async_with_pinned_mem": "kept for the whole run, pinned on CUDA",
    "async": "allocated at each save, freed once written",
    "disabled": "none: synchronous saves (async modes would copy this much)",
}


def _muon_exchange(config: JobConfig, shape: Shape, n_layers: int, layout: Layout) -> dict[str, Any]:
    """With Muon, the bytes a rank sends in its exchange per optimizer step (the shard group's average)."""
    if config.optimizer.name != "Muon":
        return {}
    ns_bytes = 2 if config.optimizer.muon.ns_dtype == "bfloat16" else 4
    exchange = muon_exchange_bytes(shape, _stage_layers(n_layers, layout.pp), layout.fsdp_shard * layout.tp,
                                   ns_bytes=ns_bytes)
    return {"muon_exchange_gib_per_step": round(sum(exchange.values()) / GiB, 3)}


def _host_memory(config: JobConfig, shape: Shape, layout: Layout) -> dict[str, Any]:
    """Host (CPU) memory per rank that the plan knows of: the background checkpoint save's staging copy."""
    mode = config.checkpoint.async_mode
    return {"checkpoint_staging_gib": round(checkpoint_staging_bytes(shape, layout, config.optimizer.name) / GiB, 3),
            "checkpoint_async_mode": mode, "held": STAGING_HELD[mode]}


def _recommend(result: dict, rows: list[dict], configured: Layout, gb: int, ngpu: int, gpu: str,
               layout_json, est_gib) -> None:
    """The best fitting layout into ``result``, or a note that none fits."""
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        result["notes"].append(f"no layout of {ngpu} GPU(s) fits {gpu}: use more GPUs, pipeline parallel, "
                               "CPU offload or a shorter seq_len")
        return
    best = fitting[0]
    result["recommended"] = {"layout": layout_json(best["layout"]), "estimate_gib": est_gib(best["estimate"]),
                             "grad_accum_steps": best["grad_accum_steps"]}
    if gb <= 0 and best["layout"].local_batch_size != configured.local_batch_size:
        result["notes"].append("training.global_batch_size is -1 (local batch x data-parallel degree): the "
                               "recommended local batch changes the global batch; set global_batch_size to "
                               "keep it fixed")


def _measured_rows(config: JobConfig, layout: Layout, ngpu: int, est: dict, measured: list[dict] | None) -> list:
    """Measured peaks matching this config (single-GPU runs only), beside the estimate."""
    rows = []
    if ngpu != 1:
        return rows
    key = (config.model.flavor, layout.seq_len, layout.local_batch_size, layout.ac)
    for (flavor, seq, lb, ac, variant), gib in MEASURED.items():
        if (flavor, seq, lb, ac) == key:
            rows.append({"variant": variant, "measured_gib": gib, "estimate_gib": round(est["total"] / GiB, 3)})
    for m in measured or []:
        if (m.get("flavor"), m.get("seq_len"), m.get("local_batch_size"), m.get("ac")) == key and m.get("peak_allocated_gib"):
            rows.append({"variant": m.get("variant"), "measured_gib": m["peak_allocated_gib"],
                         "estimate_gib": round(est["total"] / GiB, 3)})
    return rows


def load_measured(path: str) -> list[dict]:
    """The GPU cases of a ``trainer bench ... --json`` file."""
    data = json.loads(Path(path).read_text())
    gpu = data.get("results", {}).get("gpu", {})
    return [c for c in gpu.get("cases", []) if isinstance(c, dict)]


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def format_report(r: dict) -> str:
    m = r["model"]
    lines = [
        f"model      {m['name']} {m['flavor']}: dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads "
        f"({m['n_kv_heads']} kv), ffn {m['ffn_hidden_dim']}, vocab {m['vocab_size']}",
        f"params     {m['params']:,} (count_params; model built on meta: {m['params_meta_model']:,}); "
        f"non-embedding {m['params_non_embedding']:,}"
        + (f"; active per token {m['params_active']:,} ({m['moe']})" if m.get("moe") else ""),
        f"FLOPs      {m['flops_per_token']:,} per token at seq_len {m['seq_len']}  [{r['flops_formula']}]",
        f"GPU        {r['ngpu']} x {r['gpu']['name']} ({r['gpu']['memory_gib']} GiB; fits = total <= "
        f"{r['gpu']['usable_fraction']:.0%} of it)",
        "",
    ]
    c = r["configured"]
    e = c["estimate_gib"]
    lines.append(f"configured layout: {c['layout']['describe']}  [{e['precision']}]")
    lines.append("  memory per GPU (GiB):")
    for k in ("params", "grads", "optimizer", "weight_copies", "activations", "recompute", "final_norm", "loss"):
        lines.append(f"    {k:<14} {e[k]:>10.3f}")
    lines.append(f"    {'sum':<14} {e['sum']:>10.3f}   (every term at once)")
    lines.append(f"    {'total':<14} {e['total']:>10.3f}   (the step's largest moment) -> "
                 f"{'fits' if c['fits'] else 'DOES NOT FIT'}")
    acs = ", ".join(f"{k} {v:.2f}" for k, v in c["activations_by_ac_gib"].items())
    lines.append(f"  activations (+ one recomputed layer) by AC mode: {acs} GiB")
    if "muon_exchange_gib_per_step" in c:
        lines.append(f"  Muon's exchange: {c['muon_exchange_gib_per_step']:.3f} GiB sent per rank per optimizer step "
                     "(two all-to-alls over dp_shard x tp: its shards to the owners, the owned matrices back)")
    h = r["host"]
    lines.append(f"  host memory per rank: checkpoint staging {h['checkpoint_staging_gib']:.3f} GiB "
                 f"(checkpoint.async_mode {h['checkpoint_async_mode']}: {h['held']})")
    if "context_parallel" in r:
        cp = r["context_parallel"]
        traffic = cp["collective_gib_per_block"]
        lines.append(f"  context parallel {cp['degree']} ({cp['rotate_method']}): {cp['tokens_per_rank_per_sequence']} "
                     f"tokens per sequence per rank; collectives {traffic['forward']:.4f} GiB forward + "
                     f"{traffic['backward']:.4f} GiB backward per block ({cp['collective_gib_per_micro_batch']:.3f} GiB "
                     f"per micro-batch); {cp['added_activations_gib']:.3f} GiB of the activations are CP's "
                     "(gathered keys/values, mask)")
    if "expert_parallel" in r:
        ep = r["expert_parallel"]
        traffic = ep["all_to_all_gib_per_block"]
        lines.append(f"  expert parallel {ep['degree']}: {ep['experts_per_rank']} experts per rank (a block's "
                     f"all-gather holds those only); all-to-alls {traffic['forward']:.4f} GiB forward + "
                     f"{traffic['backward']:.4f} GiB backward per MoE block ({ep['all_to_all_gib_per_micro_batch']:.3f} "
                     "GiB per micro-batch), evenly routed")
    for row in r["measured"]:
        lines.append(f"  measured peak ({row['variant']}): {row['measured_gib']:.2f} GiB vs estimate {row['estimate_gib']:.2f}")
    lines.append("")
    if r["recommended"]:
        rec = r["recommended"]
        lines.append(f"recommended: {rec['layout']['describe']} -> {rec['estimate_gib']['total']:.2f} GiB per GPU, "
                     f"{rec['grad_accum_steps']} micro-batch(es) per step")
    lines.append("")
    lines.append(f"  {'tp':>3} {'fsdp':>5} {'ac':<13} {'batch':>5} {'accum':>5} {'GiB':>9}  fits")
    for cand in r["candidates"]:
        lay = cand["layout"]
        lines.append(f"  {lay['tp']:>3} {lay['dp_shard']:>5} {lay['ac']:<13} {lay['local_batch_size']:>5} "
                     f"{cand['grad_accum_steps']:>5} {cand['total_gib']:>9.2f}  {'yes' if cand['fits'] else 'no'}")
    for n in r["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="trainer plan", allow_abbrev=False,
        description="Parameters, FLOPs per token and memory per GPU for a config on N GPUs, and the layouts "
                    "that fit. Other --section.key value arguments override the config.")
    parser.add_argument("--config", required=False, help="TOML config (default: $CONFIG_FILE or built-in defaults)")
    parser.add_argument("--ngpu", type=int, required=True)
    parser.add_argument("--gpu", default="H100", help=f"GPU model: {', '.join(GPU_MEMORY_GIB)}")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="override the GPU's memory")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="whose attention kernels to count: cpu runs block_causal attention with a dense mask "
                             "where cuda runs FlexAttention, and causal allgather CP without one")
    parser.add_argument("--usable-fraction", type=float, default=0.9)
    parser.add_argument("--max-local-batch", type=int, default=None)
    parser.add_argument("--top", type=int, default=10, help="candidate layouts to list")
    parser.add_argument("--measured", default=None, help="a `trainer bench gpu --json` file with measured peaks")
    parser.add_argument("--json", nargs="?", const="-", default=None, help="write JSON (to FILE, or stdout)")
    args, overrides = parser.parse_known_args(argv)
    if args.ngpu < 1:
        parser.error("--ngpu must be >= 1")
    cfg_argv = (["--job.config_file", args.config] if args.config else []) + overrides
    try:
        config = load_config(cfg_argv, env={} if args.config else None)
        validate(config)  # the rules without a world size; plan() resolves the degrees for --ngpu
        measured = load_measured(args.measured) if args.measured else None
        result = plan(config, args.ngpu, args.gpu, args.gpu_memory_gib, args.usable_fraction,
                      args.max_local_batch, args.top, measured, args.device)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print_report(result, format_report, args.json)
    return 0


def print_report(result: dict, formatter, json_path: str | None) -> None:
    """The table on stdout (or the JSON itself with ``--json -``); ``--json FILE`` also writes the JSON."""
    if json_path == "-":
        print(json.dumps(result, indent=2))
        return
    print(formatter(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
