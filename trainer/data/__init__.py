"""Data pipeline: sources -> documents -> tokens -> packed sequences -> sharded, resumable batches.

    loader = build_train_loader(config, tokenizer, dp_rank=r, dp_world_size=w)
    batch = next(loader)               # {"input": [B, seq_len], "labels": [B, seq_len], ...}
    state = loader.state_dict()        # this rank, JSON-able
    merged = merge_states(all_ranks)   # one global state, loadable with any dp degree dividing num_shards
    loader.load_state_dict(merged)

See docs/data.md for sources, separators, sharding and the resume guarantee.
"""

from trainer.data.loader import (
    DataStateError,
    TrainLoader,
    ValLoader,
    aggregate_stats,
    build_train_loader,
    build_val_loader,
    merge_states,
)
from trainer.data.sources import DataError

__all__ = [
    "DataError",
    "DataStateError",
    "TrainLoader",
    "ValLoader",
    "aggregate_stats",
    "build_train_loader",
    "build_val_loader",
    "merge_states",
]
