"""The [stability] config section."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stability:
    skip_steps: list[list[int]] = field(default_factory=list)
    """Inclusive step ranges whose optimizer update is skipped (their data is still drawn), e.g.
    [[10, 20], [25, 30]]; on the command line 10-20,25-30."""
