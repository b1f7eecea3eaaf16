"""The [model] config section, its rules, and where a run's configuration becomes model arguments.

:func:`resolve_model_args` is the one place a run's configuration becomes model arguments: training, dry
runs, ``trainer plan`` and ``trainer bench`` all call it. :func:`config_model_args` is the part the
launcher's pre-flight checks (no tokenizer, no torch), :func:`get_model_args` the flavor lookup under both
(also used by the offline tools, which size the model from a checkpoint instead of the config). Only the
Llama family exists for now. The string under each field is its documentation (``--help``, docs/config.md).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Literal

from trainer.errors import ConfigError
from trainer.models.llama.args import LlamaModelArgs, MoEArgs, RopeScaling
from trainer.models.llama.flavors import LLAMA_FLAVORS, TORCHTITAN_FLAVORS, get_llama_args


@dataclass
class ModelMoE:
    """Mixture of experts: overrides of the flavor's MoE layers (unset / -1: the flavor's), or MoE layers for a
    dense flavor (num_experts > 0; the unset keys then take torchtitan's MoEArgs defaults)."""

    num_experts: int = -1
    """Routed experts per MoE layer. -1: the flavor's (a dense flavor has none: debug_moe and llama4's flavors
    have them); 0: a dense model; N > 0: N experts in each MoE layer."""
    top_k: int = -1
    """Experts each token is sent to (token-choice routing). -1: the flavor's, else 1."""
    num_shared_experts: int = -1
    """Dense SwiGLU experts every token goes through, beside the routed ones. -1: the flavor's, else 1."""
    hidden_dim: int = -1
    """One expert's SwiGLU hidden size (Hugging Face moe_intermediate_size). -1: the flavor's rule: the dense
    hidden size, divided by top_k + num_shared_experts (auto_scale_hidden_dim), rounded to model.multiple_of."""
    auto_scale_hidden_dim: bool | None = None
    """Divide the derived expert size by top_k + num_shared_experts. Unset: the flavor's, else true."""
    interleave_moe_layer_step: int = -1
    """Block i has an MoE when (i + 1) % step == 0: 1, every block (Llama 4 Scout); 2, every other (Maverick).
    -1: the flavor's, else 1."""
    score_func: Literal["softmax", "sigmoid"] | None = None
    """Router score: softmax over the experts (Mixtral) or a sigmoid per expert (Llama 4, DeepSeek-V3), in
    float32. Unset: the flavor's, else sigmoid."""
    route_norm: bool | None = None
    """Divide each token's top-k scores by their sum. Unset: the flavor's, else false."""
    route_scale: float | None = None
    """Multiply the routing weights by this. Unset: the flavor's, else 1."""
    score_before_experts: bool | None = None
    """Scale each token's input to an expert by its score (true) or the expert's output (false). Unset: the
    flavor's, else true."""
    load_balance_coeff: float | None = None
    """Auxiliary-loss-free balancing (DeepSeek-V3; torchtitan's key): after each optimizer step every expert's
    routing bias moves by this toward an even load over the step's tokens on all ranks. 0: no bias. Unset:
    the flavor's, else 1e-3."""
    aux_loss_coeff: float | None = None
    """Coefficient of the sequence-wise auxiliary balance loss (DeepSeek-V3's), added to the training loss;
    logged as moe_aux_loss. 0: none. Unset: the flavor's, else 0."""
    capacity_factor: float | None = None
    """Copies of tokens an expert takes per micro-batch, as a multiple of an even share; the rest are dropped
    (counted in moe_dropped_tokens). 0: dropless. Unset: the flavor's, else dropless."""
    use_grouped_mm: bool = True
    """Run the experts as one grouped matrix multiply (torch._grouped_mm); false, or a torch without it: a loop
    over the experts, which reads the token counts on the host every layer (said in the log)."""


@dataclass
class Model:
    name: Literal["llama2", "llama3", "llama4"] = "llama3"
    """Model family. All use the same Llama architecture; the family picks the flavor table (llama4: torchtitan's
    mixture-of-experts flavors debugmodel, 17bx16e, 17bx128e)."""
    flavor: str = "debug_gqa"
    """Model size, a key of the flavor table: debug_gqa (this trainer's debug model: 4 kv heads, vocabulary
    from the tokenizer, no RoPE scaling), debug_moe (the same with 8 experts, top-2, in every block),
    debugmodel (torchtitan's, key for key), llama2_7b, llama2_13b,
    llama2_70b, llama3_1b, llama3_3b, llama3_8b, llama3_70b, llama3_405b, or torchtitan's names (8B, 70B,
    405B; llama2: 7B, 13B, 70B); or custom: no base, the shape comes from model.dim, n_layers and n_heads
    (required) and the keys below (what `trainer import` writes)."""
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
    """Embedding rows. -1: the flavor's published vocabulary, or for flavors without one (debug_gqa) the
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
    attn_mask_type: Literal["causal", "block_causal"] = "causal"
    """Which earlier tokens a token attends to (torchtitan's model argument): causal, every earlier token of
    its sequence, across the documents packed into it; block_causal, only the earlier tokens of its own
    document (the loader then emits document positions for every source kind; a document carried over from
    the previous sequence is its own document there). Evaluation, generation and export are unaffected (one
    document per request). Kernels: SDPA with a mask on CPU, compiled FlexAttention on CUDA
    (docs/data.md, "Packing and per-document attention")."""
    rope_per_document: bool = False
    """block_causal only: RoPE positions restart at 0 at every document (and at a sequence that starts inside
    a document), so a packed document gets the logits it gets alone. False (torchtitan's behaviour): positions
    run 0 .. seq_len-1 along the packed sequence."""
    no_rope_layer_interval: int = -1
    """Llama 4's attention (Hugging Face's name and meaning): block i has no positional encoding (NoPE) when
    (i + 1) is a multiple of it (torchtitan's every_n_layers_nope counts from block 0 instead). 0: every
    block rotates; -1: the flavor's (none has NoPE blocks). docs/moe.md, "Llama 4's attention"."""
    attention_chunk_size: int = -1
    """Llama 4's chunked attention (Hugging Face's name; torchtitan's fixed_attn_block_size): the RoPE blocks
    attend only within chunks of this many positions. 0: the whole sequence; -1: the flavor's."""
    use_qk_norm: bool | None = None
    """Llama 4: the RoPE blocks L2-normalise each head of q and k after the rotation (no weight). Unset: the
    flavor's (off)."""
    attn_temperature_tuning: bool | None = None
    """Llama 4: the NoPE blocks scale the query at position p by 1 + attn_scale * log(1 + floor((p + 1) /
    floor_scale)), which is 1 below position floor_scale - 1. Unset: the flavor's (off)."""
    floor_scale: int = -1
    """Llama 4's temperature tuning: its floor_scale. -1: the flavor's (8192)."""
    attn_scale: float | None = None
    """Llama 4's temperature tuning: its attn_scale. Unset: the flavor's (0.1)."""
    moe: ModelMoE = field(default_factory=ModelMoE)
    converters: list[str] = field(default_factory=list)
    """Model transformations applied before parallelization, e.g. ["quantize.linear.float8"]."""
    print_after_conversion: bool = False
    """Log the model structure after converters and parallelization."""


SECTION_DOC = {"model": "Architecture, size and tokenizer.",
               "model.moe": "Mixture of experts: which blocks, how many experts, routing and balancing (docs/moe.md)."}

# Model names accepted by get_model_args; all map to the one Llama implementation.
MODEL_NAMES = ("llama", "llama2", "llama3", "llama4")

# The flavor with no base shape: model.dim, n_layers and n_heads must be given ([model] shape keys).
CUSTOM_FLAVOR = "custom"

# [model] keys that override a flavor's field of the same name (-1 / None: keep the flavor's).
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "multiple_of", "ffn_dim_multiplier",
              "rope_theta", "norm_eps", "tie_word_embeddings", "max_seq_len", "no_rope_layer_interval",
              "attention_chunk_size", "use_qk_norm", "attn_temperature_tuning", "floor_scale", "attn_scale")
# Shape keys whose 0 turns the feature off (their LlamaModelArgs value None).
_OFF_AT_ZERO_SHAPE = ("no_rope_layer_interval", "attention_chunk_size")

# "<flavor>_<N>l": the flavor's shapes with N layers (e.g. llama3_8b_4l), for benchmarks and tests of a big
# model's layers on a small machine.
_FEWER_LAYERS = re.compile(r"^(?P<base>.+)_(?P<layers>\d+)l$")


def _flavor_key(name: str, flavor: str) -> str | None:
    """The key of ``LLAMA_FLAVORS`` that ``flavor`` names for model ``name`` (ours, or torchtitan's such
    as "8B"), or None."""
    flavor = TORCHTITAN_FLAVORS.get(name, {}).get(flavor, flavor)
    if flavor in LLAMA_FLAVORS:
        return flavor
    if name != "llama" and f"{name}_{flavor}" in LLAMA_FLAVORS:
        return f"{name}_{flavor}"
    return None


def get_model_args(name: str, flavor: str) -> LlamaModelArgs:
    """Args (a fresh copy; the flavor table is never changed) for model ``name`` and ``flavor``.

    ``flavor`` is a key of ``LLAMA_FLAVORS`` (e.g. ``"llama3_8b"``, ``"debug_gqa"``); for
    ``name`` ``"llama2"``/``"llama3"`` the prefix may be omitted (``"8b"``). ``"<flavor>_<N>l"`` is the
    flavor with ``N`` layers. Raises ``ValueError`` naming the valid names/flavors otherwise.
    """
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}")
    if flavor == CUSTOM_FLAVOR:
        return LlamaModelArgs(vocab_size=-1)
    key = _flavor_key(name, flavor)
    if key is not None:
        return get_llama_args(key)
    fewer = _FEWER_LAYERS.match(flavor)
    base = _flavor_key(name, fewer["base"]) if fewer else None
    if base is None:
        raise ValueError(
            f"unknown flavor {flavor!r} for model {name!r}; valid flavors: "
            + ", ".join(sorted(LLAMA_FLAVORS)) + f", {CUSTOM_FLAVOR} (or <flavor>_<N>l: the flavor with N layers)"
            + (f"; torchtitan's: {', '.join(TORCHTITAN_FLAVORS[name])}" if name in TORCHTITAN_FLAVORS else "")
        )
    return dataclasses.replace(get_llama_args(base), n_layers=int(fewer["layers"]))


def _is_set(value) -> bool:
    return value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value == -1)


def config_model_args(config) -> LlamaModelArgs:
    """The architecture a run's ``config`` describes: its flavor with the [model] shape keys applied
    (vocabulary and RoPE table length not resolved; see :func:`resolve_model_args`). Raises
    ``ConfigError`` naming the key to fix."""
    m = config.model
    try:
        base = get_model_args(m.name, m.flavor)
    except ValueError as e:
        raise ConfigError(f"model.flavor: {e}") from None
    if m.flavor == CUSTOM_FLAVOR:
        unset = [f"model.{k}" for k in ("dim", "n_layers", "n_heads") if not _is_set(getattr(m, k))]
        if unset:
            raise ConfigError(f"model.flavor = \"{CUSTOM_FLAVOR}\" needs {', '.join(unset)} (or choose a named flavor)")
    overrides = {k: getattr(m, k) for k in SHAPE_KEYS if _is_set(getattr(m, k))}
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "multiple_of", "max_seq_len"):
        if key in overrides and overrides[key] <= 0:
            raise ConfigError(f"model.{key} must be positive (or -1: the flavor's), got {overrides[key]}")
    for key in ("ffn_dim_multiplier", "rope_theta", "norm_eps", "attn_scale"):
        if key in overrides and overrides[key] <= 0:
            raise ConfigError(f"model.{key} must be > 0 (or unset: the flavor's), got {overrides[key]}")
    for key in ("floor_scale", *_OFF_AT_ZERO_SHAPE):
        if key in overrides and overrides[key] < 0:
            raise ConfigError(f"model.{key} must be >= 0 (or -1: the flavor's), got {overrides[key]}")
        if key in _OFF_AT_ZERO_SHAPE and overrides.get(key) == 0:
            overrides[key] = None
    if "n_heads" in overrides and "n_kv_heads" not in overrides:
        overrides["n_kv_heads"] = None  # as documented: n_heads alone means multi-head attention
    if "ffn_dim" not in overrides and ("multiple_of" in overrides or "ffn_dim_multiplier" in overrides):
        overrides["ffn_dim"] = None  # the rule asked for replaces a flavor's explicit size
    overrides["rope_scaling"] = _rope_scaling(m, base.rope_scaling)
    overrides.update(_moe_overrides(m.moe, base))
    overrides.update(attn_mask_type=m.attn_mask_type, rope_per_document=m.rope_per_document)
    try:
        return dataclasses.replace(base, **overrides)
    except ValueError as e:
        raise ConfigError(f"[model] shape: {e} (model.dim, n_heads, n_kv_heads)") from None


# [model.moe] keys that override the MoEArgs field of the same name (unset: the flavor's); 0 turns the bias and
# the capacity off (their MoEArgs value None).
_MOE_FIELDS = ("top_k", "num_shared_experts", "score_func", "route_norm", "route_scale", "score_before_experts",
               "load_balance_coeff", "aux_loss_coeff", "capacity_factor")
_OFF_AT_ZERO = ("load_balance_coeff", "capacity_factor")
# [model.moe] keys that set a LlamaModelArgs field (the MoE layout) -> that field.
_MOE_LAYOUT = {"hidden_dim": "moe_hidden_dim", "interleave_moe_layer_step": "interleave_moe_layer_step",
               "auto_scale_hidden_dim": "auto_scale_hidden_dim"}


def _moe_overrides(mo: ModelMoE, base: LlamaModelArgs) -> dict:
    """The LlamaModelArgs fields [model.moe] sets: ``moe`` (None: dense) and the MoE layout keys."""
    layout_keys = {"hidden_dim": mo.hidden_dim, "interleave_moe_layer_step": mo.interleave_moe_layer_step,
                   "auto_scale_hidden_dim": mo.auto_scale_hidden_dim}
    given = {k: getattr(mo, k) for k in _MOE_FIELDS} | layout_keys
    given = {k: v for k, v in given.items() if _is_set(v)}
    for key, value in given.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"model.moe.{key} must be >= 0, got {value}")
    if mo.num_experts == 0 or (mo.num_experts == -1 and base.moe is None):
        if given:
            why = "model.moe.num_experts = 0" if mo.num_experts == 0 else "the flavor is dense"
            raise ConfigError(f"model.moe.{next(iter(given))} is set but the model has no experts ({why}): set "
                              "model.moe.num_experts, choose an MoE flavor (debug_moe, llama4's), or drop the key")
        return {"moe": None}
    layout = {_MOE_LAYOUT[k]: given.pop(k) for k in _MOE_LAYOUT if k in given}
    for key in _OFF_AT_ZERO:
        if given.get(key) == 0:
            given[key] = None
    start = base.moe if base.moe is not None else MoEArgs()
    if mo.num_experts > 0:
        given["num_experts"] = mo.num_experts
    given["use_grouped_mm"] = mo.use_grouped_mm
    try:
        moe = dataclasses.replace(start, **given)
    except ValueError as e:
        raise ConfigError(f"[model.moe]: {e}") from None
    return {"moe": moe, **layout}


def _rope_scaling(m, base: RopeScaling | None) -> RopeScaling | None:
    """The flavor's Llama 3.1 RoPE scaling with the model.rope_scaling_* keys applied."""
    factor = m.rope_scaling_factor
    keys = {"rope_scaling_low_freq_factor": ("low_freq_factor", m.rope_scaling_low_freq_factor),
            "rope_scaling_high_freq_factor": ("high_freq_factor", m.rope_scaling_high_freq_factor),
            "rope_scaling_original_max_position_embeddings":
                ("original_max_position_embeddings", m.rope_scaling_original_max_position_embeddings)}
    given = {field: value for field, value in keys.values() if _is_set(value)}
    if factor == 0 or (factor is None and base is None):
        if given:
            raise ConfigError(f"model.{next(k for k, (f, _) in keys.items() if f in given)} is set but the "
                              "model has no RoPE scaling: set model.rope_scaling_factor too")
        return None
    if factor is not None and factor < 0:
        raise ConfigError(f"model.rope_scaling_factor must be >= 0 (0: no scaling), got {factor}")
    start = base if base is not None else RopeScaling()
    if factor is not None:
        given["factor"] = factor
    try:
        return dataclasses.replace(start, **given)
    except ValueError as e:
        raise ConfigError(f"model.rope_scaling_*: {e}") from None


def model_config_keys(args: LlamaModelArgs) -> dict:
    """The [model] keys (flavor custom) that describe ``args`` exactly: what ``trainer import`` prints. A
    mixture of experts adds ``"moe"``: its [model.moe] keys, each one given (the custom flavor's unset keys
    would take other defaults), the balancing and the capacity off as 0."""
    keys = {"flavor": CUSTOM_FLAVOR, "vocab_size": args.vocab_size, "dim": args.dim, "n_layers": args.n_layers,
            "n_heads": args.n_heads, "n_kv_heads": args.num_kv_heads, "ffn_dim": args.ffn_hidden_dim,
            "rope_theta": float(args.rope_theta), "norm_eps": float(args.norm_eps),
            "tie_word_embeddings": bool(args.tie_word_embeddings), "max_seq_len": args.max_seq_len}
    if args.no_rope_layer_interval is not None or args.attention_chunk_size is not None or args.use_qk_norm:
        keys.update(no_rope_layer_interval=args.no_rope_layer_interval or 0,
                    attention_chunk_size=args.attention_chunk_size or 0, use_qk_norm=args.use_qk_norm,
                    attn_temperature_tuning=args.attn_temperature_tuning, floor_scale=args.floor_scale,
                    attn_scale=float(args.attn_scale))
    s = args.rope_scaling
    keys["rope_scaling_factor"] = 0.0 if s is None else float(s.factor)
    if s is not None:
        keys.update(rope_scaling_low_freq_factor=float(s.low_freq_factor),
                    rope_scaling_high_freq_factor=float(s.high_freq_factor),
                    rope_scaling_original_max_position_embeddings=int(s.original_max_position_embeddings))
    moe = args.moe
    if moe is not None:
        keys["moe"] = {"num_experts": moe.num_experts, "top_k": moe.top_k,
                       "num_shared_experts": moe.num_shared_experts, "hidden_dim": args.expert_hidden_dim,
                       "interleave_moe_layer_step": args.interleave_moe_layer_step, "score_func": moe.score_func,
                       "route_norm": moe.route_norm, "route_scale": float(moe.route_scale),
                       "score_before_experts": moe.score_before_experts,
                       "load_balance_coeff": float(moe.load_balance_coeff or 0.0),
                       "aux_loss_coeff": float(moe.aux_loss_coeff),
                       "capacity_factor": float(moe.capacity_factor or 0.0)}
    return keys


def resolve_model_args(config, tokenizer_vocab: int | None) -> LlamaModelArgs:
    """The model a run's ``config`` (a JobConfig) trains: its flavor with the [model] shape keys applied
    (:func:`config_model_args`), RoPE table at ``training.seq_len``, embedding sized for the tokenizer.

    Rows: model.vocab_size if set, else the flavor's published vocabulary, else the tokenizer's
    vocabulary rounded up to a multiple of 64 (faster matmuls). ``tokenizer_vocab`` None skips the check
    that the tokenizer fits (dry runs and plans of presets whose tokenizer file is not on this machine).
    Raises ``ConfigError`` naming the key to fix.
    """
    flavor_args = config_model_args(config)
    if config.model.vocab_size > 0:
        vocab, source = config.model.vocab_size, "model.vocab_size"
    elif flavor_args.vocab_size > 0:
        vocab, source = flavor_args.vocab_size, f"flavor {config.model.flavor}"
    elif tokenizer_vocab is not None:
        vocab, source = -(-tokenizer_vocab // 64) * 64, "tokenizer"
    else:
        raise ConfigError(f"model.flavor {config.model.flavor} takes its vocabulary size from the tokenizer; "
                          + _missing_tokenizer(config.model))
    if tokenizer_vocab is not None and vocab < tokenizer_vocab:
        raise ConfigError(f"{source} gives {vocab} embedding rows but the tokenizer has {tokenizer_vocab} ids; "
                          "use a matching tokenizer (model.tokenizer_path) or raise model.vocab_size")
    return dataclasses.replace(flavor_args, vocab_size=vocab, max_seq_len=config.training.seq_len)


def _absent_tokenizer_key(m) -> str | None:
    """The key that names a tokenizer path which does not exist (hf_assets_path when it came from there), or
    None when the path is unset or exists."""
    if m.tokenizer_path and not os.path.exists(os.path.expanduser(m.tokenizer_path)):
        return "model.hf_assets_path" if m.tokenizer_path == m.hf_assets_path else "model.tokenizer_path"
    return None


def _missing_tokenizer(m) -> str:
    """What to fix when the tokenizer could not be read: the key and folder named when it does not exist."""
    key = _absent_tokenizer_key(m)
    if key is not None:
        return (f"{key} {m.tokenizer_path!r} does not exist (from {os.getcwd()}): point it at the folder with "
                "tokenizer.json, or set model.vocab_size")
    return "set model.tokenizer_path or model.vocab_size"


def check_config(config) -> None:
    """The flavor and the [model] shape keys describe a valid architecture; per-document attention's keys
    fit together and with the layout."""
    config_model_args(config)
    m = config.model
    if m.rope_per_document and m.attn_mask_type != "block_causal":
        raise ConfigError("model.rope_per_document restarts RoPE at each document of block_causal attention: set "
                          "model.attn_mask_type = \"block_causal\" too, or drop it")
    check_experts(config, config_model_args(config))
    check_llama4_attention(config, config_model_args(config))


def check_llama4_attention(config, args: LlamaModelArgs) -> None:
    """Llama 4's chunked attention and temperature tuning are computed from whole sequences: refused where a
    rank holds a part of one (tensor or context parallel) and the training sequences reach them."""
    seq = config.training.seq_len
    needs = []
    if args.attention_chunk_size is not None and seq > args.attention_chunk_size:
        needs.append(f"chunked attention (training.seq_len {seq} > model.attention_chunk_size "
                     f"{args.attention_chunk_size})")
    if args.no_rope_layer_interval is not None and args.attn_temperature_tuning and seq >= args.floor_scale:
        needs.append(f"temperature tuning (training.seq_len {seq} >= model.floor_scale {args.floor_scale})")
    split = [k for k in ("tensor_parallel_degree", "context_parallel_degree") if getattr(config.parallelism, k) > 1]
    if needs and split:
        raise ConfigError(f"Llama 4's {' and '.join(needs)} is not implemented with parallelism.{split[0]} > 1: "
                          "train shorter sequences, or without it")


def check_experts(config, args: LlamaModelArgs) -> None:
    """A mixture of experts with what does not run with one yet."""
    if args.moe is None:
        return
    p = config.parallelism
    tp = p.tensor_parallel_degree
    if tp > 1:
        check_expert_tensor_parallel(config, args, tp)
    if args.moe.aux_loss_coeff > 0 and p.context_parallel_degree > 1:
        raise ConfigError("model.moe.aux_loss_coeff is a per-sequence loss and context parallel splits the "
                          "sequences: set parallelism.context_parallel_degree = 1, or balance with "
                          "model.moe.load_balance_coeff instead")
    if config.fault_tolerance.enable:
        raise ConfigError("fault_tolerance.enable with a mixture of experts is not supported yet (the replica groups "
                          "would move their expert biases apart): train without [fault_tolerance]")


def check_expert_tensor_parallel(config, args: LlamaModelArgs, tp: int) -> None:
    """Tensor parallel splits each expert's hidden units (and the shared experts') over the TP ranks."""
    p = config.parallelism
    hidden = args.expert_hidden_dim
    if hidden % tp:
        raise ConfigError(f"parallelism.tensor_parallel_degree ({tp}) must divide the experts' hidden size ({hidden}): "
                          "tensor parallel splits each expert's hidden units over the TP ranks")
    etp = p.expert_tensor_parallel_degree
    if p.expert_parallel_degree > 1 and etp != tp:
        raise ConfigError(f"parallelism.expert_tensor_parallel_degree ({etp}) must equal tensor_parallel_degree ({tp}) "
                          "with expert parallel: each rank's experts are split over the TP ranks (borrowing TP ranks "
                          "for expert parallel is not implemented)")
    if p.expert_parallel_degree > 1 and p.context_parallel_degree > 1:
        raise ConfigError("expert parallel with both context and tensor parallel is not supported yet (FSDP cannot "
                          "lay the experts' shards over those three mesh dimensions): drop one of "
                          "parallelism.expert_parallel_degree, context_parallel_degree, tensor_parallel_degree")
    if "quantize.linear.float8" in config.model.converters:
        raise ConfigError("quantize.linear.float8 with tensor parallel does not convert a mixture of experts' shared "
                          "experts yet: drop the converter, or set parallelism.tensor_parallel_degree = 1")


def check_paths(config) -> None:
    """The tokenizer the run will read exists (stat only)."""
    m = config.model
    key = _absent_tokenizer_key(m)
    if key is not None:
        raise ConfigError(f"{key}: no such file or folder {m.tokenizer_path!r} (a folder with tokenizer.json, "
                          "or a tokenizer file)")
