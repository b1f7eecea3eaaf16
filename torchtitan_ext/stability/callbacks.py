"""The toolkit's callbacks for a run (registered with trainer/extensions.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchtitan_ext.stability.embedding import AlphaSchedule, EmbeddingGradShrink
from torchtitan_ext.stability.faults import FaultInjection
from torchtitan_ext.stability.guard import StepGuard
from torchtitan_ext.stability.rewarmup import LRRewarmup
from torchtitan_ext.stability.skip import SkipRanges
from torchtitan_ext.stability.zloss import ZLoss

if TYPE_CHECKING:
    from torchtitan_ext.config import ExtJobConfig
    from trainer.callbacks import Callback


def build_stability_callbacks(config: ExtJobConfig) -> list[Callback]:
    """The toolkit's callbacks, in hook order: fault drills first (they replace the batch and the loss the
    others see), the step guard last (it decides after every other loss term is in)."""
    s = config.stability
    return [
        FaultInjection(s.inject_bad_data_steps, s.inject_nonfinite_loss_steps),
        LRRewarmup(s.lr_rewarmup_steps_after_load, s.skip_steps),
        SkipRanges(s.skip_steps),
        EmbeddingGradShrink(AlphaSchedule(s.embedding_grad_alpha, s.embedding_grad_alpha_start,
                                          s.embedding_grad_alpha_steps), enabled=s.embedding_grad_shrink),
        ZLoss(s.z_loss_weight),
        StepGuard(s, config),
    ]
