"""Hugging Face Llama <-> our Llama state dicts: names, the RoPE permutation, reading an HF safetensors folder
and loading one into a (sharded) model in place.

Core, so that the trainer can start from HF weights (``checkpoint.initial_load_in_hf``) and every tool reads
an HF ``config.json`` the same way (``hf_config_to_args``); writing HF folders is the export command's.

Key mapping (ours -> ``transformers.LlamaForCausalLM``)::

    tok_embeddings.weight                 model.embed_tokens.weight
    layers.{i}.attention.wq.weight        model.layers.{i}.self_attn.q_proj.weight   (RoPE-permuted)
    layers.{i}.attention.wk.weight        model.layers.{i}.self_attn.k_proj.weight   (RoPE-permuted)
    layers.{i}.attention.wv.weight        model.layers.{i}.self_attn.v_proj.weight
    layers.{i}.attention.wo.weight        model.layers.{i}.self_attn.o_proj.weight
    layers.{i}.feed_forward.w1.weight     model.layers.{i}.mlp.gate_proj.weight
    layers.{i}.feed_forward.w2.weight     model.layers.{i}.mlp.down_proj.weight
    layers.{i}.feed_forward.w3.weight     model.layers.{i}.mlp.up_proj.weight
    layers.{i}.attention_norm.weight      model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm.weight            model.layers.{i}.post_attention_layernorm.weight
    norm.weight                           model.norm.weight
    output.weight                         lm_head.weight   (absent with tie_word_embeddings)

RoPE: our model rotates interleaved pairs ``(2i, 2i+1)`` of each head (Meta's convention); HF's Llama
rotates the halves ``(i, i + head_dim/2)``. Reordering the output rows of ``wq``/``wk`` inside each head,
``row 2i + j -> row j * head_dim/2 + i``, makes the two models compute the same attention scores (the
scores are dot products of q and k, so any common reordering of their head dimensions leaves them
unchanged). This is the permutation of HF's ``convert_llama_weights_to_hf.py``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from trainer.errors import ConfigError
from trainer.models.llama.args import LlamaModelArgs, RopeScaling
from trainer.parallel import clean_fqn

logger = logging.getLogger("trainer")

_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_MAP_INV = {v: k for k, v in _LAYER_MAP.items()}
_TOP_MAP_INV = {v: k for k, v in _TOP_MAP.items()}
_NATIVE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

SAFETENSORS_INDEX = "model.safetensors.index.json"


def permute_for_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of ``wq``/``wk`` from interleaved-pair RoPE order to HF's rotate-half order, per head."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def unpermute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_for_hf`."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def native_to_hf_key(name: str) -> str:
    """The Hugging Face name of our parameter ``name`` (KeyError when it has none)."""
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _NATIVE_LAYER.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def hf_to_native_key(name: str) -> str:
    """Our name of the Hugging Face weight ``name`` (KeyError when it has none)."""
    if name in _TOP_MAP_INV:
        return _TOP_MAP_INV[name]
    m = _HF_LAYER.match(name)
    if m and m.group(2) in _LAYER_MAP_INV:
        return f"layers.{m.group(1)}.{_LAYER_MAP_INV[m.group(2)]}"
    raise KeyError(f"no native name for Hugging Face weight {name!r}")


def hf_order(name: str) -> tuple:
    """Sort key of HF weight names: embeddings, layers in order, final norm, lm_head (the order HF writes shards in)."""
    m = _HF_LAYER.match(name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if "embed_tokens" in name else 2 if name == "model.norm.weight" else 3, 0, name)


def native_weight_names(args) -> list[str]:
    """The native names of every weight a Llama model with ``args`` holds (``output.weight`` only when the
    embeddings are not tied), each of which has a Hugging Face name."""
    keys = ["tok_embeddings.weight", "norm.weight"]
    if not args.tie_word_embeddings:
        keys.append("output.weight")
    for i in range(args.n_layers):
        keys += [f"layers.{i}.{k}" for k in _LAYER_MAP]
    return keys


def native_to_hf_state_dict(sd: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int,
                            tie_word_embeddings: bool = False) -> dict[str, torch.Tensor]:
    """Our FQNs -> HF Llama names, with the RoPE permutation of ``wq``/``wk``."""
    out = {}
    for name, tensor in sd.items():
        if tie_word_embeddings and name == "output.weight":
            continue
        hf_name = native_to_hf_key(name)
        if name.endswith("attention.wq.weight"):
            tensor = permute_for_hf(tensor, n_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = permute_for_hf(tensor, n_kv_heads)
        out[hf_name] = tensor
    return dict(sorted(out.items(), key=lambda kv: hf_order(kv[0])))


def hf_to_native_state_dict(sd: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    """HF Llama names -> our FQNs, undoing the RoPE permutation. ``rotary_emb.inv_freq`` is dropped."""
    out = {}
    for name, tensor in sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        native = hf_to_native_key(name)
        if native.endswith("attention.wq.weight"):
            tensor = unpermute_from_hf(tensor, n_heads)
        elif native.endswith("attention.wk.weight"):
            tensor = unpermute_from_hf(tensor, n_kv_heads)
        out[native] = tensor
    return out


def _weight_files(folder: Path) -> dict[str, Path]:
    """``{hf weight name: safetensors file}`` from the index, or from the single/unindexed files."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / fname for name, fname in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"no safetensors weights in {folder} (expected {SAFETENSORS_INDEX} or model.safetensors); "
            "PyTorch .bin checkpoints are not supported")
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                out[name] = f
    return out


def read_hf_config(folder: Path) -> dict[str, Any]:
    """The ``config.json`` of an HF model folder."""
    cfg_path = Path(folder) / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{folder} is not a Hugging Face model folder: no config.json")
    try:
        return json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{cfg_path}: cannot read it ({e})") from None


class HFReader:
    """Reads tensors by HF name from a folder's safetensors files, one file handle per file."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.files = _weight_files(folder)
        self._handles = {f: safe_open(str(f), framework="pt") for f in set(self.files.values())}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self.files[name]].get_tensor(name)

    def shape(self, name: str) -> list[int]:
        """The tensor's shape, read from the file's header (no data read)."""
        return list(self._handles[self.files[name]].get_slice(name).get_shape())


def load_hf_state_dict(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(native state dict, config.json) of an HF Llama folder."""
    folder = Path(path)
    cfg = read_hf_config(folder)
    args = hf_config_to_args(cfg, source=f"{folder}/config.json")
    reader = HFReader(folder)
    sd = hf_to_native_state_dict({name: reader.get(name) for name in reader.files}, args.n_heads, args.num_kv_heads)
    return sd, cfg


def architecture_mismatches(hf_args: LlamaModelArgs, args) -> list[str]:
    """The fields in which a model's ``args`` differs from a Hugging Face folder's (``hf_args``), as
    ``"config.json name: folder's value != model's value"``; the RoPE table length is not compared."""
    pairs = (("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
             ("num_key_value_heads", "num_kv_heads"), ("intermediate_size", "ffn_hidden_dim"),
             ("vocab_size", "vocab_size"), ("rope_theta", "rope_theta"), ("rope_scaling", "rope_scaling"),
             ("rms_norm_eps", "norm_eps"), ("tie_word_embeddings", "tie_word_embeddings"))
    return [f"{hf_name} {getattr(hf_args, ours)} != {getattr(args, ours)}" for hf_name, ours in pairs
            if getattr(hf_args, ours) != getattr(args, ours)]


def _check_architecture(hf_args: LlamaModelArgs, args, folder: Path) -> None:
    """Refuse a folder whose architecture differs from the model's ``args`` (None: not known, not checked)."""
    if args is None:
        return
    mismatches = architecture_mismatches(hf_args, args)
    if mismatches:
        raise ConfigError(f"{folder}/config.json does not match the model being trained: " + "; ".join(mismatches)
                          + f" (run `trainer import --hf {folder}` and train with the [model] keys it prints)")


@torch.no_grad()
def load_hf_into(model: torch.nn.Module | Iterable[torch.nn.Module], path: str | Path) -> list[str]:
    """Copy an HF Llama safetensors folder's weights into ``model`` in place.

    ``model`` is our ``Transformer`` (or a list of pipeline-stage model parts), possibly sharded by
    FSDP2/TP (DTensor parameters) and wrapped by activation checkpointing or torch.compile. Each rank
    reads only the tensors its parameters need and keeps its own slice, so no communication happens.
    Every parameter the model holds must be present (``lm_head`` may be missing when the embeddings
    are tied); shapes must match exactly. Returns the native names loaded.
    """
    from torch.distributed.tensor import DTensor

    from trainer.parallel.init import local_slice

    folder = Path(path)
    hf_args = read_hf_args(folder)
    reader = HFReader(folder)
    n_heads, n_kv = hf_args.n_heads, hf_args.num_kv_heads
    tied_hf = hf_args.tie_word_embeddings
    parts = list(model) if isinstance(model, (list, tuple)) else [model]

    for part in parts:
        _check_architecture(hf_args, getattr(part, "args", None), folder)

    loaded = []
    seen: set[int] = set()
    for part in parts:
        for raw_name, param in part.named_parameters(remove_duplicate=False):
            name = clean_fqn(raw_name)
            if id(param) in seen:  # the second name of a tied weight
                continue
            seen.add(id(param))
            hf_name = native_to_hf_key(name)
            if hf_name == "lm_head.weight" and (hf_name not in reader or tied_hf):
                if "model.embed_tokens.weight" not in reader:
                    raise KeyError(f"{folder} has neither lm_head.weight nor model.embed_tokens.weight")
                hf_name = "model.embed_tokens.weight"  # tied embeddings in the HF folder
            if hf_name not in reader:
                raise KeyError(f"{folder} has no weight {hf_name!r} (needed for {name})")
            full = reader.get(hf_name)
            if name.endswith("attention.wq.weight"):
                full = unpermute_from_hf(full, n_heads)
            elif name.endswith("attention.wk.weight"):
                full = unpermute_from_hf(full, n_kv)
            if tuple(full.shape) != tuple(param.shape):
                embedding = "tok_emb" in name or "output" in name
                hint = " (set model.vocab_size to the checkpoint's vocab_size)" if embedding else ""
                raise ValueError(f"{hf_name} in {folder} has shape {tuple(full.shape)}, the model's {name} "
                                 f"is {tuple(param.shape)}{hint}")
            local = param.to_local() if isinstance(param, DTensor) else param.data
            local.copy_(local_slice(full, param).to(device=local.device, dtype=local.dtype))
            loaded.append(name)
    logger.info("loaded %d tensors from Hugging Face folder %s", len(loaded), folder)
    return loaded


# config.json fields this model cannot represent when set to anything but the value given (None: absent
# or null is fine too); a folder setting one is refused rather than imported as a different model.
_MUST_BE = {
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "attention_dropout": 0.0,
    "pretraining_tp": 1, "sliding_window": None,
}


def _rope_from_hf(cfg: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, Llama 3.1 scaling or None) from the legacy keys or transformers 5's ``rope_parameters``."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type") not in (None, "default") else None)
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise ConfigError(f"{source}: rope_scaling type {kind!r} is not supported (only 'llama3' and plain RoPE)")
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{source}: rope_scaling {scaling} is not a valid llama3 scaling ({e})") from None


def hf_config_to_args(cfg: dict[str, Any], source: str = "config.json") -> LlamaModelArgs:
    """The one reader of a Hugging Face Llama ``config.json``: every architectural field becomes our
    ``LlamaModelArgs`` (no flavor involved). A field this model cannot represent raises ``ConfigError``
    naming it, in one line, so that nothing is imported as a different model than the folder holds."""
    if cfg.get("model_type", "llama") != "llama":
        raise ConfigError(f"{source}: model_type {cfg.get('model_type')!r} is not supported (only 'llama')")
    for key, ok in _MUST_BE.items():
        value = cfg.get(key)
        if value is not None and value != ok:
            raise ConfigError(f"{source}: {key}={json.dumps(value)} is not supported by this model "
                              f"(only {json.dumps(ok)})")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if not isinstance(cfg.get(k), int)]
    if missing:
        raise ConfigError(f"{source}: missing or non-integer {', '.join(missing)}")
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if dim % n_heads or cfg.get("head_dim") not in (None, dim // n_heads):
        raise ConfigError(f"{source}: head_dim={cfg.get('head_dim')} with hidden_size={dim} and "
                          f"num_attention_heads={n_heads} is not supported (head_dim must be hidden_size / heads)")
    theta, rope_scaling = _rope_from_hf(cfg, source)
    try:
        return LlamaModelArgs(
            dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads, vocab_size=cfg["vocab_size"],
            ffn_dim=cfg["intermediate_size"], norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=rope_scaling,
            max_seq_len=int(cfg.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def read_hf_args(folder: str | Path) -> LlamaModelArgs:
    """The architecture of a Hugging Face Llama folder, from its config.json (see :func:`hf_config_to_args`)."""
    folder = Path(folder)
    return hf_config_to_args(read_hf_config(folder), source=f"{folder}/config.json")
