"""What a checkpoint holds, and the stateful components it is taken from and restored into.

The DCP entries (other tools load ``{"model": sd}`` from any checkpoint):

* ``model``: the weights under their plain names (``tok_embeddings.weight``, ``layers.0.attention.wq.weight``
  ...), as DTensors where the run shards them, so a checkpoint loads under any other layout;
* ``optimizer``: AdamW state keyed by the same names (absent in model-only checkpoints);
* ``train_state``: step, tokens seen, skipped steps; ``callbacks``: the callbacks' state (pickled);
* ``lr_scheduler``: nothing to restore, the schedule is a pure function of the step; the step and the
  learning rate it gave are recorded so a resume can warn when the schedule has changed;
* ``rng.rank_<r>``: each rank's torch CPU (and CUDA) generator states;
* ``dataloader.json`` (a sidecar, not a DCP entry): the global data-loader state, which re-partitions over
  any number of data-parallel ranks.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.errors import CheckpointError
from trainer.parallel import clean_fqn

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TrainState:
    """The loop's counters, saved in every checkpoint."""

    step: int = 0
    tokens_seen: int = 0
    # Set by CheckpointManager.load() to the step a run resumed from (None: started fresh); not saved.
    resumed_from_step: int | None = None
    _skipped: int = 0
    _pending_skips: torch.Tensor | None = None  # skips decided on the device and not read yet

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was skipped. Reading it reads the device counter (log steps and saves only)."""
        if self._pending_skips is not None:
            self._skipped += int(self._pending_skips.item())
            self._pending_skips = None
        return self._skipped

    def add_skip(self, skip: bool | torch.Tensor) -> None:
        """Count a skip known on the host (bool) or decided on the device (0-d bool), without a host read."""
        if isinstance(skip, torch.Tensor):
            skip = skip.long()
            self._pending_skips = skip if self._pending_skips is None else self._pending_skips + skip
        else:
            self._skipped += int(skip)

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])
        self._skipped, self._pending_skips = int(sd["skipped_steps"]), None


def pickle_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpickle_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def read_loader_file(path) -> Any:
    """A data-loader state sidecar as written by a save (JSON, or pickled when not JSON-able)."""
    path = Path(path)
    return json.loads(path.read_text()) if path.suffix == ".json" else unpickle_bytes(path.read_bytes())


def _global_nbytes(obj: Any) -> tuple[int, int]:
    """(bytes, tensor count) of the tensors in a (nested) state dict, at their global (unsharded) sizes:
    what the whole checkpoint holds, whichever rank writes it."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return math.prod(obj.shape) * obj.element_size(), 1
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size(), 1
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        total = count = 0
        for v in obj:
            b, c = _global_nbytes(v)
            total += b
            count += c
        return total, count
    if isinstance(obj, (bytes, bytearray)):
        return len(obj), 1
    return 0, 0


def estimate_checkpoint_bytes(state: dict) -> int:
    """Bytes a save of ``state`` writes: tensor data plus DCP's per-item framing and metadata."""
    data, items = _global_nbytes(state)
    return data + items * 3072 + (1 << 16)


def merge_model_parts(parts: list) -> torch.nn.Module:
    """One module whose attribute tree joins several pipeline stages (each a copy of the model keeping
    some of its blocks), so parameters keep their full-model names: stage 0's ``layers.0`` and stage
    1's ``layers.3`` become ``layers.0`` and ``layers.3`` of the view. Shares, never copies, the stages'
    modules and parameters."""
    from torch import nn

    root = nn.Module()
    for part in parts:
        for name, param in part.named_parameters(recurse=False):
            if hasattr(root, name):
                raise CheckpointError(f"parameter {name} appears in two model parts")
            root.register_parameter(name, param)
    names: list[str] = []
    for part in parts:
        names += [n for n, _ in part.named_children() if n not in names]
    for name in names:
        children = [c for part in parts if (c := getattr(part, name, None)) is not None]
        if len(children) == 1:
            root.add_module(name, children[0])
        elif all(isinstance(c, nn.ModuleDict) for c in children):
            merged = nn.ModuleDict()
            for c in children:
                for key, module in c.items():
                    if key in merged:
                        raise CheckpointError(f"module {name}.{key} appears in two model parts")
                    merged[key] = module
            root.add_module(name, merged)
        else:
            root.add_module(name, merge_model_parts(children))
    return root


def merge_loader_states(loader: Any, states: list) -> Any:
    """One global data-loader state from every data-parallel rank's state: the loader's ``merge_states``
    (a replica group of a fault-tolerant job passes a loader whose merge keeps its own ranks)."""
    return loader.merge_states(states)


def load_loader_global_state(loader: Any, global_state: Any) -> None:
    """Restore a merged data-loader state into this rank's loader (under any data-parallel degree)."""
    fn = getattr(loader, "load_global_state", None)
    if fn is None:
        raise CheckpointError("the data loader provides no load_global_state(): its state cannot be restored")
    fn(global_state)


@dataclass
class Components:
    """The stateful parts of a training run that a checkpoint saves and restores, given explicitly.

    ``model_parts``: the model, or this rank's pipeline stages (the optimizer spans all of them);
    ``data_loader``: ``state_dict()`` per rank, merged over data-parallel ranks; ``callbacks``: any
    object with ``state_dict()``/``load_state_dict()``; ``lr_schedule``: ``lr(step)`` (None: not recorded).
    ``dp_rank``, ``pp_degree`` and ``layout`` (a description) place this rank; ``num_params`` counts the
    whole model (all pipeline stages), for the size estimate.
    """

    model_parts: list
    optimizer: Any
    train_state: TrainState
    data_loader: Any
    callbacks: Any
    device: torch.device
    lr_schedule: Any = None
    dp_rank: int = 0
    pp_degree: int = 1
    layout: str = ""
    num_params: int | None = None
    _merged: Any = field(default=None, init=False, repr=False)

    @property
    def use_cuda(self) -> bool:
        return self.device.type == "cuda"

    def model(self) -> torch.nn.Module:
        """The model, or a view of this rank's pipeline stages as one module with the original names
        (what the optimizer state dict is keyed by)."""
        if self._merged is None:
            parts = self.model_parts
            self._merged = parts[0] if len(parts) == 1 else merge_model_parts(parts)
        return self._merged

    def model_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd: dict = {}
        for part in self.model_parts:
            for k, v in get_model_state_dict(part).items():
                k = clean_fqn(k)
                if k in sd:
                    raise CheckpointError(f"parameter {k} appears in two model parts")
                sd[k] = v
        return sd

    def set_model_state(self, sd: dict, strict: bool = True) -> None:
        """Restore the model from ``sd``; ``strict=False`` leaves the weights ``sd`` lacks as they are (a
        partial load the user asked for)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        if len(self.model_parts) == 1:
            set_model_state_dict(self.model_parts[0], sd, options=StateDictOptions(strict=strict))
            return
        for part in self.model_parts:
            names = {clean_fqn(k) for k in part.state_dict()}
            set_model_state_dict(part, {k: v for k, v in sd.items() if k in names},
                                 options=StateDictOptions(strict=strict))

    def optimizer_state(self, flat: bool | None = None) -> dict:
        """The optimizer's state dict keyed by parameter names. ``flat`` (default: under pipeline parallel)
        also keys its param_groups by parameter name: each pipeline rank holds other parameters, and a list of
        groups would be one key that DCP writes from one rank only (the others' groups would be lost)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        flat = self.pp_degree > 1 if flat is None else flat
        return get_optimizer_state_dict(self.model(), self.optimizer,
                                        options=StateDictOptions(flatten_optimizer_state_dict=flat))

    def set_optimizer_state(self, sd: dict | None, flat: bool = False) -> None:
        """Restore the optimizer (``flat``: ``sd`` is in the form ``optimizer_state(flat=True)`` gives); None
        starts it fresh (never half-loaded by an earlier failed attempt)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if sd is None:
            self.optimizer.state.clear()
        else:
            set_optimizer_state_dict(self.model(), self.optimizer, sd,
                                     options=StateDictOptions(flatten_optimizer_state_dict=flat))

    def rng_state(self) -> dict:
        rng = {"cpu": torch.get_rng_state()}
        if self.use_cuda:
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return rng

    def set_rng_state(self, rng: dict) -> None:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.use_cuda:
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    def lr_at(self, step: int) -> float | None:
        """The schedule's learning rate at ``step`` (None before the first step or without a schedule)."""
        sched = self.lr_schedule
        return float(sched.lr(step)) if sched is not None and step > 0 else None

    def schedule_steps(self) -> int | None:
        """The LR schedule's length in steps (lr_scheduler.total_steps, else training.steps), or None."""
        return getattr(self.lr_schedule, "total_steps", None)

    def snapshot(self, step: int, rank: int, model_only: bool, dtype: torch.dtype | None) -> dict:
        """The DCP state dict a save of ``step`` writes (tensors shared with the live state, not copied)."""
        model = self.model_state()
        if dtype is not None:
            model = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.items()}
        state: dict[str, Any] = {"model": model, "train_state": self.train_state.state_dict()}
        if not model_only:
            state["optimizer"] = self.optimizer_state()
            # The schedule is a pure function of the step: nothing to restore. Recorded to detect changes.
            state["lr_scheduler"] = {"step": step, "lr": self.lr_at(step) or 0.0}
            state["callbacks"] = pickle_bytes(self.callbacks.state_dict())
            state["rng"] = {f"rank_{rank}": self.rng_state()}
        return state

    def full_checkpoint_bytes(self) -> int:
        """About the size of one full checkpoint: float32 weights and AdamW's two moments."""
        if self.num_params:  # the whole model (all pipeline stages)
            params = self.num_params * 4
        else:
            params = sum(math.prod(p.shape) * p.element_size() for p in self.model().parameters())
        return 3 * params + (1 << 20)
