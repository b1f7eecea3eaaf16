"""Per-document attention (model.attn_mask_type = "block_causal"): a packed document gets the logits it gets
alone, one document per sequence is causal attention, the loader's boundaries (text and token files, across
sequences), activation checkpointing and compile, the config rules, and a short training run."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from tests.support.data import make_config, synthetic_texts, write_jsonl
from tests.support.launch import read_metrics, train_in_process
from tests.support.token_files import documents, write_numpy
from trainer.config import ConfigError
from trainer.data.loader import build_train_loader
from trainer.models.attention import document_mask, segment_positions, segment_starts
from trainer.models.llama.flavors import get_llama_args
from trainer.models.llama.model import build_llama
from trainer.step import loss_fn

VOCAB, SEQ = 256, 48


def model(mask_type: str = "block_causal", rope_per_document: bool = True, seed: int = 0):
    args = dataclasses.replace(get_llama_args("debug_gqa", vocab_size=VOCAB, max_seq_len=SEQ),
                               attn_mask_type=mask_type, rope_per_document=rope_per_document)
    torch.manual_seed(seed)
    return build_llama(args)


def packed(lengths, first: int = 0, seed: int = 1):
    """Tokens [1, sum] of documents of ``lengths`` and their document positions; the first document starts
    at position ``first`` (carried over from the previous sequence)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    positions = torch.cat([torch.arange(n) + (first if i == 0 else 0) for i, n in enumerate(lengths)])
    return docs, torch.cat(docs)[None], positions[None]


def test_a_packed_document_gets_the_logits_it_gets_alone():
    """The first part is the end of a document carried over from the previous sequence (positions 7..): it
    is a document of its own here, rotated from 0 like the others."""
    m = model()
    docs, tokens, positions = packed([9, 17, 1, 21], first=7)
    with torch.no_grad():
        together = m(tokens, positions=positions)[0]
        start = 0
        for doc in docs:
            alone = m(doc[None])[0]
            torch.testing.assert_close(together[start:start + len(doc)], alone, rtol=1e-5, atol=1e-5)
            start += len(doc)


def test_without_rope_restart_positions_run_along_the_sequence():
    """torchtitan's default: attention stays in the document, RoPE positions run along the sequence. RoPE
    scores depend only on the distance between tokens, so a later document's logits still match its logits
    alone, up to the rounding of larger angles."""
    m = model(rope_per_document=False)
    docs, tokens, positions = packed([20, 28])
    assert document_mask(positions, rope_restart=False).rope_positions is None
    restarted = document_mask(positions, rope_restart=True).rope_positions
    assert torch.equal(restarted[0], torch.cat([torch.arange(20), torch.arange(28)]))
    with torch.no_grad():
        together = m(tokens, positions=positions)[0]
        torch.testing.assert_close(together[:20], m(docs[0][None])[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together[20:], m(docs[1][None])[0], rtol=1e-4, atol=1e-4)


def test_one_document_per_sequence_is_causal_and_packed_documents_are_not():
    causal, block = model("causal"), model("block_causal")
    _, tokens, positions = packed([SEQ + 1])
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    one = positions[:, :-1]
    reference = loss_fn(causal(inputs), labels)
    torch.testing.assert_close(loss_fn(block(inputs, positions=one), labels), reference, rtol=1e-6, atol=0)
    # A causal model ignores document positions: today's path, bit for bit.
    assert torch.equal(causal(inputs, positions=one), causal(inputs))
    _, tokens, several = packed([10, 15, 24])
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    differs = loss_fn(block(inputs, positions=several[:, :-1]), labels) - loss_fn(causal(inputs), labels)
    assert abs(differs.item()) > 1e-4


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_attends_as_the_sdpa_mask():
    """The CUDA kernel's block mask, built from the same positions, gives SDPA's result (forward only:
    FlexAttention has no CPU backward)."""
    from trainer.models.attention import attention

    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g)
    positions = torch.cat([torch.cat([torch.arange(5) + 3, torch.arange(20), torch.arange(15)])[None],
                           torch.arange(40)[None]])
    sdpa = attention(q, k, v, document_mask(positions, rope_restart=False, kernel="sdpa"))
    flex = attention(q, k, v, document_mask(positions, rope_restart=False, kernel="flex"))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
    # The second row is one document: causal attention.
    torch.testing.assert_close(sdpa[1], attention(q, k, v)[1], rtol=1e-6, atol=1e-6)


def test_every_block_saves_the_one_mask_of_the_forward():
    """The SDPA mask is built once per forward, additive in the attention's dtype, and every block saves that
    same tensor for backward. (Given a boolean mask, SDPA converts it in each block and saves each copy: six
    blocks held six float masks as large as the scores, 2.7 GiB at 8192 tokens against 1.2 GiB causal.)"""
    m = model()
    _, tokens, positions = packed([12, 20, 16])
    saved = []

    def pack(t):
        if t.dim() == 4 and t.shape[-2:] == (tokens.shape[1], tokens.shape[1]):
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(tokens, positions=positions)
    assert len(saved) == len(m.layers) and saved[0].dtype == torch.float32
    assert len({t.untyped_storage().data_ptr() for t in saved}) == 1


@pytest.mark.parametrize("wrap", ["ac_full", "ac_op", "compile"])
def test_activation_checkpointing_and_compile_keep_the_gradients(wrap):
    from trainer.parallel.parallelize import apply_ac, apply_compile

    _, tokens, positions = packed([12, 20, 17])
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    grads = []
    for wrapped in (False, True):
        m = model()
        if wrapped and wrap == "compile":
            apply_compile(m, "aot_eager")  # dynamo traces the mask through the block (fullgraph)
        elif wrapped:
            apply_ac(m, "selective" if wrap == "ac_op" else "full", "op")
        loss_fn(m(inputs, positions=positions[:, :-1]), labels).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


def segments_match_documents(batch) -> int:
    """The attention segments from the batch's positions are the loader's documents (debug doc ids), a
    document carried over from the previous sequence starting one; returns how many rows start inside a
    document."""
    starts = segment_starts(batch["positions"])
    doc = batch["doc_ids"][:, :-1]
    expected = torch.ones_like(starts)
    expected[:, 1:] = doc[:, 1:] != doc[:, :-1]
    assert torch.equal(starts, expected)
    rope = segment_positions(starts)
    assert (rope < batch["positions"].shape[1]).all()
    return int((batch["positions"][:, 0] > 0).sum())


def test_boundaries_arrive_from_text_and_token_files(tmp_path):
    """block_causal makes the loader emit positions (data.document_positions left off), for text and for a
    token file, including sequences that start inside a long document."""
    from tokenizer import DEBUG_TOKENIZER_PATH, build_tokenizer

    text = write_jsonl(tmp_path / "t.jsonl", synthetic_texts(80, seed=4, max_len=160))
    tokens = write_numpy(tmp_path / "d.npy", documents(120, seed=5, max_len=90), header=True)
    tokenizer = build_tokenizer(DEBUG_TOKENIZER_PATH)
    for kind, path in (("jsonl", text), ("numpy", tokens)):
        config = make_config(**{"training.dataset": kind, "training.dataset_path": str(path), "training.seq_len": 32,
                                "training.local_batch_size": 4, "data.num_shards": 2, "data.debug_doc_ids": True,
                                "model.attn_mask_type": "block_causal"})
        loader = build_train_loader(config, tokenizer, dp_rank=0, dp_world_size=1)
        carried = sum(segments_match_documents(next(loader)) for _ in range(6))
        assert carried > 0, kind


def test_rules_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="model.attn_mask_type = \"block_causal\" too"):
        make_config(**{"model.rope_per_document": True})


def test_torchtitans_document_masked_flavors_are_their_base_with_block_causal():
    for flavor, base in (("debugmodel_flex_attn", "debugmodel"), ("debugmodel_varlen_attn", "debugmodel"),
                         ("8B_flex", "llama3_8b")):
        m = make_config(**{"model.name": "llama3", "model.flavor": flavor}).model
        assert (m.flavor, m.attn_mask_type) == (base, "block_causal")
    explicit = make_config(**{"model.flavor": "debugmodel_flex_attn", "model.attn_mask_type": "causal"}).model
    assert (explicit.flavor, explicit.attn_mask_type) == ("debugmodel", "causal")


def test_a_short_block_causal_run_trains_and_differs_from_causal(tmp_path, monkeypatch):
    """Four steps each on short documents, validation included: finite losses that differ from causal
    attention's."""
    data = write_jsonl(tmp_path / "docs.jsonl", synthetic_texts(400, seed=6, max_len=100))
    args = ["--training.steps", "4", "--training.dataset", "jsonl", "--training.dataset_path", str(data),
            "--validation.enable", "--validation.freq", "4", "--validation.steps", "1",
            "--validation.dataset", "jsonl", "--validation.dataset_path", str(data)]
    runs = {}
    for mask in ("causal", "block_causal"):
        rc, log = train_in_process(tmp_path / mask, *args, "--model.attn_mask_type", mask, monkeypatch=monkeypatch)
        assert rc == 0, log[-4000:]
        runs[mask] = read_metrics(tmp_path / mask)
    block, causal = runs["block_causal"], runs["causal"]
    assert [r["step"] for r in block if "loss" in r] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in block if "loss" in r)
    assert all(b["loss"] != c["loss"] for b, c in zip(block, causal) if "loss" in b)
    val = [r["validation_loss"] for r in block if "validation_loss" in r]
    assert val and math.isfinite(val[0]) and val[0] != next(r["validation_loss"] for r in causal if "validation_loss" in r)
