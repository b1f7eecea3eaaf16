"""The replica groups of a job, as the training loop sees them.

:class:`SingleGroup` is a job without ``[fault_tolerance]``: every hook is a no-op and torchft is never
imported. :class:`TorchFTReplicas` is one replica group of a fault-tolerant job, backed by torchft's
``Manager``: each step starts with a quorum (through the lighthouse) that says which groups take part, a
group that is behind (restarted) takes the weights, optimizer state and counters of a live group before its
forward pass, the gradients (and the step's loss) are averaged over the taking-part groups through torchft's
reconfigurable process group, and the optimizer steps only if every group's step succeeded
(``should_commit``); otherwise the step is repeated with the groups that are left.

The quorum is synchronous (torchft's ``use_async_quorum=False``): a recovering group is whole before it
computes, so it takes part in the step it joins, and every group holds bitwise-identical weights after each
committed step (the same averaged gradients, the same optimizer step).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer import torch_compat
from trainer.data.loader import merge_states
from trainer.errors import ConfigError, TrainerError
from trainer.fault_tolerance import lighthouse_status
from trainer.fault_tolerance.config import INSTALL_HINT, LIGHTHOUSE_ENV, FaultTolerance
from trainer.fault_tolerance.lighthouse_status import QuorumLost, StatusReader

logger = logging.getLogger("trainer")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP/TP), or the tensor itself."""
    return t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t


def _agreed(decide) -> None:
    """Run ``decide`` (which raises a TrainerError or returns) on this group's rank 0 only and raise its
    error on every rank of the group, so that the whole group stops with the same line."""
    error = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            decide()
        except TrainerError as e:
            error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise error


def check_lighthouse(cfg: FaultTolerance) -> StatusReader | None:
    """Before a replica group writes anything: its lighthouse answers (else exit 7 naming
    TORCHFT_LIGHTHOUSE) and no live group of the job has its replica_id (else exit 2). Every rank of the
    group calls it; the reader is rank 0's (None on the others)."""
    if not cfg.enable:
        return None
    reader = StatusReader(os.environ[LIGHTHOUSE_ENV], cfg.connect_timeout_ms / 1000)
    _agreed(lambda: lighthouse_status.check_id_free(reader, cfg.replica_id, own=0))
    return reader if not dist.is_initialized() or dist.get_rank() == 0 else None


class _TorchFTLines(logging.Filter):
    """torchft's Manager logs a fault it survives (a group that died mid-step) with a traceback on stderr
    (Python's last-resort handler), which reads as a bug: its line, which names the exception, goes to
    this group's console instead, without the traceback; the group says what follows (the step not
    committed, the groups left). Without CUDA, its warning at every new quorum that NCCL's flight recorder
    cannot be reset is dropped: there is none."""

    def __init__(self, cuda: bool):
        super().__init__()
        self.cuda = cuda

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.cuda or "Unable to reset NCCL flight recorder" not in message:
            logger.log(record.levelno, "torchft: %s", message.splitlines()[0] if message else message)
        return False


class SingleGroup:
    """A job that is one replica group: nothing to agree on with anyone."""

    groups_taking_part = 1
    committed = True

    def start_step(self, step: int) -> int:
        return step

    def average(self, model_parts: list, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def commit(self, skip):
        return skip

    def metrics(self) -> dict:
        return {}

    def quorum_lost(self, error: Exception, during: str) -> None:
        return None

    def summary(self) -> dict:
        return {}

    def finish(self, model_parts: list) -> None:
        pass

    def close(self) -> None:
        pass


class TorchFTReplicas:
    """One replica group of a fault-tolerant job (see the module's docstring)."""

    def __init__(self, cfg: FaultTolerance, device: torch.device, *, model_parts: list, optimizer, state,
                 callbacks, dp: int, group_rank: int, group_world_size: int, lighthouse: StatusReader | None = None):
        # torchft's own components log every quorum and commit at INFO; RUST_LOG=info shows them again.
        os.environ.setdefault("RUST_LOG", "warn")
        try:
            import torchft
        except ImportError as e:
            raise ConfigError(f"fault_tolerance.enable needs torchft ({e}): {INSTALL_HINT}") from None
        if cfg.process_group == "nccl" and device.type != "cuda":
            raise ConfigError("fault_tolerance.process_group = \"nccl\" needs CUDA devices; this run is on "
                              f"{device.type}: use \"gloo\"")
        self.cfg, self.device = cfg, device
        self.model_parts, self.optimizer, self.state, self.callbacks = model_parts, optimizer, state, callbacks
        self.params = [(name, p) for part in model_parts for name, p in part.named_parameters()]
        timeout = timedelta(milliseconds=cfg.process_group_timeout_ms)
        torch_compat.quiet_torchft_sequence_numbers()
        pg = (torchft.ProcessGroupGloo(timeout=timeout) if cfg.process_group == "gloo"
              else torchft.ProcessGroupNCCL(timeout=timeout))
        self.address = os.environ[LIGHTHOUSE_ENV]
        self._quiet = _TorchFTLines(cuda=device.type == "cuda")
        logging.getLogger("torchft.manager").addFilter(self._quiet)
        manager_timeout = max(timeout, timedelta(seconds=60))
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=cfg.min_replica_size,
            use_async_quorum=False, replica_id=f"replica_{cfg.replica_id}", rank=group_rank,
            world_size=group_world_size, timeout=manager_timeout,
            checkpoint_transport=torch_compat.quiet_torchft_transport(manager_timeout),
            quorum_timeout=timedelta(milliseconds=cfg.quorum_timeout_ms),
            connect_timeout=timedelta(milliseconds=cfg.connect_timeout_ms))
        self.lost = False  # no quorum can form any more: the last quorum's rank decides who saves
        self._last_rank: int | None = None
        reader = lighthouse or StatusReader(self.address, cfg.connect_timeout_ms / 1000)
        # Now that this group's Manager is listed: a group with the same id started at the same moment, and
        # the other groups of the job, so that groups launched together take step 1 together.
        _agreed(lambda: lighthouse_status.check_id_free(reader, cfg.replica_id, own=1))
        _agreed(lambda: self._wait_for_groups(reader))
        self.manager.register_state_dict_fn("trainer", self._load_state_dict, self._state_dict)
        # Resumed from this group's own checkpoint: the job's step count goes on from there.
        self.semi_sync = cfg.semi_sync_method.lower() if cfg.semi_sync_method else None
        if self.semi_sync is None:
            self.manager.load_state_dict({"step": state.step, "batches_committed": 0})
        self._groups = 1
        self._pending_train: dict | None = None  # semi-sync: a live group's counters, taken at the next step
        self.faults_survived = 0
        self.uncommitted_steps = 0
        self.steps_short = 0  # steps taken with fewer groups than group_size
        self.recoveries: list[dict] = []  # each time this group took a live group's state
        self.weights_sha256: str | None = None
        self._previous_groups: int | None = None
        self._committed = True
        # Semi-synchronous: torchft's LocalSGD / DiLoCo hook the optimizer (a quorum and a synchronisation
        # every sync_steps steps); the step itself then needs nothing from the other groups.
        self.sync_every = None
        if self.semi_sync is not None:
            self.sync_every = build_semi_sync(self.semi_sync, cfg, self.manager, model_parts[0], optimizer, device)
            self.sync_every.__enter__()

    def quorum_lost(self, error: Exception, during: str) -> QuorumLost | None:
        """The one line for ``error`` if no quorum can form: the lighthouse no longer answers, or it does but
        torchft's quorum request timed out (the other groups did not come); None: ``error`` is something
        else."""
        why = lighthouse_status.reachable(self.address, self.cfg.connect_timeout_ms / 1000)
        if why is None:
            # torchft raises the quorum's timeout as a TimeoutError (its Rust client's "Timeout expired")
            if isinstance(error, TimeoutError) or "Timeout expired" in str(error):
                return lighthouse_status.no_quorum(self.address, self.cfg.quorum_timeout_ms, during,
                                                   self.cfg.connect_timeout_ms / 1000)
            return None
        return lighthouse_status.unreachable(self.address, why, during=f"{during} (after fault_tolerance."
                                             f"quorum_timeout_ms = {self.cfg.quorum_timeout_ms}: {type(error).__name__})")

    def _wait_for_groups(self, reader: StatusReader) -> None:
        if self.cfg.join_timeout_ms == 0 or self.cfg.group_size == 1:
            return
        t0 = time.monotonic()
        logger.info("fault tolerance: waiting up to %.1f s (fault_tolerance.join_timeout_ms) for the job's %d replica "
                    "groups to be up at the lighthouse", self.cfg.join_timeout_ms / 1000, self.cfg.group_size)
        missing = lighthouse_status.wait_for_groups(reader, self.cfg.group_size, self.cfg.join_timeout_ms / 1000)
        waited = time.monotonic() - t0
        if missing:
            logger.warning("fault tolerance: replica group(s) %s not up after %.1f s (fault_tolerance.join_timeout_ms):"
                           " starting with the groups that are; the others take the live groups' state when they "
                           "join", ", ".join(map(str, missing)), waited)
        else:
            logger.info("fault tolerance: all %d replica groups are up at the lighthouse (waited %.1f s)",
                        self.cfg.group_size, waited)

    @property
    def committed(self) -> bool:
        """Whether the last step was applied (a step some group failed is repeated, not skipped)."""
        return self._committed

    @property
    def groups_taking_part(self) -> int:
        """Groups in this step's quorum (semi-synchronous: in the last synchronisation's)."""
        if self.semi_sync is not None:
            # Before the first synchronisation there was no quorum: every group is counted as training.
            return self.manager.num_participants() or self.cfg.group_size
        return self._groups

    # The step ---------------------------------------------------------------------------------------

    def start_step(self, step: int) -> int:
        """The quorum for the next step; returns its number (after a recovery, the live groups' next step)."""
        if self.semi_sync is not None:
            if self._pending_train is not None:  # took a live group's state in the last step's synchronisation
                before = self.state.step
                self.state.load_state_dict(self._pending_train)
                self._pending_train = None
                if self.state.step != before:
                    self.recoveries.append({"step": self.state.step + 1, "from_step": before, "seconds": 0.0})
                    logger.warning("fault tolerance: took a live replica group's weights at its step %d (this "
                                   "group was at step %d)", self.state.step, before)
                return self.state.step + 1
            return step
        before = self.manager.current_step()
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                # torchft's recovery builds the received tensors on a read-only buffer; _load_state_dict
                # copies them into this group's own parameters and optimizer state, never writing to them.
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                self.manager.start_quorum()  # synchronous: a group that is behind is whole when this returns
        except Exception as e:
            lost = self.quorum_lost(e, f"for the quorum of step {before + 1}")
            if lost is None:
                raise
            self.lost = True
            raise lost from None
        self._last_rank = self.manager.participating_rank()
        groups = self.manager.num_participants()
        now = self.manager.current_step()
        if now != before:
            took = round(time.perf_counter() - t0, 3)
            self.recoveries.append({"step": now + 1, "from_step": before, "seconds": took})
            logger.warning("fault tolerance: recovered from a live replica group: this group had finished step %d, "
                           "the live groups step %d; it joins at step %d (%.2f s), its steps %d..%d were trained "
                           "without this group", before, now, now + 1, took, before + 1, now)
        if self._previous_groups is not None and groups < self._previous_groups:
            self.faults_survived += 1
            logger.warning("fault tolerance: %d of %d replica groups take part in step %d (%d left)", groups,
                           self.cfg.group_size, now + 1, self._previous_groups - groups)
        if groups < self.cfg.group_size:
            self.steps_short += 1
        self._previous_groups = self._groups = groups
        return now + 1

    @torch.no_grad()
    def average(self, model_parts: list, loss: torch.Tensor) -> torch.Tensor:
        """Average this rank's gradient shards and the step's loss over the groups taking part (one
        all-reduce per dtype: every group's rank r holds the same shards); returns the averaged loss.
        Semi-synchronous: nothing (each group steps on its own gradients; its loss is its own)."""
        if self.semi_sync is not None:
            return loss
        grads = [_local(p.grad) for _, p in self.params if p.grad is not None]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        loss_dtype = next(iter(by_dtype), loss.dtype)
        by_dtype.setdefault(loss_dtype, [])
        works = []
        for dtype, tensors in by_dtype.items():
            pieces = [t.reshape(-1) for t in tensors] + ([loss.reshape(1).to(dtype)] if dtype == loss_dtype else [])
            flat = torch.cat(pieces)
            works.append((self.manager.allreduce(flat), flat, tensors))
        averaged = loss
        for work, flat, tensors in works:
            work.wait()
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            if offset < flat.numel():
                averaged = flat[offset].to(loss.dtype)
        return averaged if self.manager.errored() is None else loss

    def commit(self, skip):
        """Combine a skip verdict with torchft's: a step some group failed is not taken by anyone."""
        if self.semi_sync is not None:
            return skip
        self._committed = self.manager.should_commit()
        if not self._committed:
            self.uncommitted_steps += 1
            logger.warning("fault tolerance: step %d not committed (a replica group failed during it); it is "
                           "repeated with the groups that are left", self.manager.current_step() + 1)
            return torch.ones((), dtype=torch.bool, device=self.device)  # a verdict the optimizer applies
        return skip

    # Recovery: what a live group sends to one that is behind ------------------------------------------

    def _state_dict(self) -> dict:
        optim = {}
        for name, p in self.params:
            s = self.optimizer.state.get(p)
            if s:
                optim[name] = {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        train = self.state.state_dict()
        if self.semi_sync is not None:
            # Sent from inside the optimizer step of step + 1, which the receiver finishes too (its tokens_seen
            # then lacks that one step's tokens).
            train["step"] += 1
        return {"model": {name: _local(p.detach()) for name, p in self.params}, "optim": optim, "train": train,
                "callbacks": self.callbacks.state_dict()}

    @torch.no_grad()
    def _load_state_dict(self, sd: dict) -> None:
        for name, p in self.params:
            _local(p).copy_(sd["model"][name])
            theirs = sd["optim"].get(name)
            if theirs is None:
                self.optimizer.state.pop(p, None)
                continue
            mine = self.optimizer.state.setdefault(p, {})
            for k, v in theirs.items():
                if isinstance(v, torch.Tensor) and isinstance(mine.get(k), torch.Tensor):
                    _local(mine[k]).copy_(v)
                elif isinstance(v, torch.Tensor):
                    local = _local(p)
                    mine[k] = v.to(local.device) if k == "step" else v.to(local.device, local.dtype).clone()
                    if isinstance(p, torch.distributed.tensor.DTensor) and v.dim() > 0:
                        mine[k] = torch.distributed.tensor.DTensor.from_local(
                            mine[k], p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                else:
                    mine[k] = v
        if self.semi_sync is not None:  # inside the optimizer step: the loop takes the counters at the next one
            self._pending_train = sd["train"]
        else:
            self.state.load_state_dict(sd["train"])
        self.callbacks.load_state_dict(sd["callbacks"])

    def saves_job_checkpoint(self) -> bool:
        """Whether this group writes the job's checkpoint of the step just taken: the lowest group of the
        step's quorum (semi-synchronous, before the first synchronisation: group 0)."""
        rank = self._last_rank if self.lost else self.manager.participating_rank()
        return self.cfg.replica_id == 0 if rank is None else rank == 0

    # Records ---------------------------------------------------------------------------------------

    def metrics(self) -> dict:
        record = {"replica_groups": self.groups_taking_part, "committed": self._committed}
        if not self._committed:
            record["skip_reason"] = "not committed: a replica group failed during it; repeated"
        return record

    def summary(self) -> dict:
        return {"fault_tolerance": {
            "replica_id": self.cfg.replica_id, "group_size": self.cfg.group_size,
            "faults_survived": self.faults_survived, "uncommitted_steps": self.uncommitted_steps,
            "steps_with_fewer_groups": self.steps_short, "recoveries": self.recoveries,
            "steps_missed": sum(r["step"] - 1 - r["from_step"] for r in self.recoveries),
            "recovery_s": sum(r["seconds"] for r in self.recoveries),
        }, "weights_sha256": self.weights_sha256}

    def finish(self, model_parts: list) -> None:
        """The final weights' checksum (every rank; a collective inside the group): equal on every group
        that finished, since groups of one job have the same layout."""
        self.weights_sha256 = weights_checksum(model_parts)

    def close(self) -> None:
        if self.sync_every is not None:
            self.sync_every.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        logging.getLogger("torchft.manager").removeFilter(self._quiet)


def model_fragments(model, cfg: FaultTolerance) -> list:
    """DiLoCo's fragments: the modules named in module_fqns_per_model_fragment, or num_fragments runs of
    consecutive layers (the embedding with the first, the final norm and output with the last)."""
    from torch import nn

    names = cfg.module_fqns_per_model_fragment
    if not names:
        layers = [f"layers.{k}" for k in model.layers.keys()]
        n = cfg.num_fragments
        bounds = [round(i * len(layers) / n) for i in range(n + 1)]
        names = [layers[bounds[i]:bounds[i + 1]] for i in range(n)]
        names[0] = ["tok_embeddings", *names[0]]
        names[-1] = [*names[-1], "norm", "output"]
    try:
        fragments = [nn.ModuleList([model.get_submodule(name) for name in fragment]) for fragment in names]
    except AttributeError as e:
        raise ConfigError(f"fault_tolerance.module_fqns_per_model_fragment: {e}") from None
    covered = {id(p) for f in fragments for p in f.parameters()}
    left = [name for name, p in model.named_parameters() if id(p) not in covered]
    if left:
        raise ConfigError(f"fault_tolerance.module_fqns_per_model_fragment leaves out {', '.join(left[:4])}"
                          f"{' ...' if len(left) > 4 else ''}: DiLoCo would never synchronise them; name every module")
    return fragments


def outer_optimizers(fragments: list, cfg: FaultTolerance) -> list[torch.optim.SGD]:
    """DiLoCo's outer optimizer of each fragment: SGD with outer_lr and outer_momentum (Nesterov when > 0)."""
    return [torch.optim.SGD([p for p in f.parameters() if p.requires_grad], lr=cfg.outer_lr,
                            momentum=cfg.outer_momentum, nesterov=cfg.outer_momentum > 0) for f in fragments]


def diloco_line(cfg: FaultTolerance, outer: list[torch.optim.SGD]) -> str:
    """What a DiLoCo run logs once at start: its fragments (one outer optimizer each), how often they
    synchronise, and the outer optimizer's settings as built (the default overshoots on short runs:
    docs/multinode.md)."""
    group = outer[0].param_groups[0]
    lr, momentum = group["lr"], group["momentum"]
    if (lr, momentum) == (FaultTolerance.outer_lr, FaultTolerance.outer_momentum):
        origin = ("the default, torchtitan's and the DiLoCo paper's, tuned for hundreds of steps per "
                  "synchronisation; for short runs see docs/multinode.md (fault_tolerance.outer_lr, outer_momentum)")
    else:
        origin = "fault_tolerance.outer_lr, outer_momentum"
    return (f"fault tolerance: DiLoCo, {len(outer)} fragment(s), one synchronised every "
            f"{cfg.sync_steps // len(outer)} step(s); outer optimizer SGD lr {lr:g}, momentum {momentum:g}"
            f"{', Nesterov' if group['nesterov'] else ''} ({origin})")


def build_semi_sync(method: str, cfg: FaultTolerance, manager, model, optimizer, device: torch.device):
    """torchft's LocalSGD (parameters averaged every sync_steps steps) or DiLoCo (an outer SGD on the averaged
    pseudo-gradients of each fragment; by default Nesterov, lr 0.7 and momentum 0.9, as in the DiLoCo paper)."""
    from torchft import local_sgd

    if method == "local_sgd":
        return local_sgd.LocalSGD(manager=manager, model=model, optimizer=optimizer, sync_every=cfg.sync_steps)
    fragments = model_fragments(model, cfg)
    outer = outer_optimizers(fragments, cfg)
    logger.info(diloco_line(cfg, outer))
    return local_sgd.DiLoCo(manager=manager, model_fragments=fragments, inner_optimizer=optimizer,
                            outer_optimizer=outer, sync_every=cfg.sync_steps, pin_memory=device.type == "cuda",
                            should_quantize=cfg.should_quantize, fragment_sync_delay=cfg.fragment_sync_delay,
                            fragment_update_alpha=cfg.fragment_update_alpha)


def weights_checksum(model_parts: list) -> str:
    """sha256 over every rank's shards (by name), combined over the ranks of this process group in order."""
    h = hashlib.sha256()
    for part in model_parts:
        for name, p in sorted(part.named_parameters(), key=lambda x: x[0]):
            h.update(name.encode())
            h.update(_local(p.detach()).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    mine = h.hexdigest()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return hashlib.sha256("".join(every).encode()).hexdigest()


class GroupLoaderState:
    """The training loader as a replica group's checkpoints see it: its state and restore are the loader's,
    its merge keeps the states of this group's ranks only (``ranks``: their ranks over the whole job), since
    each group saves its own part of the data stream."""

    def __init__(self, loader, ranks: list[int]):
        self.loader, self.ranks = loader, ranks

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def merge_states(self, states: list[dict]) -> dict:
        return merge_states(states, ranks=self.ranks)

    def load_global_state(self, state: dict) -> None:
        self.loader.load_global_state(state)


def checkpointed_loader(cfg: FaultTolerance, loader, dp: int):
    """What the checkpoint manager saves of the training loader: the loader itself, or for one replica group
    of a fault-tolerant job (``dp`` data-parallel ranks each) a :class:`GroupLoaderState`."""
    if not cfg.enable:
        return loader
    first = cfg.replica_id * dp
    return GroupLoaderState(loader, list(range(first, first + dp)))


def build_replicas(config, device: torch.device, **components) -> SingleGroup | TorchFTReplicas:
    """The job's replica groups: ``components`` are model_parts, optimizer, state, callbacks and dp (the
    data-parallel ranks of one group)."""
    if not config.fault_tolerance.enable:
        return SingleGroup()
    return TorchFTReplicas(config.fault_tolerance, device, group_rank=int(os.environ.get("RANK", 0)),
                           group_world_size=int(os.environ.get("WORLD_SIZE", 1)), **components)
