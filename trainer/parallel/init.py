"""Weight initialisation that gives identical weights under every parallel layout.

A sharded model initialised in place would draw different random numbers per layout (each rank fills
its own shard), so FSDP 4, TP 2 or a pipeline stage would start from different weights than one
process. Instead each unit of the model (the embedding, each block, the final norm, the output layer)
is initialised in full, on the device, from a generator seeded by (seed, unit name), using the model's
own ``init_weights``; every rank then keeps the slice its parameters own. Only one unit is ever
materialised in full at a time.
"""

from __future__ import annotations

import copy
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.parallel import clean_fqn
from trainer.torch_compat import local_shape_and_offset


def model_units(template: nn.Module) -> list[str]:
    units = [name for name in ("tok_embeddings",) if getattr(template, name, None) is not None]
    units += [f"layers.{k}" for k in template.layers.keys()]
    units += [name for name in ("norm", "output") if getattr(template, name, None) is not None]
    return units


def _unit_template(template: nn.Module, unit: str) -> nn.Module:
    """A copy of the (meta) model holding only ``unit``; its init_weights then initialises just that. The
    other units are not copied at all (the copy's memo maps them to None), so a model of n blocks costs n
    block copies in all, not n whole-model copies."""
    keep = unit.split(".", 1)[1] if unit.startswith("layers.") else None
    others = [getattr(template, name) for name in ("tok_embeddings", "norm", "output")
              if name != unit and getattr(template, name, None) is not None]
    others += [layer for key, layer in template.layers.items() if key != keep]
    part = copy.deepcopy(template, {id(m): None for m in others})
    for key in [key for key, layer in part.layers.items() if layer is None]:
        del part.layers[key]
    return part


def local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return full
    shape, offset = local_shape_and_offset(full.shape, param.device_mesh, param.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return full[index]


@torch.no_grad()
def init_weights(model: nn.Module, template: nn.Module, seed: int, device: torch.device) -> None:
    """Initialise ``model`` (parallelized, materialised with ``to_empty``) like a single-process model.

    ``template`` is the unparallelized model (or pipeline stage) on the meta device.
    """
    params = {clean_fqn(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    buffers = {clean_fqn(n): b for n, b in model.named_buffers()}
    for unit in model_units(template):
        part = _unit_template(template, unit).to_empty(device=device)
        generator_seed = seed * 1_000_003 + zlib.crc32(unit.encode())
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            torch.manual_seed(generator_seed)
            part.init_weights(buffer_device=device)
        for name, full in part.named_parameters():
            target = params[name]
            local = target.to_local() if isinstance(target, DTensor) else target
            local.copy_(local_slice(full, target).to(local.dtype))
        for name, full in part.named_buffers():  # a unit's own state (an MoE layer's expert bias and counts)
            if name in buffers and name != "rope_cache":
                buffers[name].copy_(full)
        del part
    # Non-persistent buffers (the RoPE table) are recomputed by the model itself.
    if hasattr(model, "_compute_rope_cache"):
        model.rope_cache = model._compute_rope_cache(device=device)
