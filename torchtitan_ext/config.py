"""The JobConfig this package trains with: trainer's core sections plus [stability] and [eval].

``register`` (``torchtitan_ext/__init__.py``) hands ``ExtJobConfig`` to the registry; the parser then
builds it, so code here reads ``config.stability`` and ``config.eval`` as typed attributes (annotate with
``ExtJobConfig``), while the core knows only ``JobConfig``. A new section is a field here with one line in
``SECTION_DOC``; its rules are registered next to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_ext.evaluation.config import Eval
from torchtitan_ext.stability.config import Stability
from trainer.config.sections import JobConfig


@dataclass
class ExtJobConfig(JobConfig):
    stability: Stability = field(default_factory=Stability)
    eval: Eval = field(default_factory=Eval)


SECTION_DOC = {
    "stability": "Skipping steps, spike and NaN guards, embedding-gradient shrink (see docs/stability.md).",
    "eval": "lm-eval tasks scored on the model during training (see docs/export_eval.md).",
}
# Keys that moved into [stability] (the extension implements them): their former names stay accepted.
ALIASES = {
    "training.z_loss_weight": "stability.z_loss_weight",
    "debug.inject_bad_data_steps": "stability.inject_bad_data_steps",
    "debug.inject_nonfinite_loss_steps": "stability.inject_nonfinite_loss_steps",
}
