"""Configuration of the Llama family of decoder-only transformers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style RoPE frequency scaling ("rope_type": "llama3" in HF configs).

    Frequencies whose wavelength is shorter than
    ``original_max_position_embeddings / high_freq_factor`` are kept, those whose
    wavelength is longer than ``original_max_position_embeddings / low_freq_factor``
    are divided by ``factor``, and the band in between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        # Equal factors (Llama 4's): no band in between, every frequency is kept or divided.
        if not self.high_freq_factor >= self.low_freq_factor > 0:
            raise ValueError(
                "rope scaling needs high_freq_factor >= low_freq_factor > 0, got "
                f"high_freq_factor={self.high_freq_factor}, low_freq_factor={self.low_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError("original_max_position_embeddings must be positive")


SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEArgs:
    """One MoE layer's shape and routing (torchtitan's ``MoEArgs`` names and defaults, plus the auxiliary loss
    and the capacity)."""

    num_experts: int = 8
    # Dense SwiGLU experts every token goes through, as one FeedForward of num_shared_experts x the expert size.
    num_shared_experts: int = 1
    top_k: int = 1
    score_func: str = "sigmoid"
    # Divide the top-k scores by their sum (Mixtral's renormalised softmax, DeepSeek-V3's sigmoid).
    route_norm: bool = False
    route_scale: float = 1.0
    # True: inputs are scaled by their score before the expert (torchtitan's llama4); False: outputs after.
    score_before_experts: bool = True
    # Auxiliary-loss-free balancing: the expert bias's step per optimizer step; None: no bias.
    load_balance_coeff: float | None = 1e-3
    # Sequence-wise auxiliary balance loss's coefficient; 0: none.
    aux_loss_coeff: float = 0.0
    # Copies an expert takes per micro-batch, as a multiple of an even share; None: dropless.
    capacity_factor: float | None = None
    # Grouped matrix multiply for the experts (False: a loop over them, which reads counts on the host).
    use_grouped_mm: bool = True

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        if self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {', '.join(SCORE_FUNCS)}, got {self.score_func!r}")
        if self.route_scale <= 0:
            raise ValueError(f"route_scale must be > 0, got {self.route_scale}")
        if self.load_balance_coeff is not None and self.load_balance_coeff <= 0:
            raise ValueError(f"load_balance_coeff must be > 0 (or None: no expert bias), got {self.load_balance_coeff}")
        if self.aux_loss_coeff < 0:
            raise ValueError(f"aux_loss_coeff must be >= 0, got {self.aux_loss_coeff}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 (or None: dropless), got {self.capacity_factor}")


@dataclass
class LlamaModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    # None = n_heads (multi-head attention); fewer = grouped-query attention.
    n_kv_heads: int | None = None
    # -1: taken from the tokenizer at build time (see ``build_llama``).
    vocab_size: int = -1
    # SwiGLU hidden size is rounded up to a multiple of this.
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    # SwiGLU hidden size given outright (e.g. a Hugging Face intermediate_size); wins over the rule above.
    ffn_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Length of the precomputed RoPE table; a trainer may lower it to its seq_len.
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False
    # "causal": every earlier token of the sequence; "block_causal": only those of the token's own document
    # (document positions passed to ``Transformer.forward``). torchtitan's argument name and values.
    attn_mask_type: str = "causal"
    # block_causal only: RoPE positions restart at every document (torchtitan: they do not).
    rope_per_document: bool = False
    # Mixture of experts (trainer/models/moe.py): None, a dense model. torchtitan's llama4 names follow.
    moe: MoEArgs | None = None
    # Block i's feed-forward is an MoE when (i + 1) % interleave_moe_layer_step == 0 (1: every block).
    interleave_moe_layer_step: int = 1
    # The expert size from the dense rule divided by top_k + num_shared_experts (same active FLOPs).
    auto_scale_hidden_dim: bool = True
    # The expert hidden size given outright (a Hugging Face moe_intermediate_size); wins over the rule.
    moe_hidden_dim: int | None = None
    # Llama 4's attention (its "iRoPE"), under Hugging Face's (and Meta's) names and meanings. Block i has no
    # positional encoding (NoPE) when (i + 1) % no_rope_layer_interval == 0; None: every block rotates.
    # (torchtitan's every_n_layers_nope counts from block 0 instead: its NoPE blocks are 0, n, 2n, ...)
    no_rope_layer_interval: int | None = None
    # The RoPE blocks attend within chunks of this many positions only (Llama 4's attention_chunk_size); None:
    # the whole sequence.
    attention_chunk_size: int | None = None
    # The RoPE blocks L2-normalise each head of q and k after the rotation (no weight; Llama 4's use_qk_norm).
    use_qk_norm: bool = False
    # The NoPE blocks scale the query at position p by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))
    # (Llama 4's attn_temperature_tuning): 1 below floor_scale - 1.
    attn_temperature_tuning: bool = False
    floor_scale: int = 8192
    attn_scale: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # e.g. coming from a TOML/JSON config
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if isinstance(self.moe, dict):
            self.moe = MoEArgs(**self.moe)
        if self.interleave_moe_layer_step < 1:
            raise ValueError(f"interleave_moe_layer_step must be >= 1, got {self.interleave_moe_layer_step}")
        if self.moe_hidden_dim is not None and self.moe_hidden_dim <= 0:
            raise ValueError(f"moe_hidden_dim must be positive, got {self.moe_hidden_dim}")
        if self.dim <= 0 or self.n_layers < 0 or self.n_heads <= 0:
            raise ValueError(
                f"invalid model shape: dim={self.dim}, n_layers={self.n_layers}, n_heads={self.n_heads}"
            )
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        kv = self.num_kv_heads
        if kv <= 0 or self.n_heads % kv != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({kv})")
        if self.multiple_of <= 0:
            raise ValueError(f"multiple_of must be positive, got {self.multiple_of}")
        if self.ffn_dim is not None and self.ffn_dim <= 0:
            raise ValueError(f"ffn_dim must be positive, got {self.ffn_dim}")
        if self.max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {self.max_seq_len}")
        if self.attn_mask_type not in ("causal", "block_causal"):
            raise ValueError(f"attn_mask_type must be causal or block_causal, got {self.attn_mask_type!r}")
        if self.no_rope_layer_interval is not None and self.no_rope_layer_interval < 1:
            raise ValueError(f"no_rope_layer_interval must be >= 1 (or None), got {self.no_rope_layer_interval}")
        if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be >= 1 (or None), got {self.attention_chunk_size}")
        if self.floor_scale < 1:
            raise ValueError(f"floor_scale must be >= 1, got {self.floor_scale}")
        if self.vocab_size == 0 or self.vocab_size < -1:
            raise ValueError(f"vocab_size must be positive or -1 (from tokenizer), got {self.vocab_size}")

    @property
    def num_kv_heads(self) -> int:
        """Number of key/value heads with the ``None`` default resolved."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: ``ffn_dim`` when set, else Meta's reference rule:

        ``hidden = int(2 * (4 * dim) / 3)``, then ``int(ffn_dim_multiplier * hidden)`` if a
        multiplier is set, then rounded up to a multiple of ``multiple_of``.
        """
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def uses_rope(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` rotates q and k (the others are Llama 4's NoPE blocks)."""
        return self.no_rope_layer_interval is None or (layer_id + 1) % self.no_rope_layer_interval != 0

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id``'s feed-forward is a mixture of experts."""
        return self.moe is not None and (layer_id + 1) % self.interleave_moe_layer_step == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def expert_hidden_dim(self) -> int:
        """One expert's SwiGLU hidden size: ``moe_hidden_dim`` when set, else torchtitan's llama4 rule: the dense
        rule's ``int(2 * (4 * dim) / 3)`` (times ``ffn_dim_multiplier``), divided by ``top_k +
        num_shared_experts`` with ``auto_scale_hidden_dim``, rounded up to a multiple of ``multiple_of``."""
        if self.moe_hidden_dim is not None:
            return self.moe_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        if self.auto_scale_hidden_dim and self.moe is not None:
            hidden = int(hidden / (self.moe.top_k + self.moe.num_shared_experts))
        return hidden + (-hidden % self.multiple_of)
