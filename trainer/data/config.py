"""The [data] config section: sources, mixing, packing and loader workers.

Every field has a one-line string under it: that string is the user documentation (``--help`` and
docs/config.md are generated from it). Its rules are in checks.py. See docs/data.md for the full picture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Data:
    sources: list[str] = field(default_factory=list)
    """Training sources for a mixture, each "kind:path" (kinds: jsonl, text, parquet, arrow, tokens, hf,
    megatron, numpy) or a registered name; paths may be globs. Megatron's form with a weight before each source
    (0.3,megatron:A,0.7,megatron:B) sets the weights. Empty: the single source training.dataset /
    training.dataset_path."""
    weights: list[float] = field(default_factory=list)
    """Mixture weights, one per entry of sources (normalised; shares are of tokens). Empty: equal weights.
    May be changed when resuming."""
    num_shards: int = 64
    """Logical shards of the data stream; must be divisible by the data-parallel degree. Keep it fixed for a
    run: the global batch of every step depends on it, not on the number of ranks or workers. Left at its
    default, a source too small for 64 shards gets the largest count it fills that the data-parallel degree
    divides (the log says which); set explicitly, such a source is refused."""
    num_workers: int = 0
    """Loader worker processes per rank (0 loads in the training process)."""
    prefetch_factor: int = 2
    """Micro-batches each loader worker prepares ahead (only with num_workers > 0)."""
    prefetch_batches: int = 2
    """Micro-batches prepared ahead on a background thread (loading, packing, pinning, fingerprint), so the
    host work of the next step overlaps the current one; 0 prepares each batch on the training thread."""
    pin_memory: bool = False
    """Return batches in pinned (page-locked) memory for asynchronous host-to-GPU copies. Turned on
    automatically on GPUs unless set explicitly."""
    separator: Literal["auto", "bos", "eos"] = "auto"
    """The one separator between packed documents: bos (prepended to every document) or eos (appended). auto:
    what the tokenizer's files add (tokenizer_config.json add_bos_token/add_eos_token, else tokenizer.json's
    post-processor): eos when they add only EOS, else bos, or eos for a tokenizer without BOS (GPT-2's
    <|endoftext|>). Exports and evaluation follow it (docs/export_eval.md)."""
    document_positions: bool = False
    """Also emit "positions": each token's position inside its document (0 at every document start).
    model.attn_mask_type = "block_causal" turns this on and limits attention to each document with them."""
    shuffle: bool = True
    """Shuffle the order of files and of documents (within windows of shuffle_window documents) every epoch."""
    shuffle_window: int = 1024
    """Documents read ahead and shuffled together in each shard (bounds the memory used for shuffling)."""
    seed: int | None = None
    """Seed of the data order; None: debug.seed (0 when that is unset too)."""
    text_field: str = "text"
    """Column or JSON key holding the document text (jsonl, parquet, arrow and hf sources)."""
    tokens_field: str = "tokens"
    """Column of arrow sources holding pre-tokenized documents (a list of token ids per row, or integer tokens
    with one record batch per document, as fms-fsdp writes); files without it are read as text
    (data.text_field)."""
    numpy_dtype: Literal["auto", "uint16", "uint32"] = "auto"
    """Token type of numpy sources without an NPY header (OLMo's raw .npy arrays). auto: uint16 when the
    model's vocabulary fits in 16 bits, else uint32. A raw file that looks written at the other width (uint32
    tokens read as uint16: every second uint16 is 0) is refused, naming this key. A file with an NPY header is
    read as its header says (with a warning when that differs from the type set here)."""
    append_eos: bool = False
    """Append the tokenizer's EOS to every pre-tokenized document (megatron, numpy, token arrow) that does not
    already end with it, for files stored without separators (fms-fsdp's loader adds the delimiter when it
    reads). Off: such documents are trained exactly as stored (trainer data audit counts those without EOS)."""
    text_document: Literal["line", "file"] = "line"
    """For text sources: every line is a document, or every file is one document."""
    max_skipped_fraction: float = 0.01
    """Stop the run (data error, exit 4) when more than this fraction of the documents read so far were
    skipped (malformed, empty, undecodable, missing data.text_field); checked on log steps once 100
    documents were read, naming the file and line of the last one. 1.0: never stop. The counts are in
    metrics.jsonl, summary.json and the console."""
    max_document_tokens: int = 0
    """Cut documents to this many tokens (separator not counted) and count them as truncated; 0: never."""
    long_document_windows: int = 64
    """Documents spanning more than this many packed sequences are counted as long (reported by stats and
    audit; they are still used)."""
    debug_doc_ids: bool = False
    """Add debugging tensors to every batch: doc_ids and doc_positions (per token of the seq_len + 1
    window), source and shard (per sequence)."""
