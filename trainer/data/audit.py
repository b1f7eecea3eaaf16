"""``trainer data audit``: walk the training stream of a config and report what the model would see.

The audit runs the same shard streams as training (one process, all shards, in training order) and
checks the packed tokens themselves, not just counters: every document start (position 0) after the
first of a stream is a boundary, and the separators on it are the last token of the previous document
and the first token of the next (exactly one is right); two separator tokens next to each other
anywhere, inside a window or across consecutive windows of a stream, count as doubled separators.

Documents whose text contains a special token's string (``<s>``, ``<|endoftext|>``, ...) are counted: such
text is trained on as plain text, never as the special token, while a Hugging Face tokenizer given the
same text maps it to the special token (text sources only; prepared tokens no longer hold the text).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from trainer.data.loader import aggregate_stats, build_plan
from trainer.data.pipeline import ShardStream
from trainer.data.sources import training_specs


def audit(config, tokenizer, *, max_sequences: int | None = None) -> dict:
    """Report on the training data of `config`.

    Default: one pass. Every shard's stream is walked in training order until one of its sources runs
    out (with a single source: until all of its documents were read; partial last windows are not
    counted as sequences). With `max_sequences`: that many sequences of the endless training stream, in
    global training order (epochs wrap as in training).
    """
    d = config.data
    specs, weights = training_specs(config)
    # data.num_shards left at its default: lowered for a small source as training lowers it (on one rank)
    fit = None if config.explicitly_set("data.num_shards") else 1
    plan = build_plan(config, tokenizer, specs, weights, num_shards=d.num_shards, shuffle=d.shuffle,
                      max_epochs=None if max_sequences is not None else 1, shard_multiple=fit)
    literal = LiteralSpecials(tokenizer)
    plan = dataclasses.replace(plan, debug=True, positions=True, tokenizer=literal)
    streams = [ShardStream(j, plan) for j in range(plan.num_shards)]
    seps = _Separators(np.array(sorted(set(plan.strip_ids) | {plan.separator_id}), dtype=np.int64))
    sequences = 0
    start = time.perf_counter()
    active = list(range(plan.num_shards))
    i = 0
    while active and (max_sequences is None or sequences < max_sequences):
        j = active[i % len(active)]
        try:
            w = streams[j].next()
        except StopIteration:  # one pass: this shard is done
            active.remove(j)
            continue
        i += 1
        sequences += 1
        seps.add(w)

    stats = aggregate_stats({str(j): s.state_dict() for j, s in enumerate(streams)}, plan)
    return {
        "sources": [s.label for s in plan.sources],
        "seq_len": plan.seq_len,
        "num_shards": plan.num_shards,
        "separator": plan.separator if not all(s.verbatim for s in plan.sources) else "as stored",
        "as_stored_sources": [s.label for s in plan.sources if s.verbatim],
        "mode": "one pass" if max_sequences is None else f"{max_sequences} sequences",
        "documents": stats["documents"],
        "tokens": stats["tokens"],
        "sequences": sequences,
        "sequence_tokens": sequences * (plan.seq_len + 1),
        "boundaries": seps.boundaries,
        "separators_per_boundary": seps.at_boundaries / seps.boundaries if seps.boundaries else 0.0,
        "doubled_separators": seps.doubled,
        "missing_separators": seps.missing,
        "stripped_separators": stats["stripped_separators"],
        "documents_without_eos": stats["documents_without_eos"],
        "literal_special_tokens": literal.report(),
        "skipped_empty": stats["skipped_empty"],
        "skipped_malformed": stats["skipped_malformed"],
        "skipped_undecodable": stats["skipped_undecodable"],
        "skipped_missing_field": stats["skipped_missing_field"],
        "long_documents": stats["long_documents"],
        "truncated_documents": stats["truncated_documents"],
        "epochs_completed": stats["epoch"],
        "mixture": [
            {"source": p["source"], "weight": p["weight"], "sequences": p["sequences"],
             "tokens": p["sequences"] * (plan.seq_len + 1), "share": p["share"], "documents": p["documents"]}
            for p in stats["sources"]
        ],
        "seconds": round(time.perf_counter() - start, 3),
    }


class _Separators:
    """Counts separators at document boundaries over the packed windows of every (shard, source) stream."""

    def __init__(self, sep_ids: np.ndarray):
        self.sep_ids = sep_ids
        self.last_token: dict[tuple[int, int], int] = {}  # last token of each (shard, source) packed stream
        self.boundaries = self.at_boundaries = self.doubled = self.missing = 0

    def add(self, w) -> None:
        key = (w.shard, w.source)
        prev = self.last_token.get(key)
        self.last_token[key] = int(w.tokens[-1])
        is_sep = np.isin(w.tokens, self.sep_ids)
        # Adjacent separators anywhere in the stream (inside a window, or across two windows).
        self.doubled += int(np.count_nonzero(is_sep[:-1] & is_sep[1:]))
        if prev is not None and is_sep[0] and prev in self.sep_ids:
            self.doubled += 1
        # Boundaries: every document start except the first of a stream; separators on each boundary are
        # the last token of the previous document and the first of the next.
        for s in np.flatnonzero(w.positions == 0):
            if s == 0 and prev is None:
                continue
            before = bool(is_sep[s - 1]) if s > 0 else bool(prev in self.sep_ids)
            n = int(before) + int(is_sep[s])
            self.boundaries += 1
            self.at_boundaries += n
            self.missing += n == 0


class LiteralSpecials:
    """The run's tokenizer, counting documents whose text holds a special token's string."""

    def __init__(self, tokenizer):
        from tokenizer.policy import special_strings

        self._tok = tokenizer
        self.strings = special_strings(tokenizer)
        self.documents = 0
        self.occurrences: dict[str, int] = {}

    def __getattr__(self, name):
        if name.startswith("__") or name == "_tok":
            raise AttributeError(name)
        return getattr(self._tok, name)

    def encode(self, text: str, **kwargs) -> list[int]:
        found = {s: text.count(s) for s in self.strings if s in text}
        if found:
            self.documents += 1
            for s, n in found.items():
                self.occurrences[s] = self.occurrences.get(s, 0) + n
        return self._tok.encode(text, **kwargs)

    def report(self) -> dict:
        return {"documents": self.documents, "occurrences": dict(sorted(self.occurrences.items()))}


def _literal_row(literal: dict) -> str:
    if not literal["documents"]:
        return "0"
    shown = ", ".join(f"{s} x{n:,}" for s, n in literal["occurrences"].items())
    return f"{literal['documents']:,} ({shown}; trained as plain text)"


def audit_problem(report: dict) -> str | None:
    """Why the audited data would not train as the docs promise (one line), or None: no sequence packed, or a
    document boundary without exactly one separator."""
    if not report["sequences"]:
        return (f"packed no sequence: no shard holds seq_len + 1 = {report['seq_len'] + 1} tokens of its sources "
                f"({report['tokens']:,} document tokens over {report['num_shards']} shards); lower training.seq_len or "
                "data.num_shards")
    b, ratio = report["boundaries"], report["separators_per_boundary"]
    if not b or (ratio == 1.0 and not report["missing_separators"]):
        return None
    stored = report.get("as_stored_sources", [])
    if report["missing_separators"] and report["documents_without_eos"]:
        fix = ("pre-tokenized documents do not end with EOS: set data.append_eos = true (or write the files with an "
               "EOS at the end of each document)")
    elif stored:
        fix = (f"the token files ({', '.join(stored)}) hold a separator at both ends of their documents or none, or "
               "were read at the wrong width (data.numpy_dtype); trainer data inspect shows how their documents "
               "start and end")
    else:  # packing adds exactly one to every text document
        fix = "packing text gives one separator per boundary: report this as a bug, with the config"
    return (f"{ratio:.4f} separators per document boundary, not 1 ({report['missing_separators']:,} of {b:,} "
            f"boundaries without one, {report['doubled_separators']:,} doubled separators); {fix}")


def format_table(report: dict) -> str:
    """The audit report for people."""
    boundaries = report["boundaries"]
    rows = [
        *([("config", report["config"])] if "config" in report else []),
        ("sources", ", ".join(report["sources"])),
        ("seq_len / shards / separator", f"{report['seq_len']} / {report['num_shards']} / {report['separator']}"),
        ("walked", report["mode"]),
        ("documents", f"{report['documents']:,}"),
        ("document tokens", f"{report['tokens']:,}"),
        ("packed sequences", f"{report['sequences']:,} ({report['sequence_tokens']:,} tokens)"),
        ("document boundaries", f"{report['boundaries']:,}"),
        ("separators per boundary", f"{report['separators_per_boundary']:.4f}" if boundaries else "- (no boundary)"),
        ("doubled separators", f"{report['doubled_separators']:,}"),
        ("boundaries without separator", f"{report['missing_separators']:,}"),
        ("tokenizer-added separators removed", f"{report['stripped_separators']:,}"),
        ("pre-tokenized documents without EOS", f"{report['documents_without_eos']:,}"),
        ("documents with special-token text", _literal_row(report["literal_special_tokens"])),
        ("skipped: empty", f"{report['skipped_empty']:,}"),
        ("skipped: malformed", f"{report['skipped_malformed']:,}"),
        ("skipped: undecodable", f"{report['skipped_undecodable']:,}"),
        ("  of which no text_field", f"{report['skipped_missing_field']:,}"),
        ("long documents", f"{report['long_documents']:,}"),
        ("truncated documents", f"{report['truncated_documents']:,}"),
        ("epochs completed (slowest shard)", str(report["epochs_completed"])),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += ["", f"{'mixture source':<40} {'weight':>8} {'share':>8} {'sequences':>11} {'documents':>10}"]
    for m in report["mixture"]:
        lines.append(f"{m['source'][:40]:<40} {m['weight']:>8.4f} {m['share']:>8.4f} {m['sequences']:>11,} "
                     f"{m['documents']:>10,}")
    lines.append(f"\n({report['seconds']} s)")
    return "\n".join(lines)
