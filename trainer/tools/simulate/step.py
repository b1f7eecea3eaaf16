"""One simulated training step of one rank, and what it measures.

* Memory: torch's ``FSDPMemTracker`` (``MemTracker`` without FSDP) categorises every tensor the step
  creates: sharded parameters, gradients, optimizer state, FSDP's unsharded parameters and gradients and
  its all-gather / reduce-scatter buffers, activations and backward temporaries. Besides its overall
  peak, the peak of each phase (forward, backward, optimizer) is kept with its breakdown.
* FLOPs: torch's FLOP formulas (``torch.utils.flop_counter.flop_registry``, the formulas
  ``FlopCounterMode`` uses) applied to every op the rank runs on its local shards, plus the same SDPA
  formula for the CPU flash-attention kernel. (``FlopCounterMode`` itself is not used: it counts DTensor
  ops at their global shapes and its module tracker keeps activations alive, which would spoil the memory
  numbers.)
* Collectives: every c10d and functional collective the rank issues, by kind, process group (the mesh
  dimension) and bytes. Bytes are the collective's full buffer: the gathered output of an all-gather, the
  unreduced input of a reduce-scatter, the tensor of an all-reduce; a ring moves (n-1)/n of that per rank.
  Pipeline sends and receives count the same way (one tensor each).

The step is the trainer's own (trainer/step.py: ``forward_backward`` or ``forward_backward_pipeline``, then
``clip_and_step``) for one micro-batch, or with pipelining one local batch of micro-batches, in steady state:
the optimizer state exists before the step (created by an untracked step with zero gradients), as it does from
the second step of a run on. With pipelining, ``forward_backward_pipeline`` runs torch's schedule and stage
as training builds them (trainer/parallel/pipeline.py; world.py gives each stage the metadata its fake
neighbours cannot). The same function measures a real rank: tests/support/real_step.py runs it over gloo
(``mode`` a null context) for tests/unit/test_step_shared.py to compare.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainer import step as steps
from trainer import torch_compat
from trainer.tools.simulate.world import SIM_DEVICE, Layout, RankView, group_labels

# --------------------------------------------------------------------------------------------------
# Counting FLOPs and collectives
# --------------------------------------------------------------------------------------------------

# schema name -> (kind, where the communicated buffer is: an argument index or "out")
COLLECTIVES: dict[str, tuple[str, int | str]] = {
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::allgather_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "out"),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "out"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "_c10d_functional_autograd::all_gather_into_tensor": ("all_gather", "out"),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "_c10d_functional_autograd::reduce_scatter_tensor": ("reduce_scatter", 0),
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "_c10d_functional::all_reduce": ("all_reduce", 0),
    "_c10d_functional::all_reduce_": ("all_reduce", 0),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", 0),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", 0),
    "c10d::broadcast_": ("broadcast", 0),
    "_c10d_functional::broadcast": ("broadcast", 0),
    "_c10d_functional::broadcast_": ("broadcast", 0),
    "c10d::alltoall_base_": ("all_to_all", 1),
    "_c10d_functional::all_to_all_single": ("all_to_all", 0),
    "_c10d_functional_autograd::all_to_all_single": ("all_to_all", 0),
    "c10d::send": ("send", 0),
    "c10d::recv_": ("recv", 0),
}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def _group_name(args, known: dict) -> str | None:
    """The process group of a collective's arguments (a boxed c10d ProcessGroup, or a group name among
    ``known``), by name."""
    for a in args:
        if isinstance(a, dist.ProcessGroup):
            return a.group_name
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).group_name
            except Exception:  # another script object
                continue
        if isinstance(a, str) and a in known:  # other strings are reduce-op names such as "sum"
            return a
    return None


def _flop_formulas() -> dict:
    from torch.utils.flop_counter import (
        flop_registry,
        sdpa_backward_flop_count,
        sdpa_flop_count,
    )

    def cpu_sdpa(q, k, v, *args, out_val=None, **kwargs):
        return sdpa_flop_count(q.shape, k.shape, v.shape)

    def cpu_sdpa_backward(grad_out, q, k, v, *args, out_val=None, **kwargs):
        return sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)

    def grouped_mm(a, b, *args, out_val=None, **kwargs):
        # Each row block of a meets one group of b: 2 x a's elements x b's output width; a 3-D a (one block
        # per group) with a 2-D b grouped along its columns: each block meets its own columns only.
        if a.dim() == 3 and b.dim() == 2:
            return 2 * a.shape[1] * a.shape[2] * b.shape[-1]
        return 2 * a.numel() * b.shape[-1]

    forward, backward = torch_compat.cpu_flash_attention_ops()
    formulas = dict(flop_registry)
    formulas[forward] = cpu_sdpa
    formulas[backward] = cpu_sdpa_backward
    op = torch_compat.grouped_mm_op()
    if op is not None:  # the MoE experts' kernel: torch's table has no formula for it
        formulas.setdefault(op, grouped_mm)
    return formulas


class Phase:
    """The step's current phase (forward, backward, optimizer), shared by the tracker and the counter."""

    def __init__(self):
        self.name = "setup"

    @contextlib.contextmanager
    def __call__(self, name: str):
        previous, self.name = self.name, name
        try:
            yield
        finally:
            self.name = previous


class StepCounter(torch_compat.dispatch_mode_base()):
    """FLOPs and collectives of the ops this rank runs on its local tensors (DTensor ops are let through
    to be counted once they are unwrapped into local ones). ``groups`` maps a process group's name to its
    label (the mesh dimension) and size."""

    def __init__(self, phase: Phase, groups: dict[str, tuple[str, int]]):
        super().__init__()
        self.phase = phase
        self.groups = groups
        self.formulas = _flop_formulas()
        self.flops: dict[str, int] = defaultdict(int)
        # (phase, kind, group label, group size) -> [count, bytes]
        self.collectives: dict[tuple[str, str, str, int], list[int]] = defaultdict(lambda: [0, 0])

    def record(self, kind: str, group: str, size: int, nbytes: int) -> None:
        row = self.collectives[(self.phase.name, kind, group, size)]
        row[0] += 1
        row[1] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor or issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func.overloadpacket)
        if formula is not None:
            self.flops[self.phase.name] += int(formula(*args, **kwargs, out_val=out))
        spec = COLLECTIVES.get(func.name().split(".")[0])
        if spec is not None:
            kind, where = spec
            label, size = self.groups.get(_group_name(args, self.groups), ("?", 0))
            self.record(kind, label, size, _nbytes(out if where == "out" else args[where]))
        return out


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------

# The trackers' reference types (FSDPMemTracker's and MemTracker's names) in trainer plan's terms.
BUCKETS = {
    "params": ("Sharded Param", "Parameter"),
    "grads": ("Sharded Grad", "Gradient"),
    "optimizer": ("OptState", "Optstate"),
    "weight_copies": ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"),
    "activations": ("Activation", "Temp", "Inputs"),
    "other": ("Buffer", "Other"),
}


def buckets(snapshot: dict) -> dict[str, int]:
    """A tracker snapshot (one device) as bytes per bucket, plus ``total``."""
    by_name = {str(getattr(k, "value", k)): v for k, v in snapshot.items()}
    out = {b: sum(by_name.get(n, 0) for n in names) for b, names in BUCKETS.items()}
    out["total"] = by_name.get("Total", sum(out.values()))
    return out


def make_tracker(view: RankView, phase: Phase):
    """FSDPMemTracker for an FSDP model part, MemTracker otherwise; both also keep each phase's peak."""
    from torch.distributed.fsdp import FSDPModule

    part = view.parts[0]
    return torch_compat.phase_memory_tracker(part if isinstance(part, FSDPModule) else None, view.parts,
                                             view.optimizer, lambda: phase.name)


def _current(tracker) -> dict[str, int]:
    snap = tracker.get_tracker_snapshot("current")
    return buckets(next(iter(snap.values()))) if snap else buckets({})


# --------------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # phase / "peak" / "after_*" -> buckets
    peak_by_type: dict[str, int] = field(default_factory=dict)  # the tracker's own categories at the peak
    flops: dict[str, int] = field(default_factory=dict)
    collectives: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def _parallel_loss(view: RankView, config) -> bool:
    return steps.uses_loss_parallel(view.dims.tp, config.parallelism.disable_loss_parallel)


def _autocast(view: RankView):
    return steps.autocast_context(SIM_DEVICE, view.compute_dtype, view.dims.fsdp_enabled)


def prime_optimizer(view: RankView) -> None:
    """Create the optimizer state (steady state) with one untracked step on zero gradients."""
    for part in view.parts:
        for p in part.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    view.optimizer.step()
    view.optimizer.zero_grad(set_to_none=True)


def _step_plain(view: RankView, config, batch, measured: Measured) -> None:
    """The trainer's ``forward_backward`` for one micro-batch without pipelining, its ranges the phases."""
    inputs, labels = batch
    steps.forward_backward(view.parts[0], [{"input": inputs, "labels": labels}], device=SIM_DEVICE,
                           autocast=_autocast(view), parallel_loss=_parallel_loss(view, config),
                           loss_fn=steps.loss_fn, mark=measured.mark,
                           context_parallel=getattr(view.parts[0], "context_parallel", None))


def _step_pipeline(view: RankView, config, batch) -> None:
    """The trainer's ``forward_backward_pipeline`` with the rank's schedule (built in world.py by the trainer's
    pipeline code)."""
    inputs, labels = batch
    steps.forward_backward_pipeline(view.schedule, [{"input": inputs, "labels": labels}],
                                    pipeline_loss=view.pipeline_loss, device=SIM_DEVICE, autocast=_autocast(view),
                                    parallel_loss=_parallel_loss(view, config), has_first=view.first,
                                    has_last=view.last,
                                    context_parallel=getattr(view.parts[0], "context_parallel", None))


def _clip_and_step(view: RankView, config) -> None:
    """The trainer's ``clip_and_step``: global norm over all shards and stages, AdamW, zero_grad."""
    pp_group = view.mesh["pp"].get_group() if view.dims.pp > 1 else None
    steps.clip_and_step(view.parts, view.optimizer, max_norm=config.training.max_norm, pp_group=pp_group)


def fake_batch(config, args):
    b, s = config.training.local_batch_size, config.training.seq_len
    inputs = torch.randint(0, args.vocab_size, (b, s), device=SIM_DEVICE)
    labels = torch.randint(0, args.vocab_size, (b, s), device=SIM_DEVICE)
    return inputs, labels


class Measured:
    """The simulator's counters around one step of ``view``'s rank: the memory tracker (with each phase's
    peak), FLOPs and collectives. ``inputs`` are the step's batch tensors (counted as inputs); ``record(name)``
    keeps the memory at that moment; ``result()`` is what was measured. The same counters measure a real
    rank (tests/support/real_step.py).

    Phases: ``forward_backward``'s ranges through ``mark`` (its ``mark`` argument; the loss counts as
    forward, the loss total it keeps as backward, where it adds no peak); with pipelining the stage's
    ``forward_one_chunk``, ``backward_one_chunk`` and ``perform_reduce_grad`` (the loss the schedule computes
    after a forward counts as forward); ``phase("optimizer")`` around the optimizer step."""

    def __init__(self, view: RankView, inputs, phase: Phase | None = None):
        self.phase = phase or Phase()
        self.tracker = make_tracker(view, self.phase)
        self.counter = StepCounter(self.phase, group_labels(view))
        if hasattr(self.tracker, "track_inputs"):  # FSDPMemTracker
            self.tracker.track_inputs(inputs)
        self.memory: dict[str, dict[str, int]] = {}
        self._stack = contextlib.ExitStack()
        self._part, self._stage = view.parts[0], view.stage
        self._forwards = 0

    def _before_forward(self, module, args) -> None:
        # FSDPMemTracker keeps per-module statistics for one forward at a time; a pipeline stage runs one
        # forward per micro-batch. (A global hook registered before the tracker's runs before it.)
        if module is self._part:
            if self._forwards:
                self.tracker.reset_mod_stats()
            self._forwards += 1

    def mark(self, name: str):
        """A phase for one of ``forward_backward``'s ranges."""
        return self.phase("forward" if name == "loss" else name)

    def _mark_stage(self, stage) -> None:
        def marked(method, name: str):
            def run(*args, **kwargs):
                self.phase.name = name
                return method(*args, **kwargs)
            return run

        names = {"forward_one_chunk": "forward", "backward_one_chunk": "backward",
                 "perform_reduce_grad": "backward"}
        for method, name in names.items():
            setattr(stage, method, marked(getattr(stage, method), name))
            self._stack.callback(delattr, stage, method)  # the class's method again

    def __enter__(self) -> Measured:
        hook = torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)
        self._stack.callback(hook.remove)
        if self._stage is not None:
            self._mark_stage(self._stage)
        # Outside the marked ranges: forward_backward's loss total (backward), the schedule's first receive
        # (forward).
        self._stack.enter_context(self.phase("forward" if self._stage is not None else "backward"))
        self._stack.enter_context(self.tracker)
        self._stack.enter_context(self.counter)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)

    def record(self, name: str) -> None:
        self.memory[name] = _current(self.tracker)

    def result(self) -> StepResult:
        peak = self.tracker.get_tracker_snapshot("peak")
        peak = next(iter(peak.values())) if peak else {}
        memory = dict(self.memory, peak=buckets(peak))
        for name, snap in self.tracker.phase_peaks.items():
            memory[f"peak_{name}"] = buckets(snap)
        return StepResult(
            memory=memory, peak_by_type={str(getattr(k, "value", k)): v for k, v in peak.items() if v},
            flops=dict(self.counter.flops),
            collectives=[{"phase": ph, "kind": kind, "group": group, "group_size": size, "count": c, "bytes": b}
                         for (ph, kind, group, size), (c, b) in sorted(self.counter.collectives.items())])


def run_step(view: RankView, config, args, layout: Layout, mode,
             on_block: Callable[[str], None] | None = None,
             on_phase: Callable[[str], None] | None = None) -> StepResult:
    """One tracked steady-state step of ``view``'s rank (one micro-batch, or one local batch of
    micro-batches through a pipeline stage). ``on_block(phase)`` is called as each transformer block's
    forward starts and as its backward starts, ``on_phase(name)`` as the step enters another phase
    (progress)."""
    phase = Phase()
    handles = _progress_hooks(view, phase, on_block) if on_block else []
    with mode:
        batch = fake_batch(config, args)
        if on_phase:
            on_phase("setup")
        prime_optimizer(view)
        measured = Measured(view, batch, phase)
        t0 = time.perf_counter()
        with measured:
            if view.dims.pp == 1:
                _step_plain(view, config, batch, measured)
            else:
                _step_pipeline(view, config, batch)
            measured.record("after_backward")
            with phase("optimizer"):
                if on_phase:
                    on_phase("optimizer")
                _clip_and_step(view, config)
            measured.record("after_step")
        seconds = time.perf_counter() - t0
    for h in handles:
        h.remove()
    result = measured.result()
    result.seconds = seconds
    return result


def _progress_hooks(view: RankView, phase: Phase, on_block: Callable[[str], None]) -> list:
    """Forward pre-hooks on the blocks; each registers a gradient hook on its output for the backward."""
    handles = []

    def pre_hook(module, args):
        if phase.name == "forward":
            on_block("forward")

    def post_hook(module, args, output):
        if phase.name == "forward" and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: on_block("backward"))

    for part in view.parts:
        for block in part.layers.values():
            handles.append(block.register_forward_pre_hook(pre_hook))
            handles.append(block.register_forward_hook(post_hook))
    return handles

