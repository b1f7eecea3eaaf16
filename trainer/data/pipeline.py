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

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from trainer.data.source_base import BLOCK_BYTES, EMPTY, MALFORMED, MISSING_FIELD, OK, UNDECODABLE, Source
from trainer.data.sources import STRIPPED_LEADING, STRIPPED_TRAILING
from trainer.errors import DataError

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
READER_FIELDS = ("epoch", "unit_pos", "block_start", "block_index", "epoch_docs")  # a DocumentReader's state
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

    def token_dtype(self) -> np.dtype:
        """A type that holds every token of every source as stored (what windows can be packed in before they
        are widened to int64): the sources' common integer type, else int64 (text, mixed types)."""
        found = [s.token_dtype() for s in self.sources]
        if not found or any(d is None for d in found):
            return np.dtype(np.int64)
        common = np.result_type(*found)
        return common if common.kind in "iu" and common.itemsize <= 8 else np.dtype(np.int64)

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

    Documents come out one at a time (``next``), or, for a block of stored token arrays whose every document
    can be packed as stored, as the rest of the block at once (``take_block``).
    """

    def __init__(self, source: Source, shard: int, plan: DataPlan):
        self.source, self.shard, self.plan = source, shard, plan
        self.epoch = 0
        self.unit_pos = 0  # position in this epoch's unit order
        self.block_start: int | None = None  # None: the start of the unit's part
        self.block_index = 0  # next position in the block's permutation
        self.epoch_docs = 0  # raw documents read this epoch (0 at the end of an epoch: an empty shard)
        self.last: tuple[int | None, int] = (None, 0)  # unit and coordinate of the document last returned
        self._order: np.ndarray | None = None  # this epoch's unit order
        self._order_epoch: int | None = None
        self._block: list | _NumberedBlock | None = None  # the block's (coordinate, next coordinate, payload)
        self._block_unit = 0
        self._block_next: int | None = None  # where the part's next block starts (None: this one ends it)
        self._perm: np.ndarray | None = None  # the block's reading order
        self._checked = False  # every token of the block is inside the vocabulary (token files)
        self._layout: Layout | None = None  # the block in reading order, when it can be packed as stored

    def where(self) -> dict:
        """Where the document last returned is: its file and byte offset (line sources) or row."""
        unit, coord = self.last
        name = self.source.units[unit] if unit is not None and unit < len(self.source.units) else self.source.label
        return {"file": str(name), "at": int(coord), "bytes": bool(self.source.coords_are_bytes)}

    def position(self) -> tuple:
        """The state as a tuple of the values of READER_FIELDS (cheap: taken with every micro-batch)."""
        return self.epoch, self.unit_pos, self.block_start, self.block_index, self.epoch_docs

    def state_dict(self) -> dict:
        return dict(zip(READER_FIELDS, self.position()))

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.unit_pos = int(sd["epoch"]), int(sd["unit_pos"])
        self.block_start = None if sd["block_start"] is None else int(sd["block_start"])
        self.block_index, self.epoch_docs = int(sd["block_index"]), int(sd["epoch_docs"])
        self._block = self._layout = None
        self._order_epoch = None

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
        docs: list[tuple[int, int, Any]] | _NumberedBlock = []
        full = False
        if src.verbatim:  # stored token arrays: documents lo..hi-1, numbered in the file
            size = max(0, min(plan.shuffle_window, hi - start))
            docs, full = _NumberedBlock(start, size), size >= plan.shuffle_window
        elif start < hi:
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
        # Token files: the whole block's ids checked against the vocabulary at once (else per document).
        self._checked = bool(docs) and src.verbatim and src.check_block(unit, docs[0][0], docs[-1][0])
        self._block_next = docs[-1][1] if full else None  # None: the part ends with this block
        if plan.shuffle and len(docs) > 1:
            self._perm = _rng(plan.seed, src.index, self.shard, self.epoch, unit, start, 2).permutation(len(docs))
        else:
            self._perm = np.arange(len(docs))
        self._layout = block_layout(src, plan, unit, docs[0][0], self._perm) if self._checked else None

    def _reach_document(self) -> None:
        """Load blocks until the current one has a document left (the next block of the part, else the next
        unit, else the next epoch); StopIteration after plan.max_epochs epochs."""
        while True:
            if self._block is None:
                if self.plan.max_epochs is not None and self.epoch >= self.plan.max_epochs:
                    raise StopIteration
                self._load_block()
            if self.block_index < len(self._block):
                return
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

    def next(self) -> Any:
        """The payload of the next document (its unit and coordinate are then ``last``); StopIteration after
        plan.max_epochs epochs."""
        self._reach_document()
        coord, next_coord, payload = self._block[int(self._perm[self.block_index])]
        self.block_index += 1
        self.epoch_docs += 1
        unit = self._block_unit
        self.last = (unit, coord)
        if self._checked:
            return self.source.load_unchecked(unit, coord)
        return self.source.load(unit, coord, next_coord, payload)

    def take_block(self) -> Run | None:
        """The rest of the current block as one run, read at once, when its layout is known (token files whose
        documents are packed as stored); None when the next document must come through ``next``."""
        before = self.position()
        self._reach_document()
        layout = self._layout
        if layout is None:
            return None
        first, n = self.block_index, len(layout.lens)
        read = (self.epoch, self.unit_pos, self.block_start, first + 1, self.epoch_docs + 1)
        self.block_index = n
        self.epoch_docs += n - first
        self.last = (self._block_unit, layout.coords[-1])
        return Run(layout, first, before, read, self._block_unit)


class Run(NamedTuple):
    """Documents ``first``.. of a layout that the reader gave out together: the rest of a block
    (DocumentReader.take_block) or one document (DocumentTokenizer.next_run)."""

    layout: Layout
    first: int
    before: tuple  # the reader's position (DocumentReader.position) just before document ``first`` was read
    read: tuple  # and just after
    unit: int

    def position(self, j: int) -> tuple:
        """The reader's position just before document j of the run (j past the run: where the reader is):
        every document read after the first moves the block index and the epoch's document count by one."""
        if j == self.first:
            return self.before
        epoch, unit_pos, block_start, block_index, epoch_docs = self.read
        n = j - self.first - 1
        return epoch, unit_pos, block_start, block_index + n, epoch_docs + n


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

    def next_run(self, count: bool = True) -> Run:
        """The next documents to pack: the rest of the reader's block when it goes in as stored, else the next
        usable document, with its separator, as a run of one. Skipped (bad) documents, truncations and stripped
        separators are counted here (with ``count``); the packer counts documents and tokens as it starts them."""
        plan, stats, reader = self.plan, self.stats, self.reader
        first_epoch = reader.epoch
        verbatim = reader.source.verbatim
        while True:
            before = reader.position()
            run = reader.take_block()
            if run is not None:
                return run
            payload = reader.next()
            if verbatim and payload is not None and len(payload):  # a stored token array: nothing to decode
                ids, stripped, status = payload, 0, OK
            else:
                status, obj = reader.source.decode(payload)
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
                    stats["last_skipped"] = reader.where()
                if reader.epoch >= first_epoch + 2:
                    raise DataError(
                        f"{reader.source.spec.key} ({reader.source.label}): shard {reader.shard} "
                        f"has no usable document in a whole epoch (skipped: empty {stats['skipped_empty']}, "
                        f"malformed {stats['skipped_malformed']}, undecodable {stats['skipped_undecodable']})"
                        # Malformed JSON-lines or columns usually mean the text is under another name.
                        + (f"; is the text under another field than {reader.source.opts.text_field!r} "
                           "(data.text_field)?" if stats["skipped_malformed"] else "")
                    )
                continue
            if plan.max_document_tokens and len(ids) > plan.max_document_tokens:
                ids = ids[: plan.max_document_tokens]
                if count:
                    stats["truncated_documents"] += 1
            no_eos = verbatim and plan.eos_id is not None and int(ids[-1]) != plan.eos_id
            if no_eos and plan.append_eos:
                doc = np.append(ids.astype(np.int64), plan.eos_id)
            elif verbatim:  # as stored: a view of its file, which the packer copies into the window
                doc = ids
            else:
                doc = self._separated(ids)
            if count:
                stats["stripped_separators"] += stripped
            n = len(doc)
            unit, coord = reader.last
            long = n > plan.long_document_windows * (plan.seq_len + 1)
            layout = Layout(doc, None, [0], [n], [n], [coord], [n], [1] if no_eos else None, [1] if long else None)
            return Run(layout, 0, before, reader.position(), unit)

    def _separated(self, ids: np.ndarray) -> np.ndarray:
        plan = self.plan
        doc = np.empty(len(ids) + 1, dtype=np.int64)
        if plan.separator == "bos":
            doc[0], doc[1:] = plan.separator_id, ids
        else:
            doc[:-1], doc[-1] = ids, plan.separator_id
        return doc


class _NumberedBlock:
    """The block of documents start..start+size-1 of a token file, as the list of (coordinate, next
    coordinate, payload) that iter_docs would give, without making it."""

    __slots__ = ("start", "size")

    def __init__(self, start: int, size: int):
        self.start, self.size = start, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[int, int, None]:
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError(i)
        return self.start + i, self.start + i + 1, None


class Layout(NamedTuple):
    """Documents in reading order, every one non-empty: document i is ``base[starts[i]:starts[i] + lens[i]]``
    (or ``views[i]``), with the numbers in its file (``coords``) and cumulative sums of lengths and of the
    counters they add, so that a run of documents is counted with two lookups."""

    # (lists of Python ints: indexed one element at a time)
    base: np.ndarray | None
    views: list | None
    starts: list | None
    ends: list | None  # starts + lens
    lens: list
    coords: list  # document coordinates (numbers in the file for token files)
    cum: list
    cum_no_eos: list | None  # None: no such document
    cum_long: list | None


def block_layout(src: Source, plan: DataPlan, unit: int, first: int, perm: np.ndarray) -> Layout | None:
    """The layout of a checked block of token-file documents first.. (file order) read in ``perm`` order, or
    None where the documents must go one by one (a null or empty document, truncation, EOS to append, no known
    layout)."""
    found = src.layout(unit, first, first + len(perm))
    if found is None:
        return None
    base, starts, lens = found
    lens = np.asarray(lens, dtype=np.int64)[perm]
    if int(lens.min()) <= 0 or (plan.max_document_tokens and int(lens.max()) > plan.max_document_tokens):
        return None
    views = None
    if starts is None:
        views, base = [base[i] for i in perm], None
        last = np.fromiter((v[-1] for v in views), dtype=np.int64, count=len(views))
    else:
        starts = np.asarray(starts, dtype=np.int64)[perm]
        last = base[starts + lens - 1]
    no_eos = (last != plan.eos_id) if plan.eos_id is not None else np.zeros(len(lens), dtype=bool)
    if plan.append_eos and no_eos.any():
        return None
    long = lens > plan.long_document_windows * (plan.seq_len + 1)
    return Layout(base, views, None if starts is None else starts.tolist(),
                  None if starts is None else (starts + lens).tolist(), lens.tolist(),
                  (first + np.asarray(perm, dtype=np.int64)).tolist(), np.cumsum(lens).tolist(),
                  np.cumsum(no_eos).tolist() if no_eos.any() else None,
                  np.cumsum(long).tolist() if long.any() else None)


class Window(NamedTuple):
    """One packed sequence of seq_len + 1 tokens (inputs are [:-1], labels [1:])."""

    tokens: np.ndarray
    positions: np.ndarray | None  # position of each token inside its document
    doc_ids: np.ndarray | None  # document id of each token
    source: int
    shard: int


class Packer:
    """Concatenate one source's documents (of one shard) and cut windows of seq_len + 1 tokens.

    Documents come in runs (DocumentTokenizer.next_run): the rest of a block of token-file documents, or one
    document. The packer is at document ``_doc`` of its run, ``_offset`` tokens into it (0: not started, so not
    counted yet); its state is the reader's position before that document (Run.position) and the offset."""

    def __init__(self, docs: DocumentTokenizer, plan: DataPlan):
        self.docs, self.plan = docs, plan
        self.width = plan.seq_len + 1
        self.sequences = 0
        self._run: Run | None = None
        self._doc = 0
        self._offset = 0
        self._pending: dict | None = None

    def state_dict(self) -> dict:
        if self._pending is not None:
            return _copy_state(self._pending)
        return packer_state(self.snapshot())

    def load_state_dict(self, sd: dict) -> None:
        # Applied lazily (in the process that reads), so loading a state costs nothing up front.
        self._pending = _copy_state(sd)
        self._run = None

    def _restore(self) -> None:
        sd, self._pending = self._pending, None
        self.docs.stats = {k: int(sd["stats"].get(k, 0)) for k in STAT_KEYS}
        if sd["stats"].get("last_skipped"):  # where the last skipped document was (for the error message)
            self.docs.stats["last_skipped"] = dict(sd["stats"]["last_skipped"])
        self.sequences = int(sd["sequences"])
        self.docs.reader.load_state_dict(sd["reader"])
        if sd["has_doc"]:
            run = self._run = self.docs.next_run(count=False)  # the same document, re-read: counted already
            self._doc, self._offset = run.first, int(sd["offset"])

    @property
    def epoch(self) -> int:
        return int(self._pending["reader"]["epoch"]) if self._pending is not None else self.docs.reader.epoch

    def fill(self, tokens: np.ndarray, positions: np.ndarray | None = None, uids: np.ndarray | None = None) -> None:
        """The next window's seq_len + 1 tokens into ``tokens`` (and each token's position in its document and
        document id into ``positions`` and ``uids`` when given); StopIteration at the end of the data (one pass)."""
        if self._pending is not None:
            self._restore()
        filled = 0
        while filled < self.width:
            run = self._run
            if run is None or self._doc == len(run.layout.lens):
                run = self._run = self.docs.next_run()
                self._doc, self._offset = run.first, 0
            filled = self._pack(run, tokens, positions, uids, filled)
        self.sequences += 1

    def _pack(self, run: Run, tokens, positions, uids, filled: int) -> int:
        """Fill the window from the run, from the document in progress, as far as the run or the window goes,
        with one copy call when neither positions nor ids are asked for; count the documents started."""
        layout = run.layout
        cum, lens = layout.cum, layout.lens
        first, off = self._doc, self._offset
        pos = (cum[first - 1] if first else 0) + off  # where the window goes on, in tokens of the layout
        end = pos + self.width - filled
        k = bisect_left(cum, end, first)  # the document the window ends in
        if k >= len(lens):
            k = len(lens) - 1
            end = cum[k]
        take_k = end - (cum[k - 1] if k else 0)  # tokens of document k up to the window's end
        base, starts = layout.base, layout.starts
        if positions is None and uids is None and base is not None:
            size = end - pos
            if k == first:
                a = starts[k] + off
                tokens[filled:filled + size] = base[a:a + size]
            else:
                parts = [base[starts[first] + off:layout.ends[first]]]
                parts += [base[s:e] for s, e in zip(starts[first + 1:k], layout.ends[first + 1:k])]
                a = starts[k]
                parts.append(base[a:a + take_k])
                np.concatenate(parts, out=tokens[filled:filled + size])
            filled += size
        else:
            reader, views, coords = self.docs.reader, layout.views, layout.coords
            for j in range(first, k + 1):
                lo = off if j == first else 0
                hi = take_k if j == k else lens[j]
                take = hi - lo
                if base is not None:
                    a = starts[j]
                    tokens[filled:filled + take] = base[a + lo:a + hi]
                else:
                    tokens[filled:filled + take] = views[j][lo:hi]
                if positions is not None:
                    positions[filled:filled + take] = np.arange(lo, hi)
                if uids is not None:
                    uids[filled:filled + take] = reader.source.uid(run.unit, coords[j], reader.shard)
                filled += take
        started = first + 1 if off else first  # the first document not counted yet
        if k >= started:
            self._count(layout, started, k)
        if take_k < lens[k]:  # document k goes on in the next window
            self._doc, self._offset = k, take_k
        else:
            self._doc, self._offset = k + 1, 0
        return filled

    def _count(self, layout: Layout, i: int, k: int) -> None:
        """Documents i..k of the layout are started: their number, tokens, and those without EOS or long."""
        stats = self.docs.stats
        stats["documents"] += k - i + 1
        stats["tokens"] += layout.cum[k] - (layout.cum[i - 1] if i else 0)
        c = layout.cum_no_eos
        if c is not None:
            stats["documents_without_eos"] += c[k] - (c[i - 1] if i else 0)
        c = layout.cum_long
        if c is not None:
            stats["long_documents"] += c[k] - (c[i - 1] if i else 0)

    def snapshot(self) -> tuple:
        """What ``state_dict()`` would return now, cheaply (see :func:`packer_state`): the reader's position
        before the document in progress (or after the last one read), whether one is in progress and its offset,
        and a copy of the counters."""
        if self._pending is not None:
            return (self._pending,)  # (replaced, never changed, when applied)
        run = self._run
        position = self.docs.reader.position() if run is None else run.position(self._doc)
        return position, self._offset > 0, self._offset, self.docs.stats.copy(), self.sequences


def packer_state(snap: tuple) -> dict:
    """The state dict of a Packer.snapshot()."""
    if len(snap) == 1:
        return _copy_state(snap[0])
    reader, has_doc, offset, stats, sequences = snap
    return {"reader": dict(zip(READER_FIELDS, reader)), "has_doc": has_doc, "offset": offset, "stats": dict(stats), "sequences": sequences}


def shard_state(snap: tuple) -> dict:
    """The state dict of a ShardStream.snapshot()."""
    n, k, weights, packers, saved = snap
    sources = {str(s): packer_state(p) for s, p in packers}
    sources.update({str(s): _copy_state(sd) for s, sd in saved})
    return {"n": n, "k": k, "weights": list(weights), "sources": sources}


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

    def fill(self, tokens: np.ndarray, positions: np.ndarray | None = None, uids: np.ndarray | None = None) -> int:
        """The next sequence into ``tokens`` (seq_len + 1 of any integer type that holds the tokens; positions
        and document ids into ``positions`` and ``uids`` when given, int64); returns its source."""
        source = self.choose()
        self.packer(source).fill(tokens, positions, uids)
        self.n += 1
        return source

    def next(self) -> Window:
        """The next sequence as a Window of its own arrays (positions with data.document_positions or
        data.debug_doc_ids, document ids with data.debug_doc_ids)."""
        plan, width = self.plan, self.plan.seq_len + 1
        tokens = np.empty(width, dtype=np.int64)
        positions = np.empty(width, dtype=np.int64) if plan.positions or plan.debug else None
        uids = np.empty(width, dtype=np.int64) if plan.debug else None
        source = self.fill(tokens, positions, uids)
        return Window(tokens, positions, uids, source, self.shard)

    def state_dict(self) -> dict:
        return shard_state(self.snapshot())

    def snapshot(self) -> tuple:
        """The state as of now at the cost of a few tuples; :func:`shard_state` turns it into what
        ``state_dict()`` returns now. A micro-batch carries one per shard it read."""
        return (self.n, self.k, self.plan.weights, [(s, p.snapshot()) for s, p in self._packers.items()],
                list(self._saved.items()) if self._saved else ())

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
