"""torch's private APIs, each behind one small function: the only module of the trainer that names them.

A function is here because torch has no public API that does its job. Its comment says why and the torch
versions checked: 2.11.0 (the oldest pyproject.toml allows), 2.12.1, 2.13.0 (pinned, tested) and 2.14.1 (the
newest the registry serves), read in each version's own sources. When torch makes one public, the function's
body changes and no caller does; when an upgrade breaks one, this is the file to read.
tests/unit/test_torch_compat.py fails on a private torch name anywhere else in the project's packages, and
runs each function here on the installed torch.

Functions only, importing torch inside each: importing this module costs nothing and changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

# The logger through which torch's pytree module warns about the Enum torchao registers as a pytree node: the
# name of that private module. Checked: 2.12.1-2.14.1 warn there; 2.11.0 has no such warning.
PYTREE_LOGGER = "torch.utils._pytree"


# --------------------------------------------------------------------------------------------------
# Process groups and the collective flight recorder
# --------------------------------------------------------------------------------------------------


def process_groups() -> list[ProcessGroup]:
    """Every process group this process has created and not destroyed, the default group first.

    torch.distributed has no public listing of process groups (a DeviceMesh lists its own only, and groups
    made with new_group belong to no mesh); c10d keeps them in ``_world.pg_map``, in creation order.
    Checked: 2.11.0, 2.12.1, 2.13.0, 2.14.1."""
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


def flight_recorder_dump(recorder: str, as_json: bool = False) -> Callable[[], bytes] | None:
    """The function that returns this process's flight-recorder buffer, or None where this build has none.

    ``recorder`` is ``"nccl"`` (NCCL's own recorder, CUDA builds only) or ``"generic"`` (every other
    backend: gloo). The pickle form is what ``torchfrtrace`` reads; ``as_json`` gives the same entries as JSON.
    The buffers are reachable only through these c10d bindings: torch.distributed.flight_recorder is the
    offline analyser of dumped files, and NCCL dumps by itself only on its own timeout.
    Checked: all four in the 2.11.0, 2.12.1 and 2.14.1 CUDA wheels; the 2.13.0 CPU build has the generic two."""
    import torch

    names = {"nccl": "_dump_nccl_trace", "generic": "_dump_fr_trace"}
    return getattr(torch._C._distributed_c10d, names[recorder] + ("_json" if as_json else ""), None)


# --------------------------------------------------------------------------------------------------
# Profiler and CUDA memory
# --------------------------------------------------------------------------------------------------


def set_profiler_step(prof: Any, step: int, action: Any) -> None:
    """Make a ``torch.profiler.profile`` (before ``__enter__``) count from ``step``, in ``action`` there.

    The profiler counts steps from 0 and takes no start step; ``step_num`` and ``current_action`` are
    public attributes, but torch >= 2.13 also keeps the schedule's last answer in ``_prev_schedule_action``,
    which ``stop()`` puts back into ``current_action`` and ``step()`` reads after a device-side stop: left
    alone, it holds step 0's answer.
    Checked: absent in 2.11.0 and 2.12.1; the same use in 2.13.0 and 2.14.1."""
    prof.step_num = step
    prof.current_action = action
    if hasattr(prof, "_prev_schedule_action"):
        prof._prev_schedule_action = action


def start_cuda_memory_history(max_entries: int) -> None:
    """Record the CUDA caching allocator's allocations (with stack traces), the last ``max_entries``.

    torch documents this underscored function as the way to record memory history ("Understanding CUDA
    Memory Usage"); there is no public name for it. Checked: the same signature in 2.11.0-2.14.1."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries)


def stop_cuda_memory_history() -> None:
    """Stop recording CUDA memory history (see :func:`start_cuda_memory_history`)."""
    import torch

    torch.cuda.memory._record_memory_history(enabled=None)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the allocator's state and recorded history as the pickle https://pytorch.org/memory_viz reads.

    The public ``torch.cuda.memory_snapshot()`` returns the segments only, without the history or the
    file format. Checked: the same function in 2.11.0-2.14.1."""
    import torch

    torch.cuda.memory._dump_snapshot(path)


def warn_on_tensor_cycles() -> None:
    """From now on, warn whenever the garbage collector frees a reference cycle that holds a CUDA tensor.

    CUDA only: it records CUDA memory history (a CPU build has none to record: AttributeError). torch has no
    public form of this debugging aid (torchtitan's gc debug calls the same function).
    Checked: torch.utils.viz._cycles.warn_tensor_cycles in 2.11.0-2.14.1."""
    from torch.utils.viz._cycles import warn_tensor_cycles

    warn_tensor_cycles()


# --------------------------------------------------------------------------------------------------
# Parallelism
# --------------------------------------------------------------------------------------------------


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """One dimension named ``name`` over all of ``mesh``'s (a slice of the root mesh), which the root mesh
    can then hand out by name.

    DeviceMesh has no public flatten (torchtitan calls the same method); a mesh built anew would create
    process groups of its own. Checked: ``DeviceMesh._flatten(mesh_dim_name)`` in 2.11.0-2.14.1."""
    return mesh._flatten(name)


def local_shape_and_offset(global_shape: Sequence[int], mesh: DeviceMesh,
                           placements: Sequence[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of this rank's shard of a tensor of ``global_shape`` placed on ``mesh`` as ``placements``,
    and where the shard starts in the global tensor.

    DTensor's public API gives a shard's local tensor, not its place in the global one; with uneven and
    strided shards (FSDP over tensor parallel) the arithmetic is torch's own. Checked:
    torch.distributed.tensor._utils.compute_local_shape_and_global_offset, same signature, 2.11.0-2.14.1."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(global_shape, mesh, placements)


def enable_async_tensor_parallel() -> None:
    """Turn on Inductor's micro-pipelined (asynchronous) tensor parallel for code compiled from now on.

    Only a private Inductor flag switches the pass on; it is process-wide and stays on. The symmetric memory
    the pass uses sets itself up per group: torch.distributed._symmetric_memory.enable_symm_mem_for_group,
    called for that before, says "no need to call this function anymore" (a FutureWarning) in every version
    checked. Checked: ``torch._inductor.config._micro_pipeline_tp`` in 2.11.0-2.14.1."""
    import torch._inductor.config

    torch._inductor.config._micro_pipeline_tp = True


def checkpoint_wrapper(module: torch.nn.Module, **options) -> torch.nn.Module:
    """``module`` wrapped so that its forward runs under non-reentrant activation checkpointing
    (``options`` go to torch.utils.checkpoint.checkpoint, ``context_fn`` included).

    torch.utils.checkpoint.checkpoint is public but wraps a call, not a module; this wrapper also keeps the
    module's state-dict keys as they were, which checkpoints rely on. Checked:
    torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper, 2.11.0-2.14.1."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, **options)


@contextlib.contextmanager
def pipeline_loss_disabled(schedule: Any) -> Iterator[None]:
    """Inside this, a pipeline schedule's ``eval()`` runs the stages forward without its loss function.

    ``eval()`` only turns backward off: the last stage still calls the loss function the schedule was
    built with, and the schedule takes it in its constructor only (``_loss_fn``, no setter).
    Checked: 2.11.0-2.14.1."""
    loss_fn, schedule._loss_fn = schedule._loss_fn, None
    try:
        yield
    finally:
        schedule._loss_fn = loss_fn


# --------------------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------------------


def takes_found_inf(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` takes AMP's ``grad_scale``/``found_inf`` and skips on the device.

    Only a private attribute marks such optimizers (fused Adam/AdamW set it; torch.amp.GradScaler reads it
    the same way). Checked: ``_step_supports_amp_scaling`` in 2.11.0-2.14.1."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


# --------------------------------------------------------------------------------------------------
# Benchmarks
# --------------------------------------------------------------------------------------------------


def report_cpu_as_the_device_type() -> None:
    """Make torch answer ``"cpu"`` when asked for the available accelerator type (for this process).

    torchtitan 0.2.2 picks its device at import through torch._utils._get_available_device_type and falls
    back to ``"cuda"`` on a machine without one; replacing that function before torchtitan's import is the
    only way to run it on a CPU. Checked: the function in 2.11.0-2.14.1."""
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
