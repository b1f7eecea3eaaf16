"""The [data] config section: sources, mixing, packing and loader workers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Data:
    num_workers: int = 0
    """Loader worker processes per rank (0 loads in the training process)."""
