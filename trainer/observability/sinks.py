"""Extra destinations of the metrics records: Weights & Biases, and the last record for the summary."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any


logger = logging.getLogger("trainer")


class WandbWriter:
    """A metrics sink that mirrors each step record to Weights & Biases.

    Project, entity, run name and mode come from the usual variables (WANDB_PROJECT, default
    "llm-trainer"; WANDB_ENTITY; WANDB_NAME, default the dump folder's name; WANDB_MODE=offline). The run
    id is kept in ``<dump_folder>/wandb/run_id``, so a resumed job continues the same W&B run.
    """

    def __init__(self, wandb_module, config, dump_folder: Path):
        self.wandb = wandb_module
        folder = dump_folder / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run_id"
        run_id = os.environ.get("WANDB_RUN_ID") or (id_file.read_text().strip() if id_file.exists() else "")
        if not run_id:
            run_id = f"{int(time.time()):x}{os.getpid():x}"
        id_file.write_text(run_id)
        self.run = wandb_module.init(
            project=os.environ.get("WANDB_PROJECT", "llm-trainer"),
            name=os.environ.get("WANDB_NAME") or dump_folder.resolve().name,
            dir=str(dump_folder), config=config.to_dict(), id=run_id, resume="allow",
        )
        self.broken = False

    def write(self, record: dict[str, Any]) -> None:
        if self.broken:
            return
        values = {k: (float(v) if isinstance(v, bool) else v) for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and v is not None}
        try:
            self.wandb.log(values, step=record["step"])
        except Exception as e:
            self.broken = True
            logger.warning("wandb: logging failed, no more W&B records this run: %s", e)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run.finish()


def build_wandb_writer(config, dump_folder: Path) -> WandbWriter | None:
    """The W&B sink if ``metrics.enable_wandb`` and the package is installed; otherwise a clear warning."""
    if not config.metrics.enable_wandb:
        return None
    try:
        import wandb
    except ImportError:
        logger.warning("metrics.enable_wandb is set but the wandb package is not installed (pip install wandb); "
                       "continuing without Weights & Biases")
        return None
    try:
        return WandbWriter(wandb, config, dump_folder)
    except Exception as e:  # not logged in, no network, ...
        logger.warning("metrics.enable_wandb: could not start a W&B run (%s); continuing without it", e)
        return None


class _LastRecord:
    """Metrics sink that remembers the last step record (for the run summary)."""

    def __init__(self):
        self.record: dict[str, Any] | None = None

    def write(self, record: dict[str, Any]) -> None:
        self.record = record

    def close(self) -> None:
        pass
