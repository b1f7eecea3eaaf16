"""Hugging Face Llama, Mixtral and Llama 4 interop: ``trainer export`` (DCP -> HF folder) and import (HF folder ->
our model).

The key mapping, the RoPE permutation of ``wq``/``wk``, reading an HF safetensors folder and loading it
into a (sharded) model live in the core, :mod:`trainer.models.llama.hf_adapter` (the trainer starts
from HF weights with them); this module re-exports them and adds the config conversion, the export and
the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from tokenizer.policy import align_export, token_string
from torchtitan_ext.native import load_hf_model, parse_dtype
from trainer.checkpoint.offline import CheckpointNotFound, checkpoint_model_entries
from trainer.errors import CheckpointError
from trainer.tools.checkpoint_model import describe_checkpoint
from trainer.models.llama.hf_adapter import (
    SAFETENSORS_INDEX,
    hf_config_to_args,
    hf_names,
    hf_order,
    hf_to_native_key,
    hf_to_native_state_dict,
    load_hf_into,
    load_hf_state_dict,
    native_to_hf_key,
    llama4_name,
    llama4_weight_names,
    native_to_hf_state_dict,
    native_to_llama4_state_dict,
    native_weight_names,
    permute_for_hf,
    unpermute_from_hf,
)
from trainer.parallel import clean_fqn

logger = logging.getLogger("trainer")

__all__ = [
    "export_checkpoint",
    "hf_config_to_args",
    "hf_to_native_key",
    "hf_to_native_state_dict",
    "hf_format",
    "llama4_hf_config",
    "llama_hf_config",
    "load_hf_into",
    "load_hf_model",
    "load_hf_state_dict",
    "main",
    "mixtral_differences",
    "native_to_hf_key",
    "native_to_hf_state_dict",
    "permute_for_hf",
    "plan_shards",
    "tiktoken_to_tokenizer_json",
    "unpermute_from_hf",
    "write_hf_folder",
    "write_tokenizer_files",
]


# --------------------------------------------------------------------------------------------------
# config.json <-> LlamaModelArgs
# --------------------------------------------------------------------------------------------------


def llama_hf_config(args, *, max_position_embeddings: int, dtype: torch.dtype, tokenizer=None) -> dict[str, Any]:
    """A ``config.json`` for ``LlamaForCausalLM`` equivalent to our ``LlamaModelArgs``; for a mixture of
    experts with Mixtral's routing (:func:`mixtral_differences` empty), one for ``MixtralForCausalLM``."""
    rope_scaling = None
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope_scaling = {
            "rope_type": "llama3",
            "factor": float(s.factor),
            "low_freq_factor": float(s.low_freq_factor),
            "high_freq_factor": float(s.high_freq_factor),
            "original_max_position_embeddings": int(s.original_max_position_embeddings),
        }
    dtype_name = str(dtype).replace("torch.", "")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(max_position_embeddings),
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "tie_word_embeddings": bool(args.tie_word_embeddings),
        "vocab_size": args.vocab_size,
        "use_cache": True,
        "torch_dtype": dtype_name,
    }
    if args.moe is not None:
        for key in ("mlp_bias", "pretraining_tp"):
            del config[key]
        config.update(
            architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=args.expert_hidden_dim,
            num_local_experts=args.moe.num_experts, num_experts_per_tok=args.moe.top_k,
            # transformers adds it (per batch) only with output_router_logits; ours was per sequence.
            router_aux_loss_coef=float(args.moe.aux_loss_coeff), router_jitter_noise=0.0,
            output_router_logits=False, sliding_window=None)
        del config["attention_bias"]
    if tokenizer is not None:
        config["bos_token_id"] = tokenizer.bos_id
        config["eos_token_id"] = tokenizer.eos_id
        if tokenizer.pad_id is not None:
            config["pad_token_id"] = tokenizer.pad_id
    return config


def llama4_hf_config(args, *, max_position_embeddings: int, dtype: torch.dtype, tokenizer=None) -> dict[str, Any]:
    """A ``config.json`` for ``Llama4ForCausalLM`` (model_type ``llama4_text``) equivalent to our arguments
    (:func:`llama4_differences` empty): the attention keys, the MoE blocks (none for a dense model: an
    empty ``moe_layers``), the dense blocks' ``intermediate_size_mlp``."""
    base = llama_hf_config(dataclasses.replace(args, moe=None), max_position_embeddings=max_position_embeddings,
                           dtype=dtype, tokenizer=tokenizer)
    scaling = base.pop("rope_scaling") or {"rope_type": "default"}
    for key in ("mlp_bias", "pretraining_tp", "rope_theta"):
        base.pop(key, None)
    moe = args.moe
    nope = args.no_rope_layer_interval
    config = {
        **base, "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
        "intermediate_size": args.expert_hidden_dim if moe is not None else args.ffn_hidden_dim,
        "intermediate_size_mlp": args.ffn_hidden_dim,
        "num_local_experts": moe.num_experts if moe is not None else 1,
        "num_experts_per_tok": moe.top_k if moe is not None else 1,
        "interleave_moe_layer_step": args.interleave_moe_layer_step,
        "moe_layers": [i for i in range(args.n_layers) if args.is_moe_layer(i)],
        "no_rope_layers": [int(args.uses_rope(i)) for i in range(args.n_layers)],
        "no_rope_layer_interval": nope if nope is not None else args.n_layers + 1,
        "attention_chunk_size": args.attention_chunk_size, "use_qk_norm": bool(args.use_qk_norm),
        "attn_temperature_tuning": bool(args.attn_temperature_tuning), "floor_scale": int(args.floor_scale),
        "attn_scale": float(args.attn_scale), "router_aux_loss_coef": float(moe.aux_loss_coeff) if moe else 0.0,
        "router_jitter_noise": 0.0, "output_router_logits": False,
        "rope_parameters": {**scaling, "rope_theta": float(args.rope_theta)},
    }
    config["layer_types"] = ["chunked_attention" if rope and args.attention_chunk_size is not None
                             else "full_attention" for rope in config["no_rope_layers"]]
    return config


# --------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 5GB or 500MB")
    value, unit = float(m.group(1)), m.group(2).upper().replace("I", "").rstrip("B")
    return int(value * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[unit])


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes:
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file, readable as the user's other files are (the umask's mode: safetensors alone
    creates 0600 files, which colleagues on a shared cluster cannot read)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    umask = os.umask(0)  # reading the umask sets it: put it back at once (the export is single-threaded)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save_safetensors_sharded(sd: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int) -> list[str]:
    """``model-0000i-of-0000N.safetensors`` files plus ``model.safetensors.index.json``."""
    shards = plan_shards([(k, v.numel() * v.element_size()) for k, v in sd.items()], max_shard_bytes)
    weight_map, names = {}, []
    for i, keys in enumerate(shards, start=1):
        fname = _shard_name(i, len(shards))
        write_safetensors({k: sd[k] for k in keys}, folder / fname)
        weight_map.update({k: fname for k in keys})
        names.append(fname)
    _write_index(folder, weight_map, sum(t.numel() * t.element_size() for t in sd.values()))
    return names


def write_tokenizer_files(tokenizer, tokenizer_path: Path, folder: Path, model_max_length: int) -> list[str]:
    """Copy/convert the run's tokenizer into ``folder`` so that ``AutoTokenizer`` loads it."""
    src = Path(tokenizer_path)
    if src.is_dir():
        src = next((src / n for n in ("tokenizer.json", "tokenizer.model") if (src / n).is_file()), src)
    written = []
    if src.suffix == ".json":
        shutil.copyfile(src, folder / "tokenizer.json")
        written.append("tokenizer.json")
        for extra in ("tokenizer_config.json", "special_tokens_map.json"):
            if (src.parent / extra).is_file():
                shutil.copyfile(src.parent / extra, folder / extra)
                written.append(extra)
        if "tokenizer_config.json" not in written:
            cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                   "model_max_length": model_max_length}
            for key, tid in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id),
                             ("pad_token", tokenizer.pad_id)):
                tok = token_string(tokenizer, tid)
                if tok is not None:
                    cfg[key] = tok
            (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            written.append("tokenizer_config.json")
        return written
    if type(tokenizer).__name__ == "SentencePieceTokenizer":
        shutil.copyfile(src, folder / "tokenizer.model")
        cfg = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
               "clean_up_tokenization_spaces": False, "legacy": False, "model_max_length": model_max_length}
        for key, tid in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id),
                         ("pad_token", tokenizer.pad_id)):
            tok = token_string(tokenizer, tid)
            if tok is not None:
                cfg[key] = tok
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return ["tokenizer.model", "tokenizer_config.json"]
    # tiktoken (Llama 3): build the equivalent HF tokenizer.json (byte-level BPE, Llama 3 split pattern,
    # special tokens after the ranks, BOS prepended by the post-processor, as in Meta's HF release).
    shutil.copyfile(src, folder / "tokenizer.model")
    tiktoken_to_tokenizer_json(src, folder / "tokenizer.json")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
           "eos_token": "<|end_of_text|>", "clean_up_tokenization_spaces": False,
           "model_max_length": model_max_length}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    written += ["tokenizer.model", "tokenizer.json", "tokenizer_config.json"]
    return written


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what HF's ByteLevel pre-tokenizer uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def tiktoken_to_tokenizer_json(ranks_path: Path, out: Path) -> None:
    """Write a Llama 3 tiktoken ranks file as an equivalent HF ``tokenizer.json``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    from tokenizer import LLAMA3_PATTERN, LLAMA3_SPECIAL_TOKENS
    from tokenizer import load_ranks

    ranks = load_ranks(Path(ranks_path))
    table = _bytes_to_unicode()
    to_str = lambda b: "".join(table[x] for x in b)  # noqa: E731
    vocab = {to_str(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in ranks.items():  # every split of a token into two tokens is a merge at its rank
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(ranks[left], ranks[right], rank, left, right) for left, right in splits]
    merges.sort(key=lambda m: (m[2], m[0], m[1]))
    bpe = models.BPE(vocab, [(to_str(m[3]), to_str(m[4])) for m in merges], fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    n_base = len(ranks)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIAL_TOKENS])
    bos, bos_id = "<|begin_of_text|>", n_base + LLAMA3_SPECIAL_TOKENS.index("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    tok.save(str(out))


def mixtral_differences(args) -> list[str]:
    """How a mixture of experts differs from Mixtral's (one of the two Hugging Face MoE layouts written here): every
    block an MoE, softmax scores renormalised over the top k, applied to the experts' outputs, no shared
    experts, no scaling. Empty for a Mixtral-shaped model."""
    moe = args.moe
    if moe is None:
        return []
    out = []
    if args.interleave_moe_layer_step != 1:
        out.append(f"interleave_moe_layer_step {args.interleave_moe_layer_step} (Mixtral: every block)")
    if moe.score_func != "softmax":
        out.append(f"score_func {moe.score_func} (Mixtral: softmax)")
    if not moe.route_norm:
        out.append("route_norm false (Mixtral renormalises the top-k scores)")
    if moe.route_scale != 1.0:
        out.append(f"route_scale {moe.route_scale} (Mixtral: 1)")
    if moe.score_before_experts:
        out.append("score_before_experts true (Mixtral scales the experts' outputs)")
    if moe.num_shared_experts:
        out.append(f"num_shared_experts {moe.num_shared_experts} (Mixtral: none)")
    return out


def llama4_differences(args) -> list[str]:
    """How a model differs from what Llama 4's Hugging Face layout holds: its MoE blocks route as Llama 4's
    (sigmoid scores of the top-k, applied to the experts' inputs, not renormalised or scaled) with one shared
    expert of the experts' size. Empty for a Llama 4-shaped model (or a dense one)."""
    moe = args.moe
    if moe is None:
        return []
    out = []
    if moe.score_func != "sigmoid":
        out.append(f"score_func {moe.score_func} (Llama 4: sigmoid)")
    if moe.route_norm:
        out.append("route_norm true (Llama 4 does not renormalise the top-k scores)")
    if moe.route_scale != 1.0:
        out.append(f"route_scale {moe.route_scale} (Llama 4: 1)")
    if not moe.score_before_experts:
        out.append("score_before_experts false (Llama 4 scales the experts' inputs)")
    if moe.num_shared_experts != 1:
        out.append(f"num_shared_experts {moe.num_shared_experts} (Llama 4: 1)")
    return out


def hf_format(args, flavor: str) -> str:
    """The Hugging Face layout a model is written as: "llama" (dense), "mixtral" (an MoE with Mixtral's
    routing) or "llama4" (Llama 4's attention or routing); ValueError naming what differs otherwise."""
    attention = llama4_attention(args)
    if args.moe is None and not attention:
        return "llama"
    mixtral = mixtral_differences(args)
    if not mixtral and not attention:
        return "mixtral"
    llama4 = llama4_differences(args)
    if not llama4:
        return "llama4"
    layouts = "Llama 4's Hugging Face layout (its attention keys are set)" if attention else \
        "neither Llama 4's nor Mixtral's Hugging Face layout"
    why = "; ".join(llama4) + ("" if attention else f"; for Mixtral's: {'; '.join(mixtral)}")
    raise ValueError(f"{flavor} is a mixture of experts that {layouts} can hold: model.moe {why}; keep the DCP "
                     "checkpoint (trainer eval and generate read it)")


def llama4_attention(args) -> list[str]:
    """The [model] keys of Llama 4's attention a model sets (only Llama 4's layout holds them)."""
    keys = [("no_rope_layer_interval", args.no_rope_layer_interval is not None),
            ("attention_chunk_size", args.attention_chunk_size is not None), ("use_qk_norm", args.use_qk_norm),
            ("attn_temperature_tuning", args.attn_temperature_tuning and args.no_rope_layer_interval is not None)]
    return [f"model.{key}" for key, used in keys if used]




def _check_expert_bias(biases: dict[str, torch.Tensor], drop: bool) -> None:
    """Mixtral and Llama 4 have no routing bias: refuse to drop a non-zero one (it changes which experts tokens
    go to) unless asked, and say that it was dropped."""
    moved = [name for name, bias in biases.items() if bias.abs().max().item() > 0]
    if not moved:
        return
    if not drop:
        raise ValueError(f"{moved[0]} is not zero ({len(moved)} block(s) trained with model.moe.load_balance_coeff): "
                         "Mixtral and Llama 4 have no routing bias, so the export would route tokens to other experts "
                         "than this model does; pass --drop_expert_bias to export without it, or keep the DCP "
                         "checkpoint")
    logger.warning("the expert bias of %d block(s) is dropped (--drop_expert_bias): the export routes without it "
                   "and its logits differ from this model's", len(moved))


def _note_capacity(args) -> None:
    if args.moe is not None and args.moe.capacity_factor is not None:
        logger.warning("model.moe.capacity_factor %s is not exported: Mixtral and Llama 4 run every token through "
                       "their experts (dropless)", args.moe.capacity_factor)


def export_checkpoint(
    checkpoint: str | Path,
    output: str | Path,
    *,
    dtype: str | torch.dtype = "bf16",
    step: int | None = None,
    config_path: str | Path | None = None,
    flavor: str | None = None,
    tokenizer_path: str | None = None,
    max_shard_size: str = "5GB",
    max_position_embeddings: int | None = None,
    overwrite: bool = False,
    drop_expert_bias: bool = False,
) -> Path:
    """Write a DCP checkpoint as a Hugging Face Llama (Mixtral, Llama 4) folder; returns the folder. Nothing is
    written when the model has no such layout."""
    out = Path(output)
    if out.exists() and not out.is_dir():  # before reading the checkpoint: a mistake costs no time
        raise FileExistsError(f"--output {out} is a file; name a folder for the Hugging Face files")
    info = describe_checkpoint(checkpoint, config_path=config_path, flavor=flavor,
                               tokenizer_path=tokenizer_path, step=step)
    fmt = hf_format(info.args, info.config.model.flavor)
    _check_expert_bias(_checkpoint_biases(info), drop_expert_bias)
    _note_capacity(info.args)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"output folder {out} is not empty; pass --overwrite to replace its contents")
        for old in list(out.glob("model*.safetensors")) + [out / SAFETENSORS_INDEX]:
            old.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    _export_streaming(info, out, parse_dtype(dtype), parse_size(max_shard_size), fmt)
    context = max_position_embeddings or info.context_length
    _write_metadata_files(info.args, out, parse_dtype(dtype), context, info.tokenizer, info.tokenizer_path, fmt)
    align_export(out, info.config, info.tokenizer)  # the tokenizer files follow training's BOS/EOS rule
    logger.info("exported %s (%s) as %s to %s", info.step_dir, info.config.model.flavor,
                str(parse_dtype(dtype)).replace("torch.", ""), out)
    return out


def _is_bias(name: str) -> bool:
    return name.endswith(".moe.expert_bias")


def _checkpoint_biases(info) -> dict[str, torch.Tensor]:
    """The expert biases a checkpoint holds (none without load_balance_coeff)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    entries = {k: v for k, v in checkpoint_model_entries(info.step_dir).items() if _is_bias(k)}
    if not entries:
        return {}
    flat = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in entries.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(flat, storage_reader=dcp.FileSystemReader(str(info.step_dir)))
    return {clean_fqn(k[len("model."):]): v for k, v in flat.items()}


def _to_hf(sd: dict[str, torch.Tensor], args, fmt: str) -> dict[str, torch.Tensor]:
    """Our weights as the Hugging Face layout ``fmt`` names them (:func:`hf_format`)."""
    if fmt == "llama4":
        return native_to_llama4_state_dict(sd)
    return native_to_hf_state_dict(sd, args.n_heads, args.num_kv_heads, tie_word_embeddings=args.tie_word_embeddings)


def _export_streaming(info, out: Path, dtype: torch.dtype, max_shard_bytes: int, fmt: str = "llama") -> None:
    """Read the checkpoint one output shard at a time (DCP loads any subset of keys), so the export
    needs memory for one shard, not for the whole model. A shard takes whole Hugging Face weights: Llama 4's
    fused experts need a block's ``w1`` and ``w3`` together."""
    import warnings

    import torch.distributed.checkpoint as dcp

    args = info.args
    entries = {clean_fqn(k[len("model."):]): (k, v) for k, v in checkpoint_model_entries(info.step_dir).items()}
    wanted = native_weight_names(args)
    missing = [k for k in wanted if k not in entries]
    extra = [k for k in entries if k not in wanted and not (args.tie_word_embeddings and k == "output.weight")
             and not _is_bias(k)]
    if missing or extra:
        raise ValueError(f"checkpoint {info.step_dir} does not match {info.config.model.flavor}: missing "
                         f"{missing[:5]}, unexpected {extra[:5]} (wrong --flavor?)")
    expected_shapes = _expected_shapes(args)
    for name in wanted:
        shape = tuple(entries[name][1].size)
        if shape != expected_shapes[name]:
            raise ValueError(f"checkpoint {info.step_dir}: {name} has shape {shape}, flavor "
                             f"{info.config.model.flavor!r} expects {expected_shapes[name]} (wrong --flavor?)")
    experts = args.moe.num_experts if args.moe is not None else 0
    units: dict[str, list[str]] = {}  # one Hugging Face weight (or expert stack) -> the native weights in it
    for k in wanted:
        units.setdefault(llama4_name(k) if fmt == "llama4" else k, []).append(k)
    ordered = sorted(units, key=lambda u: hf_order(u if fmt == "llama4" else hf_names(u, experts)[0]))
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [(u, sum(itemsize * int(torch.Size(entries[k][1].size).numel()) for k in units[u])) for u in ordered]
    shards = plan_shards(sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        keys = [k for u in shard for k in units[u]]
        flat = {entries[k][0]: torch.empty(entries[k][1].size, dtype=entries[k][1].properties.dtype) for k in keys}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(flat, storage_reader=dcp.FileSystemReader(str(info.step_dir)))
        part = _to_hf({k: flat[entries[k][0]].to(dtype) for k in keys}, args, fmt)
        fname = _shard_name(i, len(shards))
        write_safetensors(part, out / fname)
        weight_map.update({k: fname for k in part})
        del flat, part
    _write_index(out, weight_map, sum(n for _, n in sizes))


def _expected_shapes(args) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        from trainer.models.llama.model import Transformer

        model = Transformer(args)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _write_metadata_files(args, out: Path, dtype: torch.dtype, context: int, tokenizer, tokenizer_path,
                          fmt: str = "llama") -> list[str]:
    """config.json, generation_config.json and the tokenizer files."""
    make = llama4_hf_config if fmt == "llama4" else llama_hf_config
    config = make(args, max_position_embeddings=context, dtype=dtype, tokenizer=tokenizer)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is None:
        return ["config.json"]
    generation = {"_from_model_config": True, "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    files = ["config.json", "generation_config.json"]
    if tokenizer_path is not None:
        files += write_tokenizer_files(tokenizer, Path(tokenizer_path), out, context)
    return files


def write_hf_folder(sd: dict[str, torch.Tensor], args, out: str | Path, *, dtype="bf16",
                    max_position_embeddings: int, tokenizer=None, tokenizer_path: str | Path | None = None,
                    max_shard_size: str = "5GB", source: str = "model", drop_expert_bias: bool = False) -> Path:
    """Write a native state dict (our FQNs) as a Hugging Face Llama folder, or a Mixtral or Llama 4 one
    (:func:`hf_format`; anything else is refused before anything is written; so is
    a non-zero expert bias unless ``drop_expert_bias``)."""
    out = Path(out)
    torch_dtype = parse_dtype(dtype)
    fmt = hf_format(args, "this model")
    _check_expert_bias({k: v for k, v in sd.items() if _is_bias(k)}, drop_expert_bias)
    _note_capacity(args)
    sd = {k: v for k, v in sd.items() if not _is_bias(k)}
    shapes = _expected_shapes(args)
    for name, tensor in sd.items():
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{source}: {name} has shape {tuple(tensor.shape)}, the config expects {shapes[name]}")
    out.mkdir(parents=True, exist_ok=True)
    if args.tie_word_embeddings and "output.weight" in sd and "tok_embeddings.weight" in sd:
        if not torch.equal(sd["output.weight"], sd["tok_embeddings.weight"]):
            logger.warning("tie_word_embeddings is set but output.weight differs from tok_embeddings.weight; "
                           "exporting tok_embeddings.weight")
    if args.tie_word_embeddings:
        sd = {k: v for k, v in sd.items() if k != "output.weight"}
    hf_sd = _to_hf({k: v.to(torch_dtype) for k, v in sd.items()}, args, fmt)
    experts = args.moe.num_experts if args.moe is not None else 0
    expected = set(llama4_weight_names(args)) if fmt == "llama4" else \
        {hf for k in native_weight_names(args) for hf in hf_names(k, experts)}
    if set(hf_sd) != expected:
        raise ValueError(f"{source} does not match the model config: missing {sorted(expected - set(hf_sd))[:5]}, "
                         f"unexpected {sorted(set(hf_sd) - expected)[:5]}")
    shards = save_safetensors_sharded(hf_sd, out, parse_size(max_shard_size))
    files = _write_metadata_files(args, out, torch_dtype, max_position_embeddings, tokenizer, tokenizer_path, fmt)
    logger.info("exported %s as %s to %s: %d safetensors shard(s), %s", source,
                str(torch_dtype).replace("torch.", ""), out, len(shards), ", ".join(files))
    return out


def main(argv: list[str] | None = None) -> int:
    """``trainer export --checkpoint DIR --output DIR [--dtype bf16]``."""
    from trainer import logs

    parser = argparse.ArgumentParser(
        prog="trainer export",
        description="Export a DCP checkpoint (any parallel layout) to a Hugging Face Llama folder (Mixtral or "
                    "Llama 4 for a mixture of experts with their routing, Llama 4 for its attention): config.json, "
                    "sharded safetensors with index, tokenizer files.")
    parser.add_argument("--checkpoint", required=True, help="DCP step folder, a folder of step-N folders "
                        "(latest complete one), or a run's dump folder")
    parser.add_argument("--output", required=True, help="folder to write (created; must be empty unless --overwrite)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "bfloat16", "float16", "float32"],
                        help="weight dtype of the export (default bf16)")
    parser.add_argument("--step", type=int, default=None, help="export this step instead of the latest")
    parser.add_argument("--config", default=None, help="the run's config.toml (default: found above the checkpoint)")
    parser.add_argument("--flavor", default=None, help="override the model flavor of the run's config")
    parser.add_argument("--tokenizer", default=None, help="override the tokenizer path of the run's config")
    parser.add_argument("--max_shard_size", default="5GB", help="largest safetensors file (default 5GB)")
    parser.add_argument("--max_position_embeddings", type=int, default=None,
                        help="context length written to config.json (default: the flavor's)")
    parser.add_argument("--overwrite", action="store_true", help="replace the weights in a non-empty --output")
    parser.add_argument("--drop_expert_bias", action="store_true",
                        help="export a mixture of experts trained with model.moe.load_balance_coeff without its "
                             "routing bias (Mixtral has none; the export then routes some tokens differently)")
    args = parser.parse_args(argv)
    logs.setup()
    try:
        out = export_checkpoint(args.checkpoint, args.output, dtype=args.dtype, step=args.step,
                                config_path=args.config, flavor=args.flavor, tokenizer_path=args.tokenizer,
                                max_shard_size=args.max_shard_size,
                                max_position_embeddings=args.max_position_embeddings, overwrite=args.overwrite,
                                drop_expert_bias=args.drop_expert_bias)
    except CheckpointError as e:  # a damaged checkpoint: nothing was exported
        print(f"trainer export: {e}", file=sys.stderr)
        return e.exit_code
    except (CheckpointNotFound, FileExistsError, ValueError, KeyError) as e:
        print(f"trainer export: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
