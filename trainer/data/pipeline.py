"""The per-shard stages: read documents -> tokenize -> pack -> mix sources.

Every stage is a small object with ``state_dict()`` / ``load_state_dict()``; the states are plain dicts
of ints, floats, strings and lists (JSON-able), small, and independent of processes and ranks.

    DocumentReader     raw documents of one source in one shard, epoch after epoch, seeded order
    DocumentTokenizer  decode, skip and count bad documents, tokenize, one separator per document
    Packer             cut the document stream into windows of seq_len + 1 tokens
    ShardStream        one logical shard: a packer per source and a deterministic weighted schedule

A packer's state points at the document it is in the middle of (the reader state just before that
document, plus a token offset), never at buffered tokens: resuming re-reads and re-tokenizes one
document, and the state stays a few integers whatever seq_len or document sizes are.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from trainer.data.sources import (
    BLOCK_BYTES, EMPTY, MALFORMED, MISSING_FIELD, OK, STRIPPED_LEADING, STRIPPED_TRAILING, UNDECODABLE, DataError,
    Source,
)

STAT_KEYS = (
    "documents",  # documents used (each counted once, when first read)
    "tokens",  # tokens of those documents, separators included
    "skipped_empty",
    "skipped_malformed",
    "skipped_undecodable",
    "skipped_missing_field",  # of skipped_malformed: JSON lines without data.text_field (text sources only)
    "long_documents",  # longer than data.long_document_windows windows (still used)
    "truncated_documents",  # cut to data.max_document_tokens
    "stripped_separators",  # BOS/EOS the tokenizer itself added, removed before adding the one separator
    "documents_without_eos",  # pre-tokenized documents (trained as stored) that do not end with EOS
)
_SKIP_KEY = {EMPTY: "skipped_empty", MALFORMED: "skipped_malformed", UNDECODABLE: "skipped_undecodable"}


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(k) for k in key]))


@dataclass
class DataPlan:
    """Everything a shard stream needs, resolved from the config once in the main process and shipped
    (pickled) to loader workers."""

    sources: list[Source]
    weights: list[float]
    tokenizer: Any
    seq_len: int
    separator: str  # "bos" or "eos"
    separator_id: int
    strip_ids: tuple[int, ...]  # ids removed from the ends of a tokenized document (BOS and EOS)
    num_shards: int
    seed: int
    shuffle: bool
    shuffle_window: int
    max_document_tokens: int = 0
    long_document_windows: int = 64
    positions: bool = False
    debug: bool = False
    max_epochs: int | None = None  # None: loop forever (training); 1: one pass (validation)
    append_eos: bool = False  # pre-tokenized documents without a final EOS get one (data.append_eos)
    eos_id: int | None = None
    extra: dict = field(default_factory=dict)

    def fingerprint(self) -> dict:
        """What a checkpoint's data state depends on (weights, seq_len and separator may change)."""
        return {
            "num_shards": self.num_shards, "seed": self.seed, "shuffle": self.shuffle,
            "shuffle_window": self.shuffle_window, "sources": [s.fingerprint() for s in self.sources],
        }


class DocumentReader:
    """Raw documents of one source in one shard, epoch after epoch.

    Order: every epoch permutes the source's units (files); each unit's part (see Source.part) is read
    in blocks of up to ``shuffle_window`` documents (and BLOCK_BYTES for line files), and each block is
    permuted. Blocks of line files hold offsets only; a document's bytes are read when it is used.
    Both permutations are seeded by (seed, source, shard, epoch, unit, block start), so the order is a
    pure function of the config, and the state (epoch, unit, block start, index in block) is enough to
    re-read the current block and continue.
    """

    def __init__(self, source: Source, shard: int, plan: DataPlan):
        self.source, self.shard, self.plan = source, shard, plan
        self.epoch = 0
        self.unit_pos = 0  # position in this epoch's unit order
        self.block_start: int | None = None  # None: the start of the unit's part
        self.block_index = 0  # next position in the block's permutation
        self.epoch_docs = 0  # raw documents read this epoch (0 at the end of an epoch: an empty shard)
        self._block: list | None = None
        self._drop_cache()

    def _drop_cache(self):
        self._block = None
        self._order_epoch: int | None = None

    def where(self) -> dict:
        """Where the document last returned is: its file and byte offset (line sources) or row."""
        unit, coord = getattr(self, "last", (None, 0))
        name = self.source.units[unit] if unit is not None and unit < len(self.source.units) else self.source.label
        return {"file": str(name), "at": int(coord), "bytes": bool(self.source.coords_are_bytes)}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "unit_pos": self.unit_pos, "block_start": self.block_start,
                "block_index": self.block_index, "epoch_docs": self.epoch_docs}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.unit_pos = int(sd["epoch"]), int(sd["unit_pos"])
        self.block_start = None if sd["block_start"] is None else int(sd["block_start"])
        self.block_index, self.epoch_docs = int(sd["block_index"]), int(sd["epoch_docs"])
        self._drop_cache()

    def _unit(self) -> int:
        if self._order_epoch != self.epoch:
            n = len(self.source.units)
            if self.plan.shuffle and n > 1:
                self._order = _rng(self.plan.seed, self.source.index, self.shard, self.epoch, 1).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = self.epoch
        return int(self._order[self.unit_pos])

    def _load_block(self) -> None:
        unit = self._unit()
        src, plan = self.source, self.plan
        lo, hi = src.part(unit, self.shard, plan.num_shards)
        start = lo if self.block_start is None else self.block_start
        docs: list[tuple[int, int, Any]] = []
        full = False
        if start < hi:
            nbytes = 0
            gen = src.iter_docs(unit, lo, hi, start, shard=self.shard, num_shards=plan.num_shards, epoch=self.epoch)
            try:
                for doc in gen:
                    docs.append(doc)
                    nbytes += doc[1] - doc[0]
                    if len(docs) >= plan.shuffle_window or (src.coords_are_bytes and nbytes >= BLOCK_BYTES):
                        full = True
                        break
            finally:
                gen.close()
        self._block, self._block_unit = docs, unit
        self._block_next = docs[-1][1] if full else None  # None: the part ends with this block
        if plan.shuffle and len(docs) > 1:
            self._perm = _rng(plan.seed, src.index, self.shard, self.epoch, unit, start, 2).permutation(len(docs))
        else:
            self._perm = np.arange(len(docs))

    def next(self) -> tuple[int, Any]:
        """(document id, payload) of the next document; StopIteration after plan.max_epochs epochs."""
        while True:
            if self._block is None:
                if self.plan.max_epochs is not None and self.epoch >= self.plan.max_epochs:
                    raise StopIteration
                self._load_block()
            if self.block_index < len(self._block):
                coord, next_coord, payload = self._block[int(self._perm[self.block_index])]
                self.block_index += 1
                self.epoch_docs += 1
                unit = self._block_unit
                self.last = (unit, coord)
                return (self.source.uid(unit, coord, self.shard),
                        self.source.load(unit, coord, next_coord, payload))
            # Block used up: the next block of this part, else the next unit, else the next epoch.
            if self._block_next is not None:
                self.block_start = self._block_next
            else:
                self.block_start = None
                self.unit_pos += 1
                if self.unit_pos >= len(self.source.units):
                    if self.epoch_docs == 0:
                        raise DataError(
                            f"{self.source.spec.key} ({self.source.label}): shard {self.shard} of "
                            f"{self.plan.num_shards} holds no documents; lower data.num_shards or add data"
                        )
                    self.epoch += 1
                    self.unit_pos = 0
                    self.epoch_docs = 0
            self.block_index = 0
            self._block = None


class DocumentTokenizer:
    """Decode and tokenize documents; skip (and count) empty, malformed and undecodable ones.

    Separator policy: BOS and EOS ids at either end of the tokenizer's output are removed (a tokenizer
    that adds them itself would otherwise put two separators on a boundary), then exactly one separator
    is added: BOS before the document or EOS after it.
    """

    def __init__(self, reader: DocumentReader, plan: DataPlan):
        self.reader, self.plan = reader, plan
        self.stats = dict.fromkeys(STAT_KEYS, 0)

    def _tokens(self, obj: Any, payload_stripped: int) -> tuple[np.ndarray | None, int]:
        if isinstance(obj, str):
            try:
                ids = self.plan.tokenizer.encode(obj)
            except Exception:  # noqa: BLE001 - a tokenizer failing on one document must not stop the run
                return None, 0
            lead, end = 0, len(ids)
            strip = self.plan.strip_ids
            while lead < end and ids[lead] in strip:
                lead += 1
            while end > lead and ids[end - 1] in strip:
                end -= 1
            return np.asarray(ids[lead:end], dtype=np.int64), lead + len(ids) - end
        return obj, payload_stripped  # pre-tokenized, already stripped by prepare

    def next(self, count: bool = True) -> tuple[dict, int, np.ndarray]:
        """(reader state just before the document, document id, tokens with the separator)."""
        plan, stats = self.plan, self.stats
        first_epoch = self.reader.epoch
        while True:
            before = self.reader.state_dict()
            uid, payload = self.reader.next()
            status, obj = self.reader.source.decode(payload)
            if status == OK:
                stripped = 0
                if isinstance(obj, tuple):  # (tokens, status byte) from a prepared dataset
                    obj, flags = obj
                    stripped = bool(flags & STRIPPED_LEADING) + bool(flags & STRIPPED_TRAILING)
                ids, stripped = self._tokens(obj, stripped)
                if ids is None:
                    status = UNDECODABLE
                elif len(ids) == 0:
                    status = EMPTY
            if status != OK:
                if count:
                    stats[_SKIP_KEY[status]] += 1
                    if status == MALFORMED and obj is MISSING_FIELD:
                        stats["skipped_missing_field"] += 1
                    stats["last_skipped"] = self.reader.where()
                if self.reader.epoch >= first_epoch + 2:
                    raise DataError(
                        f"{self.reader.source.spec.key} ({self.reader.source.label}): shard {self.reader.shard} "
                        f"has no usable document in a whole epoch (skipped: empty {stats['skipped_empty']}, "
                        f"malformed {stats['skipped_malformed']}, undecodable {stats['skipped_undecodable']})"
                        # Malformed JSON-lines or columns usually mean the text is under another name.
                        + (f"; is the text under another field than {self.reader.source.opts.text_field!r} "
                           "(data.text_field)?" if stats["skipped_malformed"] else "")
                    )
                continue
            if plan.max_document_tokens and len(ids) > plan.max_document_tokens:
                ids = ids[: plan.max_document_tokens]
                if count:
                    stats["truncated_documents"] += 1
            doc = self._stored(ids, count) if self.reader.source.verbatim else self._separated(ids)
            if count:
                stats["documents"] += 1
                stats["tokens"] += len(doc)
                stats["stripped_separators"] += stripped
                if len(doc) > plan.long_document_windows * (plan.seq_len + 1):
                    stats["long_documents"] += 1
            return before, uid, doc

    def _separated(self, ids: np.ndarray) -> np.ndarray:
        plan = self.plan
        doc = np.empty(len(ids) + 1, dtype=np.int64)
        if plan.separator == "bos":
            doc[0], doc[1:] = plan.separator_id, ids
        else:
            doc[:-1], doc[-1] = ids, plan.separator_id
        return doc

    def _stored(self, ids: np.ndarray, count: bool) -> np.ndarray:
        """A pre-tokenized document as stored (a view of its file: the packer copies it into the window),
        with EOS appended only under data.append_eos."""
        eos = self.plan.eos_id
        if eos is None or int(ids[-1]) == eos:
            return ids
        if count:
            self.stats["documents_without_eos"] += 1
        if self.plan.append_eos:
            return np.append(ids.astype(np.int64), eos)
        return ids


class Window(NamedTuple):
    """One packed sequence of seq_len + 1 tokens (inputs are [:-1], labels [1:])."""

    tokens: np.ndarray
    positions: np.ndarray | None  # position of each token inside its document
    doc_ids: np.ndarray | None  # document id of each token
    source: int
    shard: int


class Packer:
    """Concatenate one source's documents (of one shard) and cut windows of seq_len + 1 tokens."""

    def __init__(self, docs: DocumentTokenizer, plan: DataPlan):
        self.docs, self.plan = docs, plan
        self.width = plan.seq_len + 1
        self.sequences = 0
        self._cur: tuple[dict, int, np.ndarray] | None = None
        self._offset = 0
        self._pending: dict | None = None

    def state_dict(self) -> dict:
        if self._pending is not None:
            return _copy_state(self._pending)
        if self._cur is None:
            reader, has_doc = self.docs.reader.state_dict(), False
        else:
            reader, has_doc = dict(self._cur[0]), True
        return {"reader": reader, "has_doc": has_doc, "offset": self._offset if has_doc else 0,
                "stats": dict(self.docs.stats), "sequences": self.sequences}

    def load_state_dict(self, sd: dict) -> None:
        # Applied lazily (in the process that reads), so loading a state costs nothing up front.
        self._pending = _copy_state(sd)
        self._cur = None

    def _restore(self) -> None:
        sd, self._pending = self._pending, None
        self.docs.stats = {k: int(sd["stats"].get(k, 0)) for k in STAT_KEYS}
        if sd["stats"].get("last_skipped"):  # where the last skipped document was (for the error message)
            self.docs.stats["last_skipped"] = dict(sd["stats"]["last_skipped"])
        self.sequences = int(sd["sequences"])
        self.docs.reader.load_state_dict(sd["reader"])
        if sd["has_doc"]:
            self._cur = self.docs.next(count=False)  # the same document, re-read: counted already
            self._offset = int(sd["offset"])

    @property
    def epoch(self) -> int:
        return int(self._pending["reader"]["epoch"]) if self._pending is not None else self.docs.reader.epoch

    def next_window(self, source: int, shard: int) -> Window:
        if self._pending is not None:
            self._restore()
        plan, width = self.plan, self.width
        tokens = np.empty(width, dtype=np.int64)  # documents are copied (and widened) into the window once
        positions = np.empty(width, dtype=np.int64) if plan.positions or plan.debug else None
        uids = np.empty(width, dtype=np.int64) if plan.debug else None
        filled = 0
        while filled < width:
            if self._cur is None:
                self._cur, self._offset = self.docs.next(), 0
            _, uid, doc = self._cur
            off = self._offset
            take = min(width - filled, len(doc) - off)
            tokens[filled:filled + take] = doc[off:off + take]
            if positions is not None:
                positions[filled:filled + take] = np.arange(off, off + take)
            if uids is not None:
                uids[filled:filled + take] = uid
            self._offset = off + take
            filled += take
            if self._offset == len(doc):
                self._cur, self._offset = None, 0
        self.sequences += 1
        return Window(tokens, positions, uids, source, shard)


def _copy_state(sd: dict) -> dict:
    return {"reader": dict(sd["reader"]), "has_doc": bool(sd["has_doc"]), "offset": int(sd["offset"]),
            "stats": dict(sd["stats"]), "sequences": int(sd["sequences"])}


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: the additive step of a Weyl sequence


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class ShardStream:
    """One logical shard: sequence number n of this shard is a pure function of (config, shard, n).

    With several sources, each sequence comes whole from one source, chosen by a Weyl sequence
    u_k = phase(shard) + k * golden (mod 2^64) against the cumulative weights. Every prefix of k choices
    matches the weights to within a couple of sequences (a random draw would be off by ~sqrt(k)), and
    the shard-dependent phase keeps different shards from choosing in lock-step. When the weights
    change on resume the schedule restarts (k = 0) with the new weights.
    """

    def __init__(self, shard: int, plan: DataPlan):
        self.shard, self.plan = shard, plan
        self.n = 0  # sequences produced
        self.k = 0  # schedule position since the weights were last set
        self._packers: dict[int, Packer] = {}
        self._saved: dict[int, dict] = {}
        self._phase = _splitmix64((plan.seed * 1_000_003 + shard) & _MASK64)
        cum, acc = [], 0.0
        for w in plan.weights:
            acc += w
            cum.append(min(1 << 64, int(round(acc * (1 << 64)))))
        cum[-1] = 1 << 64
        self._thresholds = cum

    def packer(self, source: int) -> Packer:
        p = self._packers.get(source)
        if p is None:
            src = self.plan.sources[source]
            p = self._packers[source] = Packer(DocumentTokenizer(DocumentReader(src, self.shard, self.plan), self.plan),
                                               self.plan)
            if source in self._saved:
                p.load_state_dict(self._saved.pop(source))
        return p

    def choose(self) -> int:
        if len(self._thresholds) == 1:
            return 0
        u = (self._phase + self.k * _GOLDEN) & _MASK64
        self.k += 1
        return bisect_right(self._thresholds, u)

    def next(self) -> Window:
        source = self.choose()
        window = self.packer(source).next_window(source, self.shard)
        self.n += 1
        return window

    def state_dict(self) -> dict:
        sources = {str(s): p.state_dict() for s, p in self._packers.items()}
        sources.update({str(s): _copy_state(sd) for s, sd in self._saved.items()})
        return {"n": self.n, "k": self.k, "weights": list(self.plan.weights), "sources": sources}

    def load_state_dict(self, sd: dict) -> None:
        self.n = int(sd["n"])
        same = len(sd["weights"]) == len(self.plan.weights) and all(
            abs(a - b) <= 1e-12 for a, b in zip(sd["weights"], self.plan.weights))
        self.k = int(sd["k"]) if same else 0
        self._packers.clear()
        self._saved = {int(s): _copy_state(v) for s, v in sd["sources"].items()}

    def stats(self) -> dict:
        """Counters of this shard: per source (stats, sequences, epoch) from the live or saved state."""
        out = {}
        for s, sd in self.state_dict()["sources"].items():
            out[int(s)] = {**sd["stats"], "sequences": sd["sequences"], "epoch": int(sd["reader"]["epoch"])}
        return out
