"""Context parallelism in one process: the head-tail split and its inverse, the masks written for global
positions (against the whole-sequence masks of trainer/models/attention.py), the batch split, the mesh's
degrees, and the config rules (one line each, before any process starts). The collectives and the training
runs are in tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch

from tests.support.data import make_config
from trainer.config import ConfigError, load_config, validate
from trainer.models.attention import document_mask
from trainer.parallel.context import (ContextParallel, ContextParallelMask, gathered_index, headtail_index,
                                      shard_batch, shard_sequence, unshard_sequence)
from trainer.parallel.dims import ParallelDims


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_headtail_split_gives_each_rank_chunks_r_and_its_mirror_and_unsplits(cp):
    seq = 8 * cp
    chunk = seq // (2 * cp)
    for r in range(cp):
        index = headtail_index(seq, cp, r).tolist()
        assert index == [*range(r * chunk, (r + 1) * chunk), *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)]
    # Every position exactly once over the ranks; causal work (keys seen) equal on every rank.
    assert sorted(gathered_index(seq, cp).tolist()) == list(range(seq))
    work = {sum(i + 1 for i in headtail_index(seq, cp, r).tolist()) for r in range(cp)}
    assert len(work) == 1
    t = torch.randn(3, seq, 5)
    shards = [shard_sequence(t, cp, r) for r in range(cp)]
    assert torch.equal(unshard_sequence(torch.cat(shards, dim=1), cp), t)


def positions_of(lengths: list[int], first: int = 0) -> torch.Tensor:
    return torch.cat([torch.arange(n) + (first if i == 0 else 0) for i, n in enumerate(lengths)])


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("block", [False, True])
def test_mask_from_global_positions_is_the_whole_sequence_mask_on_each_ranks_rows(cp, block):
    seq = 32
    positions = torch.stack([positions_of([5, 11, 3, 13], first=2), positions_of([20, 12])])
    # The masks are additive (0: may attend, -inf: may not); as booleans here.
    full = (document_mask(positions, rope_restart=False, kernel="sdpa").mask == 0 if block
            else torch.ones(seq, seq, dtype=torch.bool).tril()[None, None].expand(2, 1, seq, seq))
    for r in range(cp):
        index = headtail_index(seq, cp, r)
        segments = None
        if block:
            # What ContextParallel.model_inputs derives from the gathered positions.
            starts = torch.ones_like(positions, dtype=torch.bool)
            starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
            segments = torch.cumsum(starts, dim=1, dtype=torch.int32)
        allgather = ContextParallelMask(ContextParallel(None, cp, r, "allgather"), seq, index, segments)
        # allgather: this rank's queries (rows) over every key in order (columns); causal on CPU needs no mask
        # (each local chunk attends the keys up to its end: the next test).
        if block:
            assert torch.equal((allgather.mask == 0).expand(2, 1, len(index), seq), full[:, :, index])
        else:
            assert allgather.mask is None and allgather.flash_ops is not None
        # alltoall: the whole sequence in order on both sides (causal: SDPA's is_causal, no mask).
        alltoall = ContextParallelMask(ContextParallel(None, cp, r, "alltoall"), seq, index, segments)
        assert (alltoall.mask is None) if not block else torch.equal(alltoall.mask == 0, full)
        # The orders that take gathered shards to the sequence and back are inverse permutations.
        assert torch.equal(allgather.gathered[allgather.order], torch.arange(seq))


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_causal_chunks_attend_what_the_causal_mask_allows(cp, kv_heads):
    """allgather's causal attention on CPU (each local chunk over the keys before it in full and itself
    causally, merged by log-sum-exp) gives, forward and backward, what SDPA gives under the dense causal mask
    of the rank's rows; float32 against a float64 reference, grouped-query heads included."""
    from trainer import torch_compat
    from trainer.parallel.context import _CausalChunks

    torch.manual_seed(cp * 10 + kv_heads)
    seq, size = 32, 32 // (2 * cp)
    for r in range(cp):
        index = headtail_index(seq, cp, r)
        q = torch.randn(2, 4, seq, 16, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(2, kv_heads, seq, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
        grad_out = torch.randn(2, 4, len(index), 16, dtype=torch.float64)
        mask = index[:, None] >= torch.arange(seq)[None, :]
        want = torch.nn.functional.scaled_dot_product_attention(q[:, :, index], k, v, attn_mask=mask,
                                                                enable_gqa=kv_heads != 4)
        want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        got = _CausalChunks.apply(q32[:, :, index], k32, v32, (r, 2 * cp - 1 - r), size,
                                  torch_compat.cpu_flash_attention_ops())
        grads = torch.autograd.grad(got, (q32, k32, v32), grad_out.float())
        assert torch.allclose(got.double(), want, atol=2e-6), (got.double() - want).abs().max()
        for g, w in zip(grads, want_grads):
            assert torch.allclose(g.double(), w, atol=5e-6), (g.double() - w).abs().max()


def test_fsdp_passes_the_mask_object_through_unrebuilt():
    """FSDP casts a block's inputs with torch's ``_apply_to_tensors``, which rebuilds dataclasses: a mask
    object rebuilt in every block would build (and keep for backward) its dense mask once per block; 6x the
    mask at 8192 tokens on the debug model, found by `trainer bench context-parallel`."""
    from torch.distributed.utils import _apply_to_tensors

    segments = torch.ones(1, 32, dtype=torch.int32)
    mask = ContextParallelMask(ContextParallel(None, 2, 0, "allgather"), 32, headtail_index(32, 2, 0), segments)
    assert _apply_to_tensors(lambda t: t.clone(), mask) is mask


def test_batch_split_keeps_what_is_not_along_the_sequence():
    batch = {"input": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8) + 1,
             "positions": torch.arange(16).view(2, 8) % 8, "doc_ids": torch.tensor([3, 4])}
    cp = ContextParallel(None, 2, 1, "allgather")
    local = shard_batch(batch, cp)
    assert local["input"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(local["labels"], local["input"] + 1)
    assert local["positions"].tolist() == [[2, 3, 4, 5], [2, 3, 4, 5]]
    assert local["doc_ids"] is batch["doc_ids"]
    assert shard_batch(batch, None) is batch


def test_cp_is_a_mesh_dimension_counted_apart_from_data_parallel():
    config = make_config(**{"parallelism.context_parallel_degree": 2, "training.seq_len": 64})
    dims = ParallelDims.from_config(config.parallelism, 8)
    # dp_shard takes what is left after cp: the loader's degree does not count the CP ranks.
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp) == (1, 4, 2, 1, 1)
    assert (dims.dp, dims.dp_cp, dims.fsdp_enabled) == (4, 8, True)
    assert "cp=2" in dims.describe()
    # CP alone still shards the parameters (and averages the gradients) over the CP ranks.
    assert ParallelDims.from_config(config.parallelism, 2).fsdp_enabled


def layout(world_size: int, **overrides):
    argv = [a for k, v in overrides.items() for a in (f"--{k}", str(v))]
    validate(load_config(argv, env={}), world_size)


def test_a_cp_degree_that_cannot_work_is_one_line():
    with pytest.raises(ConfigError, match=r"training.seq_len \(66\) must be a multiple of 2 x context_parallel_degree"):
        layout(2, **{"parallelism.context_parallel_degree": 2, "training.seq_len": 66})
    with pytest.raises(ConfigError, match="heads per tensor-parallel rank .* divisible by context_parallel_degree"):
        layout(3, **{"parallelism.context_parallel_degree": 3, "training.seq_len": 60,
                     "parallelism.context_parallel_rotate_method": "alltoall"})  # 16 heads
    with pytest.raises(ConfigError, match="context_parallel_degree \\(3\\) = 3"):
        layout(4, **{"parallelism.context_parallel_degree": 3, "parallelism.data_parallel_shard_degree": 1,
                     "training.seq_len": 60})
    with pytest.raises(ConfigError, match="the only load balancer is \"headtail\""):
        make_config(**{"parallelism.context_parallel_load_balancer": "ptrr"})
    # Ulysses with key/value heads fewer than the degree: they are repeated, not refused.
    layout(4, **{"parallelism.context_parallel_degree": 4, "parallelism.context_parallel_rotate_method": "alltoall",
                 "training.seq_len": 64})
