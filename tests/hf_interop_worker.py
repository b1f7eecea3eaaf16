"""Several training runs in one process, so that one torchrun start serves many runs (tests only).

``python -m torch.distributed.run ... tests/hf_interop_worker.py SPECS.json``: SPECS is a JSON list of
``{"argv": [--section.key value ...], "save_batch": PATH or null}``. Each run builds the real Trainer from
its config and trains; ``save_batch`` also writes the run's first training batch (what step 1 trains on).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main() -> int:
    from trainer import logs
    from trainer.config import load_config, validate
    from trainer.data.loader import build_train_loader
    from trainer.train import Trainer

    logs.setup()
    world = int(os.environ.get("WORLD_SIZE", 1))
    for spec in json.loads(Path(sys.argv[1]).read_text()):
        config = load_config(spec["argv"], env={})
        validate(config, world)
        trainer = Trainer(config)
        if spec.get("save_batch") and trainer.rank == 0:
            loader = build_train_loader(config, trainer.tokenizer, dp_rank=0, dp_world_size=1)
            batch = next(iter(loader))
            torch.save({"input": batch["input"].clone(), "labels": batch["labels"].clone()}, spec["save_batch"])
        trainer.train()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
