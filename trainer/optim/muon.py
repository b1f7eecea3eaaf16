"""Muon for the transformer blocks' weight matrices and AdamW for the rest, in one optimizer, on one process
or sharded (FSDP2, HSDP, TP, FSDP x TP, pipeline stages).

The math is torch.optim.Muon's, step for step: the momentum ``buf.lerp_(grad, 1 - momentum)``, Nesterov's
``grad.lerp(buf, momentum)``, the quintic Newton-Schulz iteration on the whole matrix (in bfloat16 as torch
does, or float32 with ``optimizer.muon.ns_dtype``), decoupled weight decay and the shape-adjusted learning
rate. AdamW's part is torch's AdamW itself, sharing this optimizer's parameter groups and state (one state
dict, one checkpoint entry).

Sharded matrices. The momentum and the Nesterov update are element-wise: every rank computes them on its own
shard (the momentum buffer stays sharded like the parameter, one buffer per matrix). Newton-Schulz needs the
whole matrix, so the matrices of each shard group (the ranks that hold different pieces of them: dp_shard,
tp, or both; HSDP's replicas hold the same pieces and are not part of it) are dealt round-robin to its ranks,
and one step exchanges them in two batched all-to-alls over the group: every rank sends each owner its shards
of that owner's matrices (in the Newton-Schulz dtype: the iteration's first act is that cast), the owner
assembles and orthogonalises them, and sends every rank its shards of the results. A rank therefore receives
about 1/n of the matrices in full, never all of them; the other ranks never orthogonalise a matrix they do
not own. HSDP's replicas each orthogonalise their own copy (the gradients are already all-reduced, so the
results are the same): sparing that compute would cost a broadcast of every update across the replicas,
over the slow links, which is dearer.

Where each rank's shard sits in the matrix (which rows and columns, in which order, whatever the
placements: Shard, FSDP's strided shards over TP) is read once, at the first step, from the DTensor API
itself (``distribute_tensor`` of index tensors without communication), and the owners learn the other
ranks' layouts in one exchange.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from trainer import torch_compat

if TYPE_CHECKING:
    from trainer.optim.config import Muon as MuonConfig

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon updates this parameter: a 2-D weight inside a transformer block (attention and feed-forward
    projections). Embedding, output layer, norms and biases are AdamW's."""
    return name.startswith("layers.") and param.ndim == 2


def orthogonalise(update: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon on one whole matrix, in ``dtype`` (bfloat16:
    torch's arithmetic exactly). Returns a new tensor in ``dtype``."""
    a, b, c = coefficients
    x = update.to(dtype, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    """torch.optim.Muon's learning rate for a matrix of ``shape`` (rows, cols)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Bucket:
    """The Muon matrices of one shard group: the ranks, the owner of each matrix, and (on the owners) where
    every rank's shard of an owned matrix sits."""

    group: Any  # the process group; None: one rank holds whole matrices
    size: int
    rank: int
    params: list[torch.Tensor] = field(default_factory=list)
    owners: list[int] = field(default_factory=list)
    # matrix index -> per group rank (rows, cols): the global indices of that rank's shard, in its local order
    layouts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    numels: dict[int, list[int]] = field(default_factory=dict)  # matrix index -> shard numel per group rank
    slots: list[int] = field(default_factory=list)  # matrix index -> its place in the optimizer's Muon group


def _shard_indices(p: DTensor) -> tuple[list[int], list[int]]:
    """This rank's rows and columns of ``p`` in the order its local shard holds them, from DTensor's own
    placement rules (``distribute_tensor`` without a source rank: a local slice, no communication). Real
    tensors even in trainer simulate's fake world: the answer is static metadata."""
    rows_n, cols_n = p.shape
    device = p.device_mesh.device_type  # made there: moving an expanded view would materialise it
    with torch_compat.real_tensors():
        # Expanded views (no memory); the local slice is materialised, once, at the first step.
        rows_full = torch.arange(rows_n, dtype=torch.int32, device=device).unsqueeze(1).expand(rows_n, cols_n)
        cols_full = torch.arange(cols_n, dtype=torch.int32, device=device).unsqueeze(0).expand(rows_n, cols_n)
        rows = distribute_tensor(rows_full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        cols = distribute_tensor(cols_full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        if rows.numel() == 0:
            return [], []
        return rows[:, 0].tolist(), cols[0, :].tolist()


# Process-group name -> (the mesh dimensions it spans, joined by "+"; its size): for trainer simulate's report.
GROUP_LABELS: dict[str, tuple[str, int]] = {}


def _shard_group(p: DTensor, groups: dict[tuple[int, ...], Any]) -> tuple[Any, tuple[int, ...]]:
    """The process group of the ranks holding different pieces of ``p`` (its mesh without the dimensions it is
    replicated over), and their global ranks in group-rank order. A mesh dimension's own group where one
    dimension shards ``p``; else a group made once per optimizer (``groups``)."""
    mesh = p.device_mesh
    coordinate = mesh.get_coordinate()
    sharded = [i for i, placement in enumerate(p.placements) if not isinstance(placement, Replicate)]
    index = tuple(slice(None) if i in sharded else coordinate[i] for i in range(mesh.ndim))
    with torch_compat.real_tensors():  # the mesh's rank table (fake under trainer simulate's mode otherwise)
        members = tuple(sorted(int(r) for r in mesh.mesh[index].flatten().tolist()))
    if len(members) == 1:
        return None, members
    if len(sharded) == 1:
        return mesh.get_group(sharded[0]), members
    if members not in groups:  # only the members take part in making it
        group = dist.new_group(list(members), use_local_synchronization=True)
        groups[members] = group
        names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
        GROUP_LABELS[group.group_name] = ("+".join(names[i] for i in sharded), len(members))
    return groups[members], members


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer: Muon on ``muon_params`` (the first parameter group), torch's AdamW on ``adamw_groups``.

    ``step`` applies both; ``step_or_skip(verdict)`` skips the whole step (parameters, momentum, AdamW's
    moments and step counts untouched) when the 0-d bool ``verdict`` is true. Muon's exchange is a
    collective of each shard group, so the verdict is read on the host (it is the same on every rank).
    :attr:`base_lrs` holds each group's peak learning rate, which ``LRSchedule.apply`` scales by the
    schedule's factor. :attr:`orthogonalised` counts, per Muon matrix of this rank, the Newton-Schulz runs
    this rank did since the counts were last read (``muon_metrics``)."""

    def __init__(self, muon_params: list[torch.Tensor], adamw_groups: list[dict], *, cfg: MuonConfig, lr: float,
                 weight_decay: float, adamw_kwargs: dict):
        self._adamw = torch.optim.AdamW(adamw_groups, **adamw_kwargs)
        muon_group = {"params": list(muon_params), "muon": True, "lr": lr, "weight_decay": weight_decay,
                      "momentum": cfg.momentum, "nesterov": cfg.nesterov,
                      "ns_coefficients": tuple(cfg.ns_coefficients), "eps": cfg.eps, "ns_steps": cfg.ns_steps,
                      "adjust_lr_fn": cfg.adjust_lr_fn}
        super().__init__([muon_group, *self._adamw.param_groups], {})
        self.ns_dtype = NS_DTYPES[cfg.ns_dtype]
        self.base_lrs = [float(g["lr"]) for g in self.param_groups]
        self.orthogonalised = torch.zeros(len(muon_params), dtype=torch.int64)
        self._buckets: list[_Bucket] | None = None
        self._link()
        # A load replaces the state and the group dicts: AdamW must see the new ones.
        self.register_load_state_dict_post_hook(lambda opt: opt._after_load())

    def _link(self) -> None:
        self._adamw.param_groups = [g for g in self.param_groups if not g.get("muon")]
        self._adamw.state = self.state

    def _after_load(self) -> None:
        self._link()
        # torch's set_optimizer_state_dict first creates the state with a step at lr 0 on zero gradients: not a
        # training step, so not counted.
        self.orthogonalised.zero_()

    @property
    def skips_on_device(self) -> bool:
        """False: a skip verdict is read on the host (Muon's exchange cannot be made conditional on the device)."""
        return False

    def step_or_skip(self, skip: torch.Tensor | None) -> None:
        """``step()`` unless ``skip`` (a 0-d bool tensor, the same on every rank; None: never skip) is true."""
        if skip is None or not bool(skip):
            self.step()

    @torch.no_grad()
    def step(self, closure=None):
        """Muon on the matrices, then AdamW on the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("muon"):
                self._muon_step(group)
        self._adamw.step()
        return loss

    # Muon ------------------------------------------------------------------------------------------

    def _muon_step(self, group: dict) -> None:
        if self._buckets is None:
            self._buckets = self._plan(group["params"])
        momentum, nesterov = group["momentum"], group["nesterov"]
        updates: dict[int, torch.Tensor] = {}  # id(param) -> this rank's shard of the (Nesterov) momentum
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            updates[id(p)] = grad.lerp(buf, momentum) if nesterov else buf
        for bucket in self._buckets:
            params = [p for p in bucket.params if id(p) in updates]
            if len(params) != len(bucket.params):
                raise RuntimeError("Muon: a sharded matrix has no gradient on this rank; every rank of a shard "
                                   "group must step the same matrices")
            results = self._orthogonalise_bucket(bucket, [updates[id(p)] for p in params], group)
            for p, o in zip(params, results):
                local = _local(p)
                local.mul_(1 - group["lr"] * group["weight_decay"])
                local.add_(o, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], p.shape))

    def _ns(self, full: torch.Tensor, group: dict) -> torch.Tensor:
        return orthogonalise(full, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)

    def _orthogonalise_bucket(self, bucket: _Bucket, updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """Each matrix's orthogonalised update, as this rank's shard of it."""
        if bucket.group is None:  # whole matrices on this rank
            out = []
            for k, u in enumerate(updates):
                out.append(self._ns(u, group))
                self.orthogonalised[bucket.slots[k]] += 1
            return out
        n, me, dtype = bucket.size, bucket.rank, self.ns_dtype
        mine = [k for k, o in enumerate(bucket.owners) if o == me]
        # Gather: every rank sends each owner its shards of that owner's matrices.
        send = [torch.cat([updates[k].reshape(-1).to(dtype) for k, o in enumerate(bucket.owners) if o == r]
                          or [updates[0].new_empty(0, dtype=dtype)]) for r in range(n)]
        recv_sizes = [sum(bucket.numels[k][s] for k in mine) for s in range(n)]
        received = _all_to_all(send, recv_sizes, bucket.group, dtype, updates[0].device)
        offsets = [0] * n
        back: list[list[torch.Tensor]] = [[] for _ in range(n)]
        for k in mine:
            p = bucket.params[k]
            full = torch.empty(p.shape, dtype=dtype, device=updates[0].device)
            for s in range(n):
                rows, cols = bucket.layouts[k][s]
                size = bucket.numels[k][s]
                if size:
                    chunk = received[s][offsets[s]:offsets[s] + size].view(len(rows), len(cols))
                    full[rows.unsqueeze(1), cols.unsqueeze(0)] = chunk
                offsets[s] += size
            o = self._ns(full, group)
            self.orthogonalised[bucket.slots[k]] += 1
            for s in range(n):
                rows, cols = bucket.layouts[k][s]
                back[s].append(o.index_select(0, rows).index_select(1, cols).reshape(-1) if len(rows) and len(cols)
                               else o.new_empty(0))
        # Scatter: every owner sends each rank its shards of the results.
        send = [torch.cat(b) if b else updates[0].new_empty(0, dtype=dtype) for b in back]
        recv_sizes = [sum(_local(bucket.params[k]).numel() for k, o in enumerate(bucket.owners) if o == r)
                      for r in range(n)]
        received = _all_to_all(send, recv_sizes, bucket.group, dtype, updates[0].device)
        offsets = [0] * n
        out = []
        for k, u in enumerate(updates):
            r = bucket.owners[k]
            size = u.numel()
            out.append(received[r][offsets[r]:offsets[r] + size].view(u.shape))
            offsets[r] += size
        return out

    def _plan(self, params: list[torch.Tensor]) -> list[_Bucket]:
        """The shard groups of the Muon matrices, who owns each matrix (round-robin in parameter order within
        a group) and, on the owners, where each rank's shard of it sits."""
        buckets: dict[tuple[int, ...], _Bucket] = {}
        groups: dict[tuple[int, ...], Any] = {}
        me = dist.get_rank() if dist.is_initialized() else 0
        for i, p in enumerate(params):
            group, members = _shard_group(p, groups) if isinstance(p, DTensor) else (None, (me,))
            bucket = buckets.setdefault(members, _Bucket(group, len(members), members.index(me)))
            bucket.params.append(p)
            bucket.owners.append((len(bucket.params) - 1) % len(members))
            bucket.slots.append(i)
        for bucket in buckets.values():
            if bucket.group is None:
                continue
            layouts = [_shard_indices(p) for p in bucket.params]
            everyone: list[Any] = [None] * bucket.size
            if dist.get_backend(bucket.group) == "fake":
                # trainer simulate: nothing answers over the fake group; the other ranks' shards are taken
                # to be the size of this one's (exact for even shards), which is all the exchange's bytes need.
                everyone = [[(list(range(len(r))), list(range(len(c)))) for r, c in layouts]] * bucket.size
            else:
                dist.all_gather_object(everyone, layouts, group=bucket.group)
            for k, owner in enumerate(bucket.owners):
                bucket.numels[k] = [len(everyone[s][k][0]) * len(everyone[s][k][1]) for s in range(bucket.size)]
                if owner == bucket.rank:
                    device = _local(bucket.params[k]).device
                    with torch_compat.real_tensors():
                        bucket.layouts[k] = [(torch.tensor(everyone[s][k][0], dtype=torch.int64, device=device),
                                              torch.tensor(everyone[s][k][1], dtype=torch.int64, device=device))
                                             for s in range(bucket.size)]
        return list(buckets.values())


def _all_to_all(send: list[torch.Tensor], recv_sizes: list[int], group, dtype: torch.dtype,
                device: torch.device) -> list[torch.Tensor]:
    """One all-to-all of flat buffers of uneven sizes; returns the pieces received, by source group rank.
    The payload travels as bytes (the same bits: gloo moves no bfloat16)."""
    flat = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    n = dtype.itemsize
    dist.all_to_all_single(out.view(torch.uint8), flat.view(torch.uint8),
                           output_split_sizes=[n * s for s in recv_sizes],
                           input_split_sizes=[n * t.numel() for t in send], group=group)
    return list(out.split(recv_sizes))


def build_muon(params: list[tuple[str, torch.nn.Parameter]], cfg, adamw_groups_of) -> MuonWithAdamW:
    """Muon over the block matrices of named ``params`` (names without wrapper segments), AdamW (groups from
    ``adamw_groups_of(named AdamW params)``) over the rest."""
    muon = [p for n, p in params if p.requires_grad and is_muon_matrix(n, p)]
    rest = [(n, p) for n, p in params if p.requires_grad and not is_muon_matrix(n, p)]
    m = cfg.muon
    return MuonWithAdamW(muon, adamw_groups_of(rest), cfg=m, lr=m.lr if m.lr is not None else cfg.lr,
                         weight_decay=m.weight_decay if m.weight_decay is not None else cfg.weight_decay,
                         adamw_kwargs=_adamw_kwargs(cfg))


def _adamw_kwargs(cfg) -> dict:
    kwargs: dict[str, Any] = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if cfg.implementation == "fused":
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = cfg.implementation == "foreach"
    return kwargs


def muon_metrics(optimizer, mesh) -> dict[str, Any]:
    """On a log step, Newton-Schulz runs since the last log over every rank: in all (``muon_orthogonalised``)
    and per matrix, smallest and largest (``muon_orthogonalised_per_matrix``: [min, max]; [k, k] after k steps
    when each matrix ran on exactly one rank per step, [k r, k r] with r HSDP replicas), and the number of Muon
    matrices (``muon_matrices``). A collective over every rank; empty for another optimizer."""
    if not isinstance(optimizer, MuonWithAdamW):
        return {}
    counts = optimizer.orthogonalised.clone()
    names = mesh.mesh_dim_names or ()
    for name in names:  # the sum over the ranks that hold the same matrices
        if name != "pp" and mesh[name].size() > 1:
            dist.all_reduce(counts, group=mesh.get_group(name))
    optimizer.orthogonalised.zero_()
    low = counts.min() if counts.numel() else torch.tensor(2 ** 62)
    high = counts.max() if counts.numel() else torch.tensor(0)
    stats = torch.stack([low, -high, -counts.sum(), -torch.tensor(counts.numel())])  # MIN of negated = -MAX
    if "pp" in names and mesh["pp"].size() > 1:
        total = torch.stack([counts.sum(), torch.tensor(counts.numel())])
        dist.all_reduce(stats, op=dist.ReduceOp.MIN, group=mesh.get_group("pp"))
        dist.all_reduce(total, group=mesh.get_group("pp"))
        return {"muon_orthogonalised": int(total[0]), "muon_matrices": int(total[1]),
                "muon_orthogonalised_per_matrix": [int(stats[0]), int(-stats[1])]}
    return {"muon_orthogonalised": int(-stats[2]), "muon_matrices": int(-stats[3]),
            "muon_orthogonalised_per_matrix": [int(stats[0]), int(-stats[1])]}
