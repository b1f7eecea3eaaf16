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
    full = (document_mask(positions, rope_restart=False, kernel="sdpa").mask if block
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
        # allgather: this rank's queries (rows) over every key in order (columns).
        assert torch.equal(allgather.mask.expand(2, 1, len(index), seq), full[:, :, index])
        # alltoall: the whole sequence in order on both sides (causal: SDPA's is_causal, no mask).
        alltoall = ContextParallelMask(ContextParallel(None, cp, r, "alltoall"), seq, index, segments)
        assert (alltoall.mask is None) if not block else torch.equal(alltoall.mask, full)
        # The orders that take gathered shards to the sequence and back are inverse permutations.
        assert torch.equal(allgather.gathered[allgather.order], torch.arange(seq))


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
