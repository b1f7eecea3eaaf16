"""Named Llama configurations.

Published shapes follow Meta's ``params.json`` / the Hugging Face ``config.json`` files:

* Llama 2 (7B/13B/70B): vocab 32000, rope_theta 1e4, 4096 context; 70B uses 8 kv heads,
  ``ffn_dim_multiplier=1.3``, ``multiple_of=4096`` (hidden 28672).
* Llama 3.1 (8B/70B/405B): vocab 128256, rope_theta 5e5, 8 kv heads, Llama 3.1 RoPE
  scaling (factor 8, low 1, high 4, original context 8192), 131072 context.
* Llama 3.2 (1B/3B): as Llama 3.1 but RoPE scaling factor 32 and tied embeddings.

``max_seq_len`` is the published context length; it only sets the length of the
precomputed RoPE table, so a trainer normally lowers it to its training sequence length
(``dataclasses.replace(args, max_seq_len=seq_len)`` or ``build_llama(..., max_seq_len=)``).
"""

from __future__ import annotations

import dataclasses

from .args import LlamaModelArgs, MoEArgs, RopeScaling

_LLAMA31_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA32_SCALING = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)

_LLAMA4_SCALING = RopeScaling(
    factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0, original_max_position_embeddings=8192
)

LLAMA_FLAVORS: dict[str, LlamaModelArgs] = {
    # This trainer's tiny model for CPU runs and tests (train_configs/debug_model.toml). head_dim 16;
    # 16 query / 4 kv heads, so grouped-query attention is exercised and tensor parallel degrees 2 and 4
    # divide both; every Linear dim (256, 64, 768, vocab from a ~2048-token tokenizer) is a multiple of 16
    # even after TP-4 sharding, as float8 needs. No RoPE scaling.
    "debug_gqa": LlamaModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=4,
        vocab_size=-1,
        multiple_of=256,  # ffn hidden 768
        rope_theta=500000.0,
        max_seq_len=2048,
    ),
    # torchtitan's llama3 "debugmodel", field for field: multi-head attention (16 kv heads), a
    # 2048-token vocabulary and the Llama 3.1 RoPE scaling every torchtitan llama3 flavor applies.
    "debugmodel": LlamaModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=None,
        vocab_size=2048,
        multiple_of=256,  # ffn hidden 768
        norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=131072,
    ),
    # debug_gqa with a mixture of experts in every block: 8 experts, top-2 by sigmoid score, one shared expert,
    # auxiliary-loss-free balancing (torchtitan's defaults otherwise); expert hidden 256.
    "debug_moe": LlamaModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=4,
        vocab_size=-1,
        multiple_of=256,
        rope_theta=500000.0,
        max_seq_len=2048,
        moe=MoEArgs(num_experts=8, top_k=2, num_shared_experts=1),
    ),
    # torchtitan's llama4 flavors, field for field (its v0.2.2 table): Llama 4's RoPE scaling (factor 16, no band),
    # a 202048-token vocabulary, experts sized by auto_scale_hidden_dim; 17bx16e is Llama 4 Scout's shape (an MoE
    # in every block), 17bx128e Maverick's (every other block, no RoPE scaling).
    "llama4_debugmodel": LlamaModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        vocab_size=2048,
        multiple_of=256,  # dense ffn 768, expert 512
        rope_theta=500000.0,
        rope_scaling=_LLAMA4_SCALING,
        max_seq_len=1048576,
        moe=MoEArgs(),
        interleave_moe_layer_step=2,
    ),
    "llama4_17bx16e": LlamaModelArgs(
        dim=5120,
        n_layers=48,
        n_heads=40,
        n_kv_heads=8,
        vocab_size=202048,
        multiple_of=2048,
        ffn_dim_multiplier=1.2,  # expert 8192
        rope_theta=500000.0,
        rope_scaling=_LLAMA4_SCALING,
        max_seq_len=10485760,
        moe=MoEArgs(num_experts=16),
        interleave_moe_layer_step=1,
    ),
    "llama4_17bx128e": LlamaModelArgs(
        dim=5120,
        n_layers=48,
        n_heads=40,
        n_kv_heads=8,
        vocab_size=202048,
        multiple_of=2048,
        ffn_dim_multiplier=1.2,  # dense ffn 16384, expert 8192
        rope_theta=500000.0,
        max_seq_len=1048576,
        moe=MoEArgs(num_experts=128),
        interleave_moe_layer_step=2,
    ),
    "llama2_7b": LlamaModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        vocab_size=32000,
        multiple_of=256,  # ffn hidden 11008
        rope_theta=10000.0,
        max_seq_len=4096,
    ),
    "llama2_13b": LlamaModelArgs(
        dim=5120,
        n_layers=40,
        n_heads=40,
        vocab_size=32000,
        multiple_of=256,  # ffn hidden 13824
        rope_theta=10000.0,
        max_seq_len=4096,
    ),
    "llama2_70b": LlamaModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=32000,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,  # ffn hidden 28672
        rope_theta=10000.0,
        max_seq_len=4096,
    ),
    # Llama 3.2 1B
    "llama3_1b": LlamaModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,  # ffn hidden 8192
        rope_theta=500000.0,
        rope_scaling=_LLAMA32_SCALING,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    # Llama 3.2 3B
    "llama3_3b": LlamaModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.0,  # ffn hidden 8192
        rope_theta=500000.0,
        rope_scaling=_LLAMA32_SCALING,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    # Llama 3.1 8B
    "llama3_8b": LlamaModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,  # ffn hidden 14336
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=131072,
    ),
    # Llama 3.1 70B
    "llama3_70b": LlamaModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,  # ffn hidden 28672
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=131072,
    ),
    # Llama 3.1 405B
    "llama3_405b": LlamaModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,  # ffn hidden 53248
        rope_theta=500000.0,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=131072,
    ),
}

# torchtitan's flavor names, per model name (its llama3 table, and the llama2 table of its earlier
# releases) -> the names above; "70B" means a different model under llama2 and llama3. A flavor under a
# torchtitan name is torchtitan's model key for key ("debugmodel" included; tests/unit/test_model.py holds
# them to torchtitan v0.2.2's table); this trainer's own debug model is "debug_gqa".
TORCHTITAN_FLAVORS: dict[str, dict[str, str]] = {
    "llama3": {"8B": "llama3_8b", "70B": "llama3_70b", "405B": "llama3_405b"},
    "llama2": {"7B": "llama2_7b", "13B": "llama2_13b", "70B": "llama2_70b"},
    "llama4": {"debugmodel": "llama4_debugmodel", "17bx16e": "llama4_17bx16e", "17bx128e": "llama4_17bx128e"},
}


def get_llama_args(
    flavor_or_args: str | LlamaModelArgs,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
) -> LlamaModelArgs:
    """A fresh copy of the flavor's (or the given) args with optional overrides.

    Raises ``ValueError`` naming the valid flavors for an unknown flavor name.
    """
    if isinstance(flavor_or_args, str):
        if flavor_or_args not in LLAMA_FLAVORS:
            raise ValueError(
                f"unknown llama flavor {flavor_or_args!r}; valid flavors: "
                + ", ".join(sorted(LLAMA_FLAVORS))
            )
        args = LLAMA_FLAVORS[flavor_or_args]
    elif isinstance(flavor_or_args, LlamaModelArgs):
        args = flavor_or_args
    else:
        raise TypeError(f"expected a flavor name or LlamaModelArgs, got {type(flavor_or_args)!r}")
    overrides = {}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    if max_seq_len is not None:
        overrides["max_seq_len"] = max_seq_len
    return dataclasses.replace(args, **overrides)
