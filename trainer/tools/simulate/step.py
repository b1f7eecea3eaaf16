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
  Pipeline sends and receives are counted where the step driver makes them (see ``_step_pipeline``).

The step is the trainer's own (trainer/step.py: ``forward_backward``, ``clip_and_step``) for one
micro-batch, in steady state: the optimizer state exists before the step (created by an untracked step with
zero gradients), as it does from the second step of a run on. With pipelining, the rank's stage runs the
micro-batches in the order of torch's ``Schedule1F1B`` or ``ScheduleGPipe``, with the trainer's
``PipelineLoss`` on the last stage, and hands FSDP its gradients the way ``PipelineStage`` does (no
reduction until the last micro-batch's backward, then one reduce-scatter); the real schedule object is not
used because its metadata handshake needs real peers.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer import step as steps
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


def _nbytes(obj) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(obj) if isinstance(t, torch.Tensor))


def _process_group(args):
    """The process group of a collective's arguments: a boxed c10d ProcessGroup or a group name."""
    from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group

    for a in args:
        if isinstance(a, ProcessGroup):
            return a
        if isinstance(a, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(a)
            except Exception:  # another script object
                continue
        if isinstance(a, str):
            try:
                return _resolve_process_group(a)
            except Exception:  # a reduce-op name such as "sum"
                continue
    return None


def _flop_formulas() -> dict:
    from torch.utils.flop_counter import (
        flop_registry,
        sdpa_backward_flop_count,
        sdpa_flop_count,
    )

    aten = torch.ops.aten

    def cpu_sdpa(q, k, v, *args, out_val=None, **kwargs):
        return sdpa_flop_count(q.shape, k.shape, v.shape)

    def cpu_sdpa_backward(grad_out, q, k, v, *args, out_val=None, **kwargs):
        return sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)

    formulas = dict(flop_registry)
    formulas[aten._scaled_dot_product_flash_attention_for_cpu] = cpu_sdpa
    formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward] = cpu_sdpa_backward
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


class StepCounter(TorchDispatchMode):
    """FLOPs and collectives of the ops this rank runs on its local tensors (DTensor ops are let through
    to be counted once they are unwrapped into local ones)."""

    def __init__(self, phase: Phase, labels: dict[str, str]):
        super().__init__()
        self.phase = phase
        self.labels = labels
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
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.flops[self.phase.name] += int(formula(*args, **kwargs, out_val=out))
        spec = COLLECTIVES.get(func._schema.name)
        if spec is not None:
            kind, where = spec
            pg = _process_group(args)
            name = pg.group_name if pg is not None else "?"
            size = pg.size() if pg is not None else 0
            self.record(kind, self.labels.get(name, f"group of {size}"), size,
                        _nbytes(out if where == "out" else args[where]))
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
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    class PhasePeaks:
        # Replaces MemTracker._update_peak_stats, which after every op also walks every module's statistics
        # (a cost that grows with the square of the depth); only the overall and per-phase peaks are kept.
        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                total = snap["Total"]
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = dict(snap)
                best = self.phase_peaks.get(phase.name)
                if best is None or total > best["Total"]:
                    self.phase_peaks[phase.name] = dict(snap)

    part = view.parts[0]
    if isinstance(part, FSDPModule):
        tracker = type("SimFSDPMemTracker", (PhasePeaks, FSDPMemTracker), {})(part, view.optimizer)
    else:
        tracker = type("SimMemTracker", (PhasePeaks, MemTracker), {})()
        tracker.track_external(*view.parts, view.optimizer)
    tracker.phase_peaks = {}
    return tracker


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


def _step_plain(view: RankView, config, batch, phase: Phase) -> None:
    """The trainer's ``forward_backward`` for one micro-batch without pipelining. Its ranges are the phases,
    the loss counting as forward; the loss total it keeps (two scalars, before the forward and after the
    backward) counts as backward, where it adds no peak."""
    inputs, labels = batch
    with phase("backward"):
        steps.forward_backward(view.parts[0], [{"input": inputs, "labels": labels}], device=SIM_DEVICE,
                               autocast=_autocast(view), parallel_loss=_parallel_loss(view, config),
                               loss_fn=steps.loss_fn, mark=lambda name: phase("forward" if name == "loss" else name))


def schedule_order(schedule: str, stage: int, num_stages: int, n_micro: int) -> list[tuple[str, int]]:
    """The (F|B, micro-batch) order one stage runs: torch's ScheduleGPipe, or Schedule1F1B (warm-up of
    ``num_stages - stage`` forwards, then one backward and one forward in turn, then the remaining
    backwards)."""
    if schedule == "GPipe":
        return [("F", i) for i in range(n_micro)] + [("B", i) for i in range(n_micro)]
    warmup = min(n_micro, num_stages - stage)
    order = [("F", i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while bwd < n_micro:
        order.append(("B", bwd))
        bwd += 1
        if fwd < n_micro:
            order.append(("F", fwd))
            fwd += 1
    return order


def _fsdp_reduce_grads(part) -> None:
    """What ``PipelineStage.perform_reduce_grad`` does after the last micro-batch: reduce-scatter every
    FSDP group's accumulated gradient once, then reshard."""
    from torch.distributed.fsdp import fully_shard

    part.set_is_last_backward(True)
    part.set_reshard_after_backward(True)
    part.set_requires_gradient_sync(True)
    state = fully_shard.state(part)
    for s in state._state_ctx.all_states:
        groups = getattr(s, "_fsdp_param_groups", None)  # older torch: one group per state
        for group in groups if groups is not None else [s._fsdp_param_group]:
            if group is not None:
                group.post_backward()
    state._root_post_backward_final_callback()


def _step_pipeline(view: RankView, config, layout: Layout, batch, phase: Phase, counter: StepCounter,
                   tracker) -> None:
    """One local batch through this rank's pipeline stage, micro-batch by micro-batch, in the schedule's
    order. A stage that is not first receives fake activations of its input's shape; one that is not last
    receives a fake gradient of its output's shape. Sends and receives are counted as the schedule
    would make them (one tensor each way per micro-batch, on the pp group)."""
    from torch.distributed.fsdp import FSDPModule

    part = view.parts[0]
    stage = view.stage_ids[0]
    inputs, labels = batch
    mb, n_micro = config.parallelism.pipeline_parallel_microbatch_size, layout.microbatches
    seq = inputs.shape[1] // (max(1, view.dims.tp))
    act_dtype = view.compute_dtype if view.dims.fsdp_enabled else torch.float32
    fsdp = isinstance(part, FSDPModule)
    pipeline_loss = steps.PipelineLoss(steps.loss_fn)
    pipeline_loss.tokens_per_rank = labels.numel()
    parallel_loss = _parallel_loss(view, config)
    pp_size = view.dims.pp
    live: dict[int, tuple] = {}
    for op, i in schedule_order(layout.schedule, stage, view.num_stages, n_micro):
        rows = slice(i * mb, (i + 1) * mb)
        if op == "F":
            if i > 0:  # FSDPMemTracker keeps per-module statistics for one forward at a time
                tracker.reset_mod_stats()
            with phase("forward"):
                if view.first:
                    x = inputs[rows]
                else:
                    x = torch.empty(mb, seq, part.args.dim, dtype=act_dtype, device=SIM_DEVICE).requires_grad_()
                    counter.record("recv", "pp", pp_size, _nbytes(x))
                with _autocast(view):
                    out = part(x)
                if view.last:
                    with steps.loss_parallel(parallel_loss):
                        out = pipeline_loss(out, labels[rows])
                else:
                    counter.record("send", "pp", pp_size, _nbytes(out))
            live[i] = (x, out)
            continue
        x, out = live.pop(i)
        if fsdp:  # PipelineStage.backward_maybe_with_nosync
            part.set_is_last_backward(False)
            part.set_reshard_after_backward(False)
            part.set_requires_gradient_sync(False)
        with phase("backward"):
            if view.last:
                with steps.loss_parallel(parallel_loss):
                    out.backward()
            else:
                grad = torch.empty_like(out)
                counter.record("recv", "pp", pp_size, _nbytes(grad))
                out.backward(grad)
            if not view.first:
                counter.record("send", "pp", pp_size, _nbytes(x))
        del x, out
    if fsdp:
        with phase("backward"):
            _fsdp_reduce_grads(part)


def _clip_and_step(view: RankView, config) -> None:
    """The trainer's ``clip_and_step``: global norm over all shards and stages, AdamW, zero_grad."""
    pp_group = view.mesh["pp"].get_group() if view.dims.pp > 1 else None
    steps.clip_and_step(view.parts, view.optimizer, max_norm=config.training.max_norm, pp_group=pp_group)


def fake_batch(config, args):
    b, s = config.training.local_batch_size, config.training.seq_len
    inputs = torch.randint(0, args.vocab_size, (b, s), device=SIM_DEVICE)
    labels = torch.randint(0, args.vocab_size, (b, s), device=SIM_DEVICE)
    return inputs, labels


def run_step(view: RankView, config, args, layout: Layout, mode,
             on_block: Callable[[str], None] | None = None,
             on_phase: Callable[[str], None] | None = None) -> StepResult:
    """One tracked steady-state step of ``view``'s rank (one micro-batch, or one local batch of
    micro-batches through a pipeline stage). ``on_block(phase)`` is called as each transformer block's
    forward starts and as its backward starts, ``on_phase(name)`` as the step enters another phase
    (progress)."""
    phase = Phase()
    result = StepResult()
    handles = _progress_hooks(view, phase, on_block) if on_block else []
    with mode:
        batch = fake_batch(config, args)
        if on_phase:
            on_phase("setup")
        prime_optimizer(view)
        tracker = make_tracker(view, phase)
        counter = StepCounter(phase, group_labels(view))
        if hasattr(tracker, "track_inputs"):  # FSDPMemTracker
            tracker.track_inputs(batch)
        t0 = time.perf_counter()
        with tracker, counter:
            if view.dims.pp == 1:
                _step_plain(view, config, batch, phase)
            else:
                _step_pipeline(view, config, layout, batch, phase, counter, tracker)
            result.memory["after_backward"] = _current(tracker)
            with phase("optimizer"):
                if on_phase:
                    on_phase("optimizer")
                _clip_and_step(view, config)
            result.memory["after_step"] = _current(tracker)
        result.seconds = time.perf_counter() - t0
    for h in handles:
        h.remove()
    peak = tracker.get_tracker_snapshot("peak")
    peak = next(iter(peak.values())) if peak else {}
    result.memory["peak"] = buckets(peak)
    result.peak_by_type = {str(getattr(k, "value", k)): v for k, v in peak.items() if v}
    for name, snap in tracker.phase_peaks.items():
        result.memory[f"peak_{name}"] = buckets(snap)
    result.flops = dict(counter.flops)
    result.collectives = [
        {"phase": ph, "kind": kind, "group": group, "group_size": size, "count": c, "bytes": b}
        for (ph, kind, group, size), (c, b) in sorted(counter.collectives.items())
    ]
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

