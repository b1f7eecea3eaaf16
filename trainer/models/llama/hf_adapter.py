"""Hugging Face Llama and Mixtral <-> our Llama state dicts: names, the RoPE permutation, reading an HF
safetensors folder and loading one into a (sharded) model in place.

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

Mixtral (``transformers.MixtralForCausalLM``): every block's feed-forward is a mixture of experts whose
routing is ours with softmax scores, ``route_norm``, the scores applied to the experts' outputs, no shared
experts and no expert bias. Its attention, norms and embeddings are named as Llama's; the MoE maps as::

    layers.{i}.moe.router.gate.weight     model.layers.{i}.block_sparse_moe.gate.weight
    layers.{i}.moe.experts.w1[j]          model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight
    layers.{i}.moe.experts.w2[j]          model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight
    layers.{i}.moe.experts.w3[j]          model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight

This per-expert layout is what ``save_pretrained`` writes (transformers 5 as well) and what the Hub's
Mixtral folders hold. transformers 5 fuses the experts in memory (``mlp.gate.weight``,
``mlp.experts.gate_up_proj`` = ``[w1; w3]`` stacked on the rows, ``mlp.experts.down_proj`` = ``w2``); a
folder saved in that layout is read too.

Llama 4 (``transformers.Llama4ForCausalLM``, model_type ``llama4_text``; or the text model of a
``Llama4ForConditionalGeneration`` folder, model_type ``llama4``, whose weights are under
``language_model.``): Meta's interleaved RoPE (no permutation), NoPE blocks, QK norm, chunked attention and
temperature tuning as model arguments, MoE blocks with sigmoid top-k routing applied to the experts' inputs
and one shared expert, the dense blocks' feed-forward sized ``intermediate_size_mlp``. Read only::

    layers.{i}.feed_forward.w1/w2/w3      model.layers.{i}.feed_forward.gate_proj/down_proj/up_proj.weight
    layers.{i}.moe.router.gate.weight     model.layers.{i}.feed_forward.router.weight
    layers.{i}.moe.experts.w1, w3         model.layers.{i}.feed_forward.experts.gate_up_proj [E, dim, 2H],
                                          transposed: its first H columns w1, the others w3
    layers.{i}.moe.experts.w2             model.layers.{i}.feed_forward.experts.down_proj [E, H, dim], transposed
    layers.{i}.moe.shared_experts.w1/2/3  model.layers.{i}.feed_forward.shared_expert.gate/down/up_proj.weight
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
from trainer.models.llama.args import LlamaModelArgs, MoEArgs, RopeScaling
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
_ATTENTION_KEYS = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
                   "attention_norm.weight", "ffn_norm.weight")
_DENSE_FFN_KEYS = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")
# Mixtral's MoE: the router maps one to one; each expert stack [E, out, in] is E HF weights.
_ROUTER = "moe.router.gate.weight"
_EXPERTS = ("moe.experts.w1", "moe.experts.w2", "moe.experts.w3")
_MIXTRAL_ROUTER = "block_sparse_moe.gate.weight"
_FUSED_ROUTER = "mlp.gate.weight"
_FUSED_EXPERTS = {"moe.experts.w1": ("mlp.experts.gate_up_proj", 0), "moe.experts.w3": ("mlp.experts.gate_up_proj", 1),
                  "moe.experts.w2": ("mlp.experts.down_proj", None)}
_HF_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
_LAYER_MAP_INV = {v: k for k, v in _LAYER_MAP.items()}
_TOP_MAP_INV = {v: k for k, v in _TOP_MAP.items()}
_NATIVE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

SAFETENSORS_INDEX = "model.safetensors.index.json"

# Llama 4: the families config.json's model_type names, and its weights under our names (``{i}``: the block).
LLAMA4_TYPES = ("llama4_text", "llama4")
_LLAMA4_LAYER = {
    "feed_forward.w1.weight": "feed_forward.gate_proj.weight",
    "feed_forward.w2.weight": "feed_forward.down_proj.weight",
    "feed_forward.w3.weight": "feed_forward.up_proj.weight",
    "moe.router.gate.weight": "feed_forward.router.weight",
    "moe.experts.w1": "feed_forward.experts.gate_up_proj",
    "moe.experts.w3": "feed_forward.experts.gate_up_proj",
    "moe.experts.w2": "feed_forward.experts.down_proj",
    "moe.shared_experts.w1.weight": "feed_forward.shared_expert.gate_proj.weight",
    "moe.shared_experts.w2.weight": "feed_forward.shared_expert.down_proj.weight",
    "moe.shared_experts.w3.weight": "feed_forward.shared_expert.up_proj.weight",
}
_SHARED_EXPERTS = ("moe.shared_experts.w1.weight", "moe.shared_experts.w2.weight", "moe.shared_experts.w3.weight")
# A Llama4ForConditionalGeneration folder: the text model's weights carry this prefix (the vision ones are not read).
_LLAMA4_TEXT_PREFIX = "language_model."


def llama4_name(name: str) -> str:
    """The Llama 4 weight that holds our weight ``name`` (KeyError when it has none; ``w1`` and ``w3`` of a
    block share one)."""
    m = _NATIVE_LAYER.match(name)
    if m and m.group(2) in _LLAMA4_LAYER:
        return f"model.layers.{m.group(1)}.{_LLAMA4_LAYER[m.group(2)]}"
    return native_to_hf_key(name)  # embeddings, attention and norms are named as Llama's


def native_to_llama4_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our FQNs -> Llama 4's names, each expert stack transposed and ``w1``/``w3`` fused into ``gate_up_proj``
    (so both of a block must be in ``sd`` together)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        leaf = _NATIVE_LAYER.match(name).group(2) if name.startswith("layers.") else name
        if leaf == "moe.experts.w3":
            continue  # with w1
        target = llama4_name(name)
        if leaf == "moe.experts.w1":
            w3 = sd[name[: -len("w1")] + "w3"]
            tensor = torch.cat([tensor.transpose(1, 2), w3.transpose(1, 2)], dim=-1).contiguous()
        elif leaf == "moe.experts.w2":
            tensor = tensor.transpose(1, 2).contiguous()
        out[target] = tensor
    return dict(sorted(out.items(), key=lambda kv: hf_order(kv[0])))


def llama4_weight_names(args) -> list[str]:
    """The Llama 4 names a model with ``args`` is written as (``lm_head`` only when not tied)."""
    return sorted({llama4_name(n) for n in native_weight_names(args)}, key=hf_order)


def _from_llama4(leaf: str, t: torch.Tensor) -> torch.Tensor:
    """Our weight ``leaf`` from the Llama 4 tensor ``t`` that holds it (the experts are stored transposed)."""
    if leaf in ("moe.experts.w1", "moe.experts.w3"):  # [E, dim, 2H]: gate columns, then up
        return t.chunk(2, dim=-1)[leaf == "moe.experts.w3"].transpose(1, 2).contiguous()
    if leaf == "moe.experts.w2":  # [E, H, dim]
        return t.transpose(1, 2).contiguous()
    return t


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
    """The Hugging Face name of our parameter ``name`` (KeyError when it has none; an expert stack has one
    name per expert: :func:`hf_names`)."""
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _NATIVE_LAYER.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    if m and m.group(2) == _ROUTER:
        return f"model.layers.{m.group(1)}.{_MIXTRAL_ROUTER}"
    if m and m.group(2) in _EXPERTS:
        raise KeyError(f"{name!r} holds every expert: it has one Hugging Face name per expert (hf_names)")
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def hf_to_native_key(name: str) -> str:
    """Our name of the Hugging Face weight ``name`` (KeyError when it has none; one expert's weight is a slice
    of ours, see :func:`hf_to_native_state_dict`)."""
    if name in _TOP_MAP_INV:
        return _TOP_MAP_INV[name]
    m = _HF_LAYER.match(name)
    if m and m.group(2) in _LAYER_MAP_INV:
        return f"layers.{m.group(1)}.{_LAYER_MAP_INV[m.group(2)]}"
    if m and m.group(2) in (_MIXTRAL_ROUTER, _FUSED_ROUTER):
        return f"layers.{m.group(1)}.{_ROUTER}"
    raise KeyError(f"no native name for Hugging Face weight {name!r}")


def hf_names(name: str, num_experts: int = 0) -> list[str]:
    """The Hugging Face names (Mixtral's per-expert layout for an expert stack of ``num_experts``) that our
    weight ``name`` is written as, in order."""
    m = _NATIVE_LAYER.match(name)
    if m and m.group(2) in _EXPERTS:
        leaf = m.group(2).rsplit(".", 1)[1]
        return [f"model.layers.{m.group(1)}.block_sparse_moe.experts.{j}.{leaf}.weight" for j in range(num_experts)]
    return [native_to_hf_key(name)]


def hf_sources(name: str, args, reader) -> list[str]:
    """The Hugging Face weights that make our weight ``name`` of a model with ``args``, in the layout ``reader``
    (anything with ``in``) holds: Mixtral's per-expert weights, else transformers 5's fused experts. When
    neither is complete the per-expert names are returned (the caller names the first one missing). A Llama 4
    folder's reader (``family`` "llama4") has one source per weight."""
    if getattr(reader, "family", None) == "llama4":
        return [llama4_name(name)]
    m = _NATIVE_LAYER.match(name)
    if m and m.group(2) in _EXPERTS:
        per_expert = hf_names(name, args.moe.num_experts)
        fused = f"model.layers.{m.group(1)}.{_FUSED_EXPERTS[m.group(2)][0]}"
        if not all(n in reader for n in per_expert) and fused in reader:
            return [fused]
        return per_expert
    if m and m.group(2) == _ROUTER:
        fused = f"model.layers.{m.group(1)}.{_FUSED_ROUTER}"
        legacy = native_to_hf_key(name)
        return [fused] if legacy not in reader and fused in reader else [legacy]
    return [native_to_hf_key(name)]


def _from_sources(name: str, tensors: list[torch.Tensor], sources: list[str], n_heads: int,
                  n_kv_heads: int, llama4: bool = False) -> torch.Tensor:
    """Our weight ``name`` from the HF ``tensors`` read under the names ``sources`` (:func:`hf_sources`) of a
    Llama or Mixtral folder, or a Llama 4 one (``llama4``)."""
    leaf = _NATIVE_LAYER.match(name).group(2) if name.startswith("layers.") else name
    if llama4:  # one tensor per weight; Meta's interleaved RoPE, so no permutation
        return _from_llama4(leaf, tensors[0])
    if leaf in _EXPERTS:
        fused, half = _FUSED_EXPERTS[leaf]
        if sources[0].endswith(fused):  # [E, 2H, dim]: w1's rows, then w3's
            t = tensors[0]
            return t if half is None else t.chunk(2, dim=1)[half]
        return torch.stack(tensors)
    (t,) = tensors
    if leaf == "attention.wq.weight":
        return unpermute_from_hf(t, n_heads)
    if leaf == "attention.wk.weight":
        return unpermute_from_hf(t, n_kv_heads)
    return t


def read_native(reader, name: str, args) -> torch.Tensor:
    """Our weight ``name`` of a model with ``args`` (the folder's), read from ``reader`` (an :class:`HFReader`)
    in our layout: RoPE permutation undone, experts stacked. KeyError names the first HF weight missing."""
    sources = hf_sources(name, args, reader)
    missing = [s for s in sources if s not in reader]
    if missing:
        raise KeyError(f"{missing[0]!r} (needed for {name})")
    return _from_sources(name, [reader.get(s) for s in sources], sources, args.n_heads, args.num_kv_heads,
                         llama4=getattr(reader, "family", None) == "llama4")


def native_shape(reader, name: str, args) -> tuple[int, ...]:
    """The shape ``read_native`` gives ``name``, from the files' headers (no data read); ValueError when the
    experts of a stack differ in shape."""
    sources = hf_sources(name, args, reader)
    shapes = [tuple(reader.shape(s)) for s in sources]
    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if getattr(reader, "family", None) == "llama4" and leaf in _EXPERTS:
        e, rows, cols = shapes[0]  # gate_up [E, dim, 2H]; down [E, H, dim]
        return (e, cols // 2, rows) if leaf != "moe.experts.w2" else (e, cols, rows)
    if leaf not in _EXPERTS:
        return shapes[0]
    if len(set(shapes)) > 1:
        raise ValueError(f"the experts of {name} differ in shape: {sorted(set(shapes))}")
    if sources[0].endswith(_FUSED_EXPERTS[leaf][0]):
        e, rows, cols = shapes[0]
        return (e, rows // 2, cols) if _FUSED_EXPERTS[leaf][1] is not None else shapes[0]
    return (len(shapes), *shapes[0])


def hf_order(name: str) -> tuple:
    """Sort key of HF weight names: embeddings, layers in order, final norm, lm_head (the order HF writes shards in)."""
    m = _HF_LAYER.match(name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if "embed_tokens" in name else 2 if name == "model.norm.weight" else 3, 0, name)


def native_weight_names(args) -> list[str]:
    """The native names of every weight a Llama model with ``args`` holds (``output.weight`` only when the
    embeddings are not tied), each of which has Hugging Face names; an MoE block's are Mixtral's (router and
    expert stacks: the caller refuses MoE layers Mixtral cannot hold first). No buffers (the expert bias)."""
    keys = ["tok_embeddings.weight", "norm.weight"]
    if not args.tie_word_embeddings:
        keys.append("output.weight")
    shared = _SHARED_EXPERTS if args.moe is not None and args.moe.num_shared_experts else ()
    for i in range(args.n_layers):
        ffn = (_ROUTER, *_EXPERTS, *shared) if args.is_moe_layer(i) else _DENSE_FFN_KEYS
        keys += [f"layers.{i}.{k}" for k in (*_ATTENTION_KEYS, *ffn)]
    return keys


def native_to_hf_state_dict(sd: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int,
                            tie_word_embeddings: bool = False) -> dict[str, torch.Tensor]:
    """Our FQNs -> HF Llama (Mixtral) names, with the RoPE permutation of ``wq``/``wk`` and each expert stack
    split into its experts."""
    out = {}
    for name, tensor in sd.items():
        if tie_word_embeddings and name == "output.weight":
            continue
        m = _NATIVE_LAYER.match(name)
        if m and m.group(2) in _EXPERTS:
            out.update(zip(hf_names(name, tensor.shape[0]), tensor.unbind(0)))
            continue
        hf_name = native_to_hf_key(name)
        if name.endswith("attention.wq.weight"):
            tensor = permute_for_hf(tensor, n_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = permute_for_hf(tensor, n_kv_heads)
        out[hf_name] = tensor
    return dict(sorted(out.items(), key=lambda kv: hf_order(kv[0])))


def hf_to_native_state_dict(sd: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    """HF Llama (Mixtral) names -> our FQNs, undoing the RoPE permutation and stacking the experts (Mixtral's
    per-expert weights, or transformers 5's fused ones). ``rotary_emb.inv_freq`` is dropped."""
    out = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        m = _HF_LAYER.match(name)
        expert = _HF_EXPERT.match(m.group(2)) if m else None
        if expert:
            experts.setdefault(f"layers.{m.group(1)}.moe.experts.{expert.group(2)}", {})[int(expert.group(1))] = tensor
            continue
        fused = [(leaf, half) for leaf, (f, half) in _FUSED_EXPERTS.items() if m and m.group(2) == f]
        if fused:  # gate_up_proj holds w1 and w3
            for leaf, half in fused:
                out[f"layers.{m.group(1)}.{leaf}"] = tensor if half is None else tensor.chunk(2, dim=1)[half]
            continue
        native = hf_to_native_key(name)
        if native.endswith("attention.wq.weight"):
            tensor = unpermute_from_hf(tensor, n_heads)
        elif native.endswith("attention.wk.weight"):
            tensor = unpermute_from_hf(tensor, n_kv_heads)
        out[native] = tensor
    for native, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise KeyError(f"the experts of {native} are numbered {sorted(by_index)}, not 0..{len(by_index) - 1}")
        out[native] = torch.stack([by_index[j] for j in range(len(by_index))])
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
    """Reads tensors by HF name from a folder's safetensors files, one file handle per file. ``family``:
    "llama4" for a Llama 4 folder (names as :func:`hf_sources` gives them), else None. A multimodal Llama 4
    folder's text weights are read under their names without the ``language_model.`` prefix."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        files = _weight_files(folder)
        model_type = read_hf_config(folder).get("model_type")
        self.family = "llama4" if model_type in LLAMA4_TYPES else None
        self._stored = {}  # our reading name -> the name in the file
        if model_type == "llama4":
            self._stored = {n[len(_LLAMA4_TEXT_PREFIX):]: n for n in files if n.startswith(_LLAMA4_TEXT_PREFIX)}
            files = {short: files[full] for short, full in self._stored.items()}
        self.files = files
        self._handles = {f: safe_open(str(f), framework="pt") for f in set(self.files.values())}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self.files[name]].get_tensor(self._stored.get(name, name))

    def shape(self, name: str) -> list[int]:
        """The tensor's shape, read from the file's header (no data read)."""
        return list(self._handles[self.files[name]].get_slice(self._stored.get(name, name)).get_shape())


def load_hf_state_dict(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(native state dict, config.json) of an HF Llama or Mixtral folder."""
    folder = Path(path)
    cfg = read_hf_config(folder)
    args = hf_config_to_args(cfg, source=f"{folder}/config.json")
    reader = HFReader(folder)
    if reader.family == "llama4":
        return {name: read_native(reader, name, args) for name in native_weight_names(args)}, cfg
    sd = hf_to_native_state_dict({name: reader.get(name) for name in reader.files}, args.n_heads, args.num_kv_heads)
    return sd, cfg


def architecture_mismatches(hf_args: LlamaModelArgs, args) -> list[str]:
    """The fields in which a model's ``args`` differs from a Hugging Face folder's (``hf_args``), as
    ``"config.json name: folder's value != model's value"`` (our key where config.json has none); the RoPE
    table length is not compared, nor the MoE's training choices (balancing, capacity, kernel)."""
    moe = hf_args.moe is not None or args.moe is not None
    pairs = (("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
             ("num_key_value_heads", "num_kv_heads"),
             ("intermediate_size", "expert_hidden_dim" if moe else "ffn_hidden_dim"),
             ("vocab_size", "vocab_size"), ("rope_theta", "rope_theta"), ("rope_scaling", "rope_scaling"),
             ("rms_norm_eps", "norm_eps"), ("tie_word_embeddings", "tie_word_embeddings"))
    if moe and (hf_args.n_moe_layers < hf_args.n_layers or args.n_moe_layers < args.n_layers):
        pairs += (("intermediate_size_mlp", "ffn_hidden_dim"),)  # Llama 4's dense blocks
    pairs += tuple((key, key) for key in ("no_rope_layer_interval", "attention_chunk_size", "use_qk_norm",
                                          "attn_temperature_tuning", "floor_scale", "attn_scale"))
    out = [f"{hf_name} {getattr(hf_args, ours)} != {getattr(args, ours)}" for hf_name, ours in pairs
           if getattr(hf_args, ours) != getattr(args, ours)]
    if moe:
        routing = [("num_local_experts", "num_experts"), ("num_experts_per_tok", "top_k"),
                   ("moe.num_shared_experts", "num_shared_experts"), ("moe.score_func", "score_func"),
                   ("moe.route_norm", "route_norm"), ("moe.route_scale", "route_scale"),
                   ("moe.score_before_experts", "score_before_experts")]
        out += [f"{hf_name} {getattr(hf_args.moe, ours, None)} != {getattr(args.moe, ours, None)}"
                for hf_name, ours in routing if getattr(hf_args.moe, ours, None) != getattr(args.moe, ours, None)]
        if args.moe is not None and hf_args.moe is not None and args.n_moe_layers != hf_args.n_moe_layers:
            out.append(f"moe.interleave_moe_layer_step {hf_args.interleave_moe_layer_step} != "
                       f"{args.interleave_moe_layer_step}")
    return out


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
    parts = list(model) if isinstance(model, (list, tuple)) else [model]
    seq_len = getattr(getattr(parts[0], "args", None), "max_seq_len", None)  # the run's training.seq_len
    hf_args = read_hf_args(folder, seq_len=seq_len)
    reader = HFReader(folder)
    tied_hf = hf_args.tie_word_embeddings

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
            hf_name = "lm_head.weight" if name == "output.weight" else None
            if hf_name and (hf_name not in reader or tied_hf):
                if "model.embed_tokens.weight" not in reader:
                    raise KeyError(f"{folder} has neither lm_head.weight nor model.embed_tokens.weight")
                hf_name = "model.embed_tokens.weight"  # tied embeddings in the HF folder
                full = reader.get(hf_name)
            else:
                try:
                    full = read_native(reader, name, hf_args)
                except KeyError as e:
                    raise KeyError(f"{folder} has no weight {e.args[0]}") from None
            hf_name = hf_sources(name, hf_args, reader)[0] if hf_name is None else hf_name
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
    "pretraining_tp": 1,
}
# Each model type's RoPE base when config.json gives none (transformers' defaults).
_DEFAULT_THETA = {"llama": 10000.0, "mixtral": 1000000.0, "llama4_text": 500000.0}


def _rope_from_hf(cfg: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, Llama 3.1 scaling or None) from the legacy keys or transformers 5's ``rope_parameters``."""
    params = cfg.get("rope_parameters") or {}
    default = _DEFAULT_THETA[cfg.get("model_type", "llama")]
    theta = cfg.get("rope_theta", params.get("rope_theta", default))
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


def _mixtral_moe(cfg: dict[str, Any], source: str) -> MoEArgs:
    """Mixtral's MoE as ours: softmax over all experts, top-k renormalised, the weights applied to the experts'
    outputs, no shared experts. No balancing: Mixtral's router_aux_loss_coef is a loss over a whole batch,
    ours per sequence, so the [model.moe] balancing keys are the user's to set."""
    missing = [k for k in ("num_local_experts", "num_experts_per_tok") if not isinstance(cfg.get(k), int)]
    if missing:
        raise ConfigError(f"{source}: missing or non-integer {', '.join(missing)}")
    if cfg.get("router_jitter_noise"):
        logger.warning("%s: router_jitter_noise=%s is not applied (this model routes without noise; it only "
                       "changes Mixtral's training, not its outputs)", source, cfg["router_jitter_noise"])
    try:
        return MoEArgs(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"], num_shared_experts=0,
                       score_func="softmax", route_norm=True, score_before_experts=False, load_balance_coeff=None,
                       aux_loss_coeff=0.0)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def _every_nth(flags: list, n: int | None) -> bool:
    """Whether ``flags`` (one per block) are true exactly at the blocks ``i`` with ``(i + 1) % n == 0``."""
    return n is not None and n >= 1 and [bool(f) for f in flags] == [(i + 1) % n == 0 for i in range(len(flags))]


def _llama4_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Llama 4's text model as our arguments beside the shape: its MoE (sigmoid scores of the top-k router
    logits applied to the experts' inputs, one shared expert the experts' size, no balancing: the
    [model.moe] keys are the user's to set), which blocks have one, the NoPE blocks, chunked attention, QK
    norm and temperature tuning. Lists of blocks that follow no interval are refused."""
    needed = ("intermediate_size_mlp", "num_local_experts", "num_experts_per_tok", "num_hidden_layers")
    missing = [k for k in needed if not isinstance(cfg.get(k), int)]
    if missing:
        raise ConfigError(f"{source}: missing or non-integer {', '.join(missing)}")
    layers = cfg["num_hidden_layers"]
    step = cfg.get("interleave_moe_layer_step", 1)
    moe_layers = cfg.get("moe_layers")
    if moe_layers is not None and not _every_nth([i in moe_layers for i in range(layers)], step):
        raise ConfigError(f"{source}: moe_layers={moe_layers} is not every interleave_moe_layer_step-th block "
                          f"({step}), which is the only layout this model has")
    interval = cfg.get("no_rope_layer_interval", 4)
    no_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    nope_blocks = [not flag for flag in no_rope]
    nope = None if not any(nope_blocks) else interval if _every_nth(nope_blocks, interval) else None
    if any(nope_blocks) and nope is None:
        raise ConfigError(f"{source}: no_rope_layers={no_rope} is not every no_rope_layer_interval-th block "
                          f"({interval}) without RoPE, which is the only layout this model has")
    chunk = cfg.get("attention_chunk_size")
    layer_types = cfg.get("layer_types")
    expected_types = ["chunked_attention" if rope and chunk is not None else "full_attention" for rope in no_rope]
    if layer_types is not None and list(layer_types) != expected_types:
        raise ConfigError(f"{source}: layer_types={layer_types} is not chunked attention in exactly the RoPE blocks "
                          "(this model's layout)")
    try:
        moe = MoEArgs(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"], num_shared_experts=1,
                      score_func="sigmoid", route_norm=False, score_before_experts=True, load_balance_coeff=None,
                      aux_loss_coeff=0.0)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    return dict(moe=moe, interleave_moe_layer_step=step, moe_hidden_dim=cfg["intermediate_size"],
                no_rope_layer_interval=nope, attention_chunk_size=chunk, use_qk_norm=bool(cfg.get("use_qk_norm", True)),
                attn_temperature_tuning=bool(cfg.get("attn_temperature_tuning", True)),
                floor_scale=int(cfg.get("floor_scale", 8192)), attn_scale=float(cfg.get("attn_scale", 0.1)))


def hf_config_to_args(cfg: dict[str, Any], source: str = "config.json", seq_len: int | None = None) -> LlamaModelArgs:
    """The one reader of a Hugging Face Llama or Mixtral ``config.json``: every architectural field becomes our
    ``LlamaModelArgs`` (no flavor involved). A field this model cannot represent raises ``ConfigError``
    naming it, in one line, so that nothing is imported as a different model than the folder holds.
    ``seq_len``: the longest sequence the model will see (default: max_position_embeddings), which a
    ``sliding_window`` must not be shorter than (this model attends over the whole sequence)."""
    if cfg.get("model_type") == "llama4":  # the multimodal folder: its text model
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model_type 'llama4' without a text_config")
        cfg, source = {"model_type": "llama4_text", **text}, f"{source} (text_config)"
    model_type = cfg.get("model_type", "llama")
    if model_type not in _DEFAULT_THETA:
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported (only 'llama', 'mixtral' and "
                          "Llama 4's 'llama4' / 'llama4_text')")
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
    window, longest = cfg.get("sliding_window"), seq_len or cfg.get("max_position_embeddings")
    if window is not None and (not isinstance(window, int) or longest is None or window < longest):
        what, fix = ((f"training.seq_len {seq_len}", "set training.seq_len to at most the window") if seq_len else
                     (f"max_position_embeddings {longest}", "load the folder with checkpoint.initial_load_in_hf and "
                      "training.seq_len at most the window"))
        raise ConfigError(f"{source}: sliding_window={json.dumps(window)} is shorter than {what}, and this model "
                          f"attends over the whole sequence (no sliding window): {fix}")
    theta, rope_scaling = _rope_from_hf(cfg, source)
    moe, ffn = {}, cfg["intermediate_size"]
    if model_type == "mixtral":
        moe = dict(moe=_mixtral_moe(cfg, source), interleave_moe_layer_step=1, moe_hidden_dim=cfg["intermediate_size"])
    elif model_type == "llama4_text":
        moe = _llama4_fields(cfg, source)
        ffn = cfg["intermediate_size_mlp"]
    try:
        return LlamaModelArgs(
            dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads, vocab_size=cfg["vocab_size"],
            ffn_dim=ffn, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=rope_scaling,
            max_seq_len=int(cfg.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), **moe,
        )
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def read_hf_args(folder: str | Path, seq_len: int | None = None) -> LlamaModelArgs:
    """The architecture of a Hugging Face Llama or Mixtral folder, from its config.json (see
    :func:`hf_config_to_args`)."""
    folder = Path(folder)
    return hf_config_to_args(read_hf_config(folder), source=f"{folder}/config.json", seq_len=seq_len)
