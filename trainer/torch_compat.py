"""The torch private APIs the trainer needs, each behind one function that says why no public API does it and
which torch versions were checked. Nothing else imports a private torch name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

# simulate
#
# trainer simulate runs one rank of a big world in one process: torch's fake process group and fake tensors,
# its memory trackers, and a dispatch mode that counts FLOPs and collectives. torch publishes none of these.
# Checked on torch 2.13.0.


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
