"""Checkpoints (placeholder until DCP saving lands): the train state that checkpoints carry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens_seen, self.skipped_steps = int(sd["step"]), int(sd["tokens_seen"]), int(sd["skipped_steps"])


class CheckpointManager:
    def __init__(self, config, trainer):
        self.config = config
        self.trainer = trainer

    def load(self) -> None:
        pass

    def maybe_save(self, step: int, last: bool) -> None:
        pass

    def finish(self) -> None:
        pass
