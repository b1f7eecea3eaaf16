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


def grouped_mm() -> Callable | None:
    """torch's grouped matrix multiply, ``(x[tokens, in], w[groups, in, out], offs=int32 cumulative group ends)
    -> [tokens, out]`` (row block ``g`` of ``x`` times ``w[g]``), with its backward; None where torch has none.

    Only the private ``torch._grouped_mm`` exists: the one kernel that runs all experts of a mixture-of-experts
    layer without reading their token counts on the host. Checked: 2.13.0 and 2.14.1 on CPU (float32 and
    bfloat16, every dimension a multiple of 16 bytes), 2.11.0 (CUDA)."""
    import torch

    return getattr(torch, "_grouped_mm", None)


def grouped_mm_op():
    """The aten operator behind :func:`grouped_mm` (what a dispatch mode sees), or None. Checked: 2.13.0, 2.14.1."""
    import torch

    return getattr(torch.ops.aten, "_grouped_mm", None) if grouped_mm() is not None else None


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
# torchft
# --------------------------------------------------------------------------------------------------


def quiet_torchft_transport(timeout):
    """torchft's HTTP checkpoint transport (its default: how a live group sends its state to a group that
    joins), without the request line its HTTP server writes to stderr for every transfer (a group's console
    is for its own lines; the launcher prints a failing worker's stderr). torchft exposes no option for it:
    the transport's server is its private ``_server``. Checked: torchft 0.2.0; a release without it keeps
    torchft's request lines."""
    from torchft.checkpointing import HTTPTransport

    transport = HTTPTransport(timeout=timeout, num_chunks=0)
    server = getattr(transport, "_server", None)
    if server is not None:
        server.RequestHandlerClass.log_message = lambda *args, **kwargs: None
    return transport


def quiet_torchft_sequence_numbers() -> None:
    """torch 2.14 made a c10d backend's ``_set_sequence_number_for_group`` a no-op (sequence numbers now start
    at 0 on every rank) that prints a deprecation warning from C++ straight to stderr, once per process.
    torchft calls it each time it (re)configures a replica group's process group, so every group's console
    gained a line of torch's before its own one-line errors. Where the call is the no-op, it is replaced by a
    silent one: the same effect. Checked: 2.14.1 (the method is the base ``Backend``'s, also for NCCL);
    2.11.0-2.13.0 still set the number, and are left as they are; torchft 0.2.0."""
    import torch
    from torch._C import _distributed_c10d

    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14):
        _distributed_c10d.Backend._set_sequence_number_for_group = lambda self: None


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


# --------------------------------------------------------------------------------------------------
# trainer simulate
# --------------------------------------------------------------------------------------------------
#
# trainer simulate runs one rank of a big world in one process: torch's fake process group and fake tensors,
# its memory trackers, and a dispatch mode that counts FLOPs and collectives. torch publishes none of these.
# Checked on torch 2.13.0 and 2.14.1 (tests/unit/test_simulate.py and test_step_shared.py run them on both).


def register_fake_backend():
    """A store for ``dist.init_process_group("fake", ...)``. torch's fake process group (collectives return
    at once, move nothing) is registered as the "fake" backend by importing its test module; no public module
    registers it or exports its store."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fake_tensor_mode():
    """torch's ``FakeTensorMode`` (tensors with shapes and dtypes, no storage), accepting real inputs, which
    ``to_empty`` turns into fake parameters. There is no public constructor for it (``torch._subclasses``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def real_tensors() -> Iterator[None]:
    """Tensors made inside are real even under an active ``FakeTensorMode`` (trainer simulate): for small
    static metadata that must be read on the host, e.g. which rows of a matrix a rank's shard holds. Checked:
    ``torch._subclasses.fake_tensor.unset_fake_temporarily`` in 2.11.0-2.14.1."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


def dispatch_mode_base() -> type:
    """``TorchDispatchMode``, the base class of a mode that sees every op a tensor runs (how
    ``FlopCounterMode`` and the memory trackers count); torch exports it only from
    ``torch.utils._python_dispatch``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def cpu_flash_attention_ops() -> tuple:
    """The CPU flash-attention forward and backward ops (``aten._scaled_dot_product_flash_attention_for_cpu``):
    SDPA on CPU runs them, and ``torch.utils.flop_counter``'s registry has formulas for the CUDA kernels only."""
    import torch

    aten = torch.ops.aten
    return (aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward)


@contextlib.contextmanager
def isolated_sharding_propagation():
    """DTensor derives an op's output shape by running the op once on global-shape fake tensors, under the
    fake mode it finds active. Those phantom tensors are as large as the unsharded model (a 405B optimizer
    step's worth), and memory trackers and counters would take them for real ones. Run that propagation with
    the dispatch modes switched off, so it makes its own private fake mode. DTensor has no public hook for
    this (``ShardingPropagator`` and ``_disable_current_modes`` are private); 2.13 has the uncached
    ``_propagate_tensor_meta_non_cached`` that its lru-cached wrapper calls, older versions only the method."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    name = next(n for n in ("_propagate_tensor_meta_non_cached", "_propagate_tensor_meta")
                if hasattr(ShardingPropagator, n))
    original = getattr(ShardingPropagator, name)

    def isolated(self, op_schema):
        with _disable_current_modes():
            return original(self, op_schema)

    setattr(ShardingPropagator, name, isolated)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, original)


def phase_memory_tracker(fsdp_root, modules: list, optimizer, phase_name: Callable[[], str]):
    """torch's ``FSDPMemTracker`` on ``fsdp_root`` (an FSDP2 module), else ``MemTracker`` over ``modules``;
    both categorise every tensor (parameters, gradients, optimizer state, FSDP buffers, activations). Besides
    the overall peak, the tracker keeps in ``phase_peaks`` each phase's peak snapshot (``phase_name()`` is the
    current one).

    The trackers live in ``torch.distributed._tools`` (no public API). The peak bookkeeping replaces their
    private ``_update_peak_stats``, which after every op also walks every module's statistics (a cost that
    grows with the square of the depth), and reads their private ``_curr_mem_snap`` / ``_peak_mem`` /
    ``_peak_mem_snap``; the public ``get_tracker_snapshot("peak")`` then reads what it writes."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    class PhasePeaks:
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                total = snap["Total"]
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = dict(snap)
                best = self.phase_peaks.get(phase_name())
                if best is None or total > best["Total"]:
                    self.phase_peaks[phase_name()] = dict(snap)

    if fsdp_root is not None:
        tracker = type("SimFSDPMemTracker", (PhasePeaks, FSDPMemTracker), {})(fsdp_root, optimizer)
    else:
        tracker = type("SimMemTracker", (PhasePeaks, MemTracker), {})()
        tracker.track_external(*modules, optimizer)
    tracker.phase_peaks = {}
    return tracker


class _Agreed:
    """The vote's outcome every stage reaches when each was given its metadata (static mode)."""

    def item(self) -> int:
        return 1


def agree_pipeline_vote(stage) -> None:
    """Skip a ``PipelineStage``'s first-step vote with its neighbours over point-to-point messages (whether
    every stage was given its metadata, so none needs inferring): over a fake process group nothing answers,
    and the vote's result is read on the host (``.item()``), which a fake tensor cannot give. The stage's
    outcome is what its peers would answer when, as in ``trainer simulate``, every stage is built with its
    example input and output. The vote is private (``_warmup_forward_vote`` / ``_warmup_backward_result``, new
    in 2.13's pipelining); torch versions without it exchange no vote, and these attributes go unused."""
    stage._warmup_forward_vote = lambda has_backward, received_acc=None: _Agreed()
    stage._warmup_backward_result = lambda received_result=None: _Agreed()
