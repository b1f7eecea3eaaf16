"""Data pipeline: sources -> documents -> tokens -> packed sequences -> sharded, resumable batches.

    loader = build_train_loader(config, tokenizer, dp_rank=r, dp_world_size=w)
    batch = next(loader)               # {"input": [B, seq_len], "labels": [B, seq_len], ...}
    state = loader.state_dict()        # this rank, JSON-able
    merged = merge_states(all_ranks)   # one global state, loadable with any dp degree dividing num_shards
    loader.load_state_dict(merged)

See docs/data.md for sources, separators, sharding and the resume guarantee.
"""

import importlib

# Resolved on first use (PEP 562): importing the package must not import torch, because the config
# sections import trainer.data.config and the launcher's pre-flight should stay torch-free.
_EXPORTS = {
    "DataError": "trainer.data.sources", "DataStateError": "trainer.errors", "TrainLoader": "trainer.data.loader",
    "ValLoader": "trainer.data.loader", "aggregate_stats": "trainer.data.loader",
    "build_train_loader": "trainer.data.loader", "build_val_loader": "trainer.data.loader",
    "merge_states": "trainer.data.loader",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainer.data' has no attribute {name!r}")
