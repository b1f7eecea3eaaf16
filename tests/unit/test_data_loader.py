"""Training loader: exact resume, parity across data-parallel degrees and workers, re-partitioning,
mixtures, configuration errors, validation loader."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from trainer.config import ConfigError, validate
from trainer.data.loader import build_train_loader, build_val_loader, merge_states
from trainer.errors import DataStateError
from tests.support.data import ByteTokenizer, make_config, synthetic_texts, token_pairs, write_jsonl

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    return str(write_jsonl(d / "train.jsonl", synthetic_texts(160, seed=1, max_len=160)))


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    return str(write_jsonl(d / "small.jsonl", synthetic_texts(24, seed=2, max_len=60)))


def cfg(path, **kw):
    base = {"training.dataset": "jsonl", "training.dataset_path": path, "training.seq_len": 16,
            "training.local_batch_size": 4, "data.num_shards": 8, "data.shuffle_window": 8}
    base.update(kw)
    return make_config(**base)


def take(loader, n):
    return [next(loader) for _ in range(n)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_batch_shapes_and_labels(corpus):
    loader = build_train_loader(cfg(corpus, **{"data.document_positions": True}), TOK, dp_rank=0, dp_world_size=1)
    b = next(loader)
    assert b["input"].shape == b["labels"].shape == b["positions"].shape == (4, 16)
    assert b["input"].dtype == torch.long
    assert torch.equal(b["input"][:, 1:], b["labels"][:, :-1])  # labels are the inputs shifted by one
    assert loader.grad_accum_steps == 1


def test_positions_restart_at_document_starts(corpus):
    c = cfg(corpus, **{"data.document_positions": True, "data.debug_doc_ids": True})
    loader = build_train_loader(c, TOK, dp_rank=0, dp_world_size=1)
    starts = 0
    for b in take(loader, 5):
        assert torch.equal(b["positions"], b["doc_positions"][:, :-1])
        doc, pos = b["doc_ids"], b["doc_positions"]
        changed = doc[:, 1:] != doc[:, :-1]
        starts += int(changed.sum())
        assert (pos[:, 1:][changed] == 0).all()  # a new document starts at position 0
        assert (pos[:, 1:][~changed] == pos[:, :-1][~changed] + 1).all()
        assert (b["input"][pos[:, :-1] == 0] == TOK.bos_id).all()  # ... with its BOS
    assert starts > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume_mid_epoch(corpus, small_corpus, workers):
    for path, total in ((corpus, 10), (small_corpus, 16)):  # the small corpus wraps epochs
        c = cfg(path, **{"data.num_workers": workers, "training.global_batch_size": 8, "data.num_shards": 4})
        reference = take(build_train_loader(c, TOK, dp_rank=0, dp_world_size=1), total)

        loader = build_train_loader(c, TOK, dp_rank=0, dp_world_size=1)
        first = take(loader, 5)  # odd: with 2 workers the state is taken mid-rotation
        state = json.loads(json.dumps(loader.state_dict()))
        assert_same_batches(first + take(loader, total - 5), reference)  # state_dict() disturbs nothing

        resumed = build_train_loader(c, TOK, dp_rank=0, dp_world_size=1)
        resumed.load_state_dict(state)
        assert_same_batches(take(resumed, total - 5), reference[5:])

        # The state does not depend on the number of workers: resume it with the other setting.
        other = build_train_loader(cfg(path, **{"data.num_workers": 2 - workers, "training.global_batch_size": 8,
                                                "data.num_shards": 4}), TOK, dp_rank=0, dp_world_size=1)
        other.load_state_dict(state)
        assert_same_batches(take(other, 3), reference[5:8])
    if path == small_corpus:
        assert resumed.stats["epoch"] >= 1


def global_steps(path, world, local_batch, steps, workers=0, **kw):
    """The sorted sequences of each global step (all ranks, all micro-batches) for G = 8."""
    c = cfg(path, **{"training.local_batch_size": local_batch, "training.global_batch_size": 8,
                     "data.num_workers": workers, **kw})
    loaders = [build_train_loader(c, TOK, dp_rank=r, dp_world_size=world) for r in range(world)]
    accum = loaders[0].grad_accum_steps
    assert accum * local_batch * world == 8
    out = []
    for _ in range(steps):
        seqs = []
        for loader in loaders:
            for _ in range(accum):
                b = next(loader)
                seqs += [tuple(row) for row in torch.cat([b["input"], b["labels"][:, -1:]], 1).tolist()]
        out.append(sorted(seqs))
    return out


def test_global_batch_identical_for_any_world_size_and_workers(corpus):
    reference = global_steps(corpus, 1, 8, 4)
    assert len({tuple(s) for s in reference}) == 4  # the steps differ from each other
    for world, local, workers in ((1, 2, 0), (2, 4, 0), (4, 2, 0), (4, 1, 0), (2, 2, 2)):
        assert global_steps(corpus, world, local, 4, workers) == reference, (world, local, workers)


@pytest.mark.parametrize("new_world,new_workers", [(1, 2), (4, 0)])
def test_repartition_loses_and_repeats_nothing(corpus, new_world, new_workers):
    kw = {"training.global_batch_size": 8, "data.debug_doc_ids": True, "data.num_shards": 16}
    old = [build_train_loader(cfg(corpus, **{"training.local_batch_size": 4, **kw}), TOK, dp_rank=r, dp_world_size=2)
           for r in range(2)]
    seen = []
    for _ in range(3):  # 3 steps on 2 ranks
        for loader in old:
            seen += token_pairs([next(loader)])
    merged = json.loads(json.dumps(merge_states([old[1].state_dict(), old[0].state_dict()])))
    assert merged["sequences"] == 24

    c = cfg(corpus, **{"training.local_batch_size": 8 // new_world, "data.num_workers": new_workers, **kw})
    new = [build_train_loader(c, TOK, dp_rank=r, dp_world_size=new_world) for r in range(new_world)]
    for loader in new:
        loader.load_state_dict(merged)
    for _ in range(3):
        for loader in new:
            seen += token_pairs([next(loader)])

    counts = Counter(seen)
    assert max(counts.values()) == 1, "a token of a document was used twice"
    reference = build_train_loader(cfg(corpus, **{"training.local_batch_size": 8, **kw}), TOK, dp_rank=0,
                                   dp_world_size=1)
    assert set(counts) == set(token_pairs(take(reference, 6))), "different data than an uninterrupted run"
    assert reference.stats["epoch"] == 0  # all within the first epoch
    # Each shard continued from its saved state (nothing regenerated to catch up).
    assert all(loader.stats["replayed_sequences"] == 0 for loader in new)


def test_merge_and_load_errors(corpus):
    c = cfg(corpus, **{"training.global_batch_size": 8})
    a, b = (build_train_loader(c, TOK, dp_rank=r, dp_world_size=2) for r in range(2))
    next(a)
    with pytest.raises(DataStateError, match="different positions"):
        merge_states([a.state_dict(), b.state_dict()])
    with pytest.raises(DataStateError, match="each of the 2 ranks"):
        merge_states([a.state_dict()])
    with pytest.raises(DataStateError, match="merge_states"):
        build_train_loader(cfg(corpus), TOK, dp_rank=0, dp_world_size=1).load_state_dict(a.state_dict())
    other = build_train_loader(cfg(corpus, **{"data.num_shards": 4}), TOK, dp_rank=0, dp_world_size=1)
    with pytest.raises(DataStateError, match="num_shards"):
        other.load_state_dict(build_train_loader(cfg(corpus), TOK, dp_rank=0, dp_world_size=1).state_dict())


def test_mixture_shares_and_weight_change(tmp_path):
    paths = [str(write_jsonl(tmp_path / f"s{i}.jsonl", synthetic_texts(60, seed=10 + i, prefix=f"s{i}")))
             for i in range(3)]
    kw = {"data.sources": [f"jsonl:{p}" for p in paths], "training.seq_len": 7, "training.local_batch_size": 100,
          "data.num_shards": 4, "data.debug_doc_ids": True}
    loader = build_train_loader(make_config(**kw, **{"data.weights": [0.5, 0.3, 0.2]}), TOK, dp_rank=0, dp_world_size=1)
    counts = Counter()
    for _ in range(100):  # 10,000 sequences
        counts.update(next(loader)["source"].tolist())
    shares = [counts[i] / 10_000 for i in range(3)]
    assert shares == pytest.approx([0.5, 0.3, 0.2], abs=0.01)
    state = loader.state_dict()
    assert loader.stats["sources"][0]["share"] == pytest.approx(0.5, abs=0.01)

    # Weights may change on resume: from then on the new weights are realised.
    changed = build_train_loader(make_config(**kw, **{"data.weights": [1, 1, 2]}), TOK, dp_rank=0, dp_world_size=1)
    changed.load_state_dict(state)
    counts = Counter()
    for _ in range(50):
        counts.update(next(changed)["source"].tolist())
    assert [counts[i] / 5000 for i in range(3)] == pytest.approx([0.25, 0.25, 0.5], abs=0.01)


@pytest.mark.parametrize("overrides,match", [
    ({"training.global_batch_size": 6}, "global_batch_size"),
    ({"data.num_shards": 6}, "data.num_shards"),
    ({"data.sources": ["foo:/x"]}, "unknown source kind"),
    ({"data.sources": ["jsonl:A", "jsonl:B"], "data.weights": [1.0]}, "data.weights"),
    ({"data.weights": [-1.0]}, r"data.weights\[0\]"),
    ({"training.dataset": "nope"}, "training.dataset"),
])
def test_config_errors(corpus, overrides, match):
    kw = {"training.local_batch_size": 2, **overrides}
    # Found by the one validate(): when the config is loaded, or with the world size, before any loader exists.
    with pytest.raises(ConfigError, match=match):
        if "data.sources" in overrides:
            c = make_config(**{"data.num_shards": 8, **kw})
        elif overrides.get("training.dataset") == "nope":
            c = make_config(**kw)
        else:
            c = cfg(corpus, **kw)
        validate(c, 4)


def test_validation_loader_is_deterministic_and_rank_balanced(small_corpus):
    c = cfg(small_corpus, **{"validation.dataset": "jsonl", "validation.dataset_path": small_corpus,
                             "validation.local_batch_size": 2})
    one = build_val_loader(make_config(**{"validation.dataset_path": small_corpus, "validation.dataset": "jsonl",
                                          "validation.local_batch_size": 4, "training.seq_len": 16}), TOK,
                           dp_rank=0, dp_world_size=1)
    passes = [list(one), list(one)]
    assert len(passes[0]) > 2
    assert_same_batches(passes[0], passes[1])  # a fresh, identical pass each time
    ranks = [list(build_val_loader(c, TOK, dp_rank=r, dp_world_size=2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(passes[0])
    for full, b0, b1 in zip(passes[0], *ranks):
        together = sorted(map(tuple, torch.cat([b0["input"], b1["input"]]).tolist()))
        assert together == sorted(map(tuple, full["input"].tolist()))


def test_a_dropped_loader_stops_its_prefetch_thread(corpus):
    import gc
    import threading
    import time

    def prefetchers():
        return [t for t in threading.enumerate() if t.name == "batch-prefetch" and t.is_alive()]

    others = set(prefetchers())  # other tests' loaders may still be winding down: follow only this one's
    loader = build_train_loader(cfg(corpus, **{"data.prefetch_batches": 2}), TOK, dp_rank=0, dp_world_size=1)
    next(loader)
    mine = [t for t in prefetchers() if t not in others]
    assert len(mine) == 1
    del loader  # never closed: the thread must not keep the loader (and itself) alive
    deadline = time.monotonic() + 60  # generous: a loaded machine; the loop ends as soon as the thread does
    while mine[0].is_alive() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert not mine[0].is_alive()


def test_a_replica_groups_part_of_the_stream_merges_and_resumes(corpus):
    """A fault-tolerant job's replica group holds ranks 2..3 of 4: its checkpoint has their shards only, and
    those ranks resume from it exactly."""
    c = cfg(corpus, **{"training.global_batch_size": 16})
    group = [build_train_loader(c, TOK, dp_rank=r, dp_world_size=4) for r in (2, 3)]
    for loader in group:
        next(loader)
    with pytest.raises(DataStateError, match=r"each of the ranks 2..3 of 4, got ranks \[2\]"):
        merge_states([group[0].state_dict()], ranks=[2, 3])
    state = merge_states([loader.state_dict() for loader in group], ranks=[2, 3])
    assert state["kind"] == "global" and all(int(j) % 4 in (2, 3) for j in state["shards"])
    for r, loader in zip((2, 3), group):
        resumed = build_train_loader(c, TOK, dp_rank=r, dp_world_size=4)
        resumed.load_global_state(state)
        assert torch.equal(next(resumed)["input"], next(loader)["input"])
