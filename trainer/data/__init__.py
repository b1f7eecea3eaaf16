"""Data pipeline: sources -> documents -> tokens -> packed sequences -> sharded, resumable batches.

    from trainer.data.loader import build_train_loader, merge_states
    loader = build_train_loader(config, tokenizer, dp_rank=r, dp_world_size=w)
    batch = next(loader)               # {"input": [B, seq_len], "labels": [B, seq_len], ...}
    state = loader.state_dict()        # this rank, JSON-able
    merged = merge_states(all_ranks)   # one global state, loadable with any dp degree dividing num_shards
    loader.load_state_dict(merged)

Sources are in sources.py (the table of kinds, KINDS, and build_source) and readers.py (Megatron, OLMo numpy
and Arrow token files), on the base in source_base.py;
``trainer data audit|inspect|prepare`` in cli.py. See docs/data.md for sources, separators, sharding and
the resume guarantee. The [data] section is in config.py and its rules in checks.py (both torch-free, for the launcher's pre-flight); import from the
defining submodule.
"""
