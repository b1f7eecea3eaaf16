"""Models for tests."""

from __future__ import annotations


def fast_model(args, seed: int = 0) -> "Transformer":  # noqa: F821
    """Random weights without the (slow on CPU) truncated-normal init; norm weights around 1 so that a
    mixed-up norm mapping would show."""
    import torch

    from trainer.models.llama.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if "tok_embeddings" in name else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0))
    model.rope_cache = model._compute_rope_cache()
    return model.eval()


def seeded_model(args, seed: int = 0) -> "Transformer":  # noqa: F821
    """The model as training builds it (``init_weights``), seeded the same way before construction and init."""
    import torch

    from trainer.models.llama.model import Transformer

    torch.manual_seed(seed)
    model = Transformer(args)
    torch.manual_seed(seed)
    model.init_weights()
    return model
