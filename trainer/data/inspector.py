"""``trainer data inspect``: what pre-tokenized files hold, read as training reads them (megatron, numpy,
token arrow and prepared ``tokens`` sources): documents, tokens, a histogram of document lengths, the largest
token id against the model's vocabulary, and the separators at the ends of documents (how many end with EOS,
how many start with BOS). Every document is checked as in training, so damaged files fail the same way.
"""

from __future__ import annotations

import time

import numpy as np

from trainer.data.loader import build_plan
from trainer.data.sources import OK, parse_source, training_specs
from trainer.errors import ConfigError

PRETOKENIZED = ("megatron", "numpy", "arrow", "tokens")


def inspect_sources(config, tokenizer, sources: list[str] | None = None, *,
                    max_documents: int | None = None) -> list[dict]:
    """One report per source: the given specs, else the config's training sources."""
    if sources:
        specs = [parse_source(s, key=f"--source {s}") for s in sources]
    else:
        specs = training_specs(config)[0]
    for spec in specs:
        if spec.kind not in PRETOKENIZED:
            raise ConfigError(f"{spec.key}: {spec.label!r} is a {spec.kind} source (text); trainer data inspect reads "
                              "pre-tokenized sources, trainer data audit walks any source")
    plan = build_plan(config, tokenizer, specs, [1.0] * len(specs), num_shards=1, shuffle=False, max_epochs=1)
    return [_inspect(src, plan, tokenizer, max_documents) for src in plan.sources]


def _inspect(src, plan, tokenizer, max_documents: int | None) -> dict:
    start = time.perf_counter()
    lengths: list[int] = []
    skipped = 0
    top = -1
    no_eos = bos_first = 0
    eos, bos = tokenizer.eos_id, tokenizer.bos_id
    if not src.verbatim:
        raise ConfigError(f"{src.spec.key}: {src.label!r} holds text, not token ids (no data.tokens_field column)")
    for unit in range(len(src.units)):
        lo, hi = src.part(unit, 0, 1)
        for coord, nxt, payload in src.iter_docs(unit, lo, hi, lo, shard=0, num_shards=1, epoch=0):
            if max_documents is not None and len(lengths) + skipped >= max_documents:
                break
            status, tokens = src.decode(src.load(unit, coord, nxt, payload))
            if status != OK:
                skipped += 1
                continue
            if isinstance(tokens, tuple):  # a prepared folder: (tokens, status flags)
                tokens = tokens[0]
            lengths.append(len(tokens))
            top = max(top, int(tokens.max()))
            no_eos += eos is None or int(tokens[-1]) != eos
            bos_first += bos is not None and int(tokens[0]) == bos
    n = np.asarray(lengths, dtype=np.int64)
    return {
        "source": src.label, "kind": src.kind, "files": len(src.units), "documents": len(lengths),
        "skipped": skipped, "tokens": int(n.sum()),
        "length_min": int(n.min()) if len(n) else 0, "length_mean": float(n.mean()) if len(n) else 0.0,
        "length_max": int(n.max()) if len(n) else 0, "length_histogram": _histogram(n),
        "largest_id": top, "vocab_size": int(src.opts.vocab_size), "eos_id": eos, "bos_id": bos,
        "documents_without_eos": int(no_eos), "documents_starting_with_bos": int(bos_first),
        "trained_as_stored": bool(src.verbatim), "seconds": round(time.perf_counter() - start, 3),
    }


def _histogram(lengths: np.ndarray) -> dict[str, int]:
    """Documents per power-of-two length bucket: {"<=16": n, "<=32": n, ...} (empty buckets left out)."""
    if not len(lengths):
        return {}
    buckets = np.maximum(4, np.ceil(np.log2(np.maximum(lengths, 1)))).astype(np.int64)
    values, counts = np.unique(buckets, return_counts=True)
    return {f"<={1 << int(v)}": int(c) for v, c in zip(values, counts)}


def format_reports(reports: list[dict]) -> str:
    lines = []
    for r in reports:
        rows = [
            ("source", f"{r['source']} ({r['kind']}, {r['files']} file(s))"),
            *([("config", r["config"])] if "config" in r else []),
            ("documents", f"{r['documents']:,}" + (f" (+{r['skipped']:,} empty or unreadable)" if r["skipped"] else "")),
            ("tokens", f"{r['tokens']:,}"),
            ("document length min / mean / max", f"{r['length_min']:,} / {r['length_mean']:,.1f} / {r['length_max']:,}"),
            ("largest token id", f"{r['largest_id']:,} (model vocabulary {r['vocab_size']:,})"),
            ("documents not ending with EOS", f"{r['documents_without_eos']:,} (EOS id {r['eos_id']})"),
            ("documents starting with BOS", f"{r['documents_starting_with_bos']:,} (BOS id {r['bos_id']})"),
        ]
        width = max(len(k) for k, _ in rows)
        lines += [f"{k:<{width}}  {v}" for k, v in rows]
        lines.append("document lengths: " + ", ".join(f"{k}: {v:,}" for k, v in r["length_histogram"].items()))
        if r["documents_without_eos"] and r["trained_as_stored"]:
            lines.append("note: pre-tokenized documents are trained as stored, without an added separator; files "
                         "written without EOS (fms-fsdp's) want data.append_eos = true")
        lines.append(f"({r['seconds']} s)\n")
    return "\n".join(lines).rstrip()

