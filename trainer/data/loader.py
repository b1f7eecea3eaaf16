"""Loaders: the sharded training stream over data-parallel ranks and workers, its state, validation.

The global stream
-----------------
There are N = data.num_shards logical shards (ShardStream). Global sequence number i is sequence
number i // N of shard i % N, and global step k is made of the global sequences [k*G, (k+1)*G) with G
the global batch size. None of this mentions the number of ranks W or of loader workers, so every step
trains on the same set of sequences for any W and any number of workers (invariant 1).

Rank r takes the global sequences i = W*l + r (l = 0, 1, ... its local sequence number), which all come
from the shards j with j % W == r (W divides N), in micro-batches of local_batch_size consecutive l.
Loader worker w of K takes the rank's micro-batches w, w + K, ... (the order in which
StatefulDataLoader hands them out). When N is a multiple of W * local_batch_size * K every shard is read
by exactly one worker; otherwise a worker also skips through sequences of shared shards that other
workers produce (same result, more tokenizing) and the loader logs a warning.

State
-----
Everything a shard needs to continue is its ShardStream state (a few integers per source), so the state
of a rank is {local sequences consumed, states of its shards}; the states of all ranks merge into one
global state {global sequences consumed, states of all shards}, which any number of ranks W' dividing N
can load (rank r' takes the shards j % W' == r'). Nothing is read twice or skipped: each shard continues
exactly where it stopped.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import warnings
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from trainer.data.prefetch import Prefetcher
from trainer.config.derive import run_seed
from trainer.errors import ConfigError, DataError, DataStateError
from trainer.data.checks import batch_geometry
from trainer.fingerprint import split_fingerprint
from trainer.data.pipeline import STAT_KEYS, DataPlan, ShardStream, shard_state
from trainer.data.source_base import SourceOptions, SourceSpec
from trainer.data.sources import build_source, training_specs, validation_spec

logger = logging.getLogger(__name__)

STATE_FORMAT = "trainer.data/1"
_STATE_KEY = "trainer_data_state"
_PROBE = "The quick brown fox jumps over the lazy dog. 0123 àéîõü 日本語\n\tend."


# --------------------------------------------------------------------------------------------------
# Building a plan from the config
# --------------------------------------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer) -> dict:
    """Identifies a tokenizer well enough to refuse pre-tokenized data made with another one: its size,
    BOS/EOS, an encoded probe text and a hash of its whole vocabulary (a difference in one id shows).
    ``path`` only names it in messages (the same tokenizer may live elsewhere)."""
    from tokenizer import vocabulary_digest

    probe = hashlib.sha1(np.asarray(tokenizer.encode(_PROBE), dtype=np.int64).tobytes()).hexdigest()[:16]
    return {"vocab_size": int(tokenizer.vocab_size), "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id,
            "probe": probe, "vocabulary": vocabulary_digest(tokenizer), "path": str(getattr(tokenizer, "path", ""))}


def check_prepared_tokenizer(spec, have: dict, want: dict) -> None:
    """Refuse prepared tokens made with a tokenizer other than the run's: one line naming both. ``path`` is
    not compared (the same tokenizer may have moved); a folder prepared before vocabulary hashes were
    recorded is compared on what it recorded."""
    if not want:
        return
    keys = [k for k in want if k != "path" and (k in have or k != "vocabulary")]
    differ = [k for k in keys if have.get(k) != want[k]]
    if differ:
        raise ConfigError(
            f"{spec.key}: {spec.path!r} was prepared with tokenizer {have.get('path') or '(path not recorded)'} "
            f"but this run's is {want.get('path') or '(unnamed)'}, and they differ in "
            + ", ".join(f"{k} ({have.get(k)} vs {want[k]})" for k in differ)
            + "; prepare the data again with this run's tokenizer (trainer data prepare) or set "
              "model.tokenizer_path to the one it was prepared with"
        )


def data_seed(config) -> int:
    if config.data.seed is not None:
        return int(config.data.seed)
    return run_seed(config)


def _empty_shards(src, num_shards: int) -> list[int]:
    """The shards of ``num_shards`` in which no document of ``src`` starts; [] when too costly to know."""
    if src.partition == "modulo" and len(src.units) < num_shards:
        return list(range(len(src.units), num_shards))
    if src.check_cost() * num_shards > 100_000:
        return []
    return [j for j in range(num_shards) if src.shard_is_empty(j, num_shards)]


def _check_shards(src, num_shards: int, text_field: str) -> None:
    """Too many shards for small data is a likely mistake: say so now rather than at the first batch."""
    empty = _empty_shards(src, num_shards)
    if src.partition == "modulo" and len(src.units) < num_shards:
        raise ConfigError(
            f"{src.spec.key}: {len(src.units)} files, one document each (data.text_document = file), cannot "
            f"feed data.num_shards = {num_shards} shards; lower data.num_shards or use more files"
        )
    if empty and len(empty) == num_shards:  # no shard count helps: the data itself is empty
        raise ConfigError(f"{src.spec.key}: {src.label} holds no document (an empty file, or none with "
                          f"text in data.text_field {text_field!r})")
    if empty:
        raise ConfigError(
            f"{src.spec.key}: {src.label} is too small for data.num_shards = {num_shards}: {len(empty)} "
            f"shard(s) would hold no document (e.g. shard {empty[0]}); lower data.num_shards"
        )


def _fitting_shards(sources, num_shards: int, multiple: int) -> int:
    """data.num_shards left at its default: the largest count up to it, a multiple of the data-parallel
    degree, that gives every shard of every source a document; said in one line when lower than the
    default. The same data gives the same count on every rank and launch."""
    if not any(_empty_shards(src, num_shards) for src in sources):
        return num_shards
    for n in range(num_shards - num_shards % multiple, 0, -multiple):
        if not any(_empty_shards(src, n) for src in sources):
            small = next(src for src in sources if _empty_shards(src, num_shards))
            logger.info("data.num_shards: %s holds too few documents for the default %d shards; using %d "
                        "(set data.num_shards to choose)", small.label, num_shards, n)
            return n
    small = next(src for src in sources if _empty_shards(src, multiple))
    if len(_empty_shards(small, multiple)) == multiple:
        return num_shards  # no document at all: the check says so
    raise ConfigError(f"{small.spec.key}: {small.label} holds too few documents for {multiple} data-parallel ranks "
                      "(data.num_shards must be a multiple of their number): add data or train on fewer ranks")


def build_plan(config, tokenizer, specs: list[SourceSpec], weights: list[float], *, num_shards: int,
               shuffle: bool, max_epochs: int | None, seq_len: int | None = None,
               shard_multiple: int | None = None) -> DataPlan:
    """Resolve sources (start-up errors for missing files happen here) and the packing settings.
    ``shard_multiple`` (data.num_shards not set by the user): ``num_shards`` may be lowered to the largest
    multiple of it that the data fills (:func:`_fitting_shards`)."""
    d = config.data
    from tokenizer.policy import run_separator

    try:
        chosen = run_separator(config, tokenizer)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if chosen.note and not all(s.kind in ("megatron", "numpy") for s in specs):
        logger.info(chosen.note)  # (token files are trained as stored: the separator does not apply to them)
    separator, sep_id = chosen.name, chosen.token_id
    seed = data_seed(config)
    fingerprint = tokenizer_fingerprint(tokenizer) if any(s.kind == "tokens" for s in specs) else {}
    opts = SourceOptions(text_field=d.text_field, text_document=d.text_document, seed=seed, shuffle=shuffle,
                         shuffle_window=d.shuffle_window,
                         tokens_field=d.tokens_field, numpy_dtype=d.numpy_dtype, eos_id=tokenizer.eos_id,
                         vocab_size=model_vocab(config, tokenizer), tokenizer_vocab=int(tokenizer.vocab_size))
    sources = [build_source(spec, i, opts) for i, spec in enumerate(specs)]
    if d.separator != "auto" and all(src.verbatim for src in sources):
        logger.info("data.separator = %s adds nothing to these token files (trained as stored, with the separators "
                    "they hold); exports and evaluation follow it", d.separator)
    for src in sources:
        if src.kind == "tokens":
            check_prepared_tokenizer(src.spec, src.meta.get("tokenizer", {}), fingerprint)
    if shard_multiple is not None:
        num_shards = _fitting_shards(sources, num_shards, shard_multiple)
    for src in sources:
        _check_shards(src, num_shards, d.text_field)
    strip = tuple(t for t in (tokenizer.bos_id, tokenizer.eos_id) if t is not None)
    return DataPlan(
        sources=sources, weights=list(weights), tokenizer=tokenizer, seq_len=int(seq_len or config.training.seq_len),
        separator=separator, separator_id=int(sep_id), strip_ids=strip, num_shards=num_shards, seed=seed,
        shuffle=shuffle, shuffle_window=d.shuffle_window, max_document_tokens=d.max_document_tokens,
        long_document_windows=d.long_document_windows, positions=d.document_positions or block_causal(config),
        debug=d.debug_doc_ids,
        max_epochs=max_epochs, append_eos=d.append_eos, eos_id=tokenizer.eos_id,
    )


def block_causal(config) -> bool:
    """Attention limited to each document (model.attn_mask_type): the batches then carry document positions."""
    model = getattr(config, "model", None)
    return getattr(model, "attn_mask_type", "causal") == "block_causal"


def model_vocab(config, tokenizer) -> int:
    """The model's vocabulary (embedding rows): pre-tokenized documents must hold ids below it."""
    from trainer.models.config import resolve_model_args

    try:
        return int(resolve_model_args(config, int(tokenizer.vocab_size)).vocab_size)
    except ConfigError:
        return int(tokenizer.vocab_size)  # the trainer reports the mismatch itself when it builds the model


# --------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------


def batch_arrays(plan: DataPlan, tokens: np.ndarray, positions: np.ndarray | None = None,
                 doc_ids: np.ndarray | None = None, sources=None, shards=None) -> dict[str, np.ndarray]:
    """A micro-batch's int64 arrays from its packed windows (rows of seq_len + 1; ``tokens`` of any integer
    type): input/labels [B, seq_len] (labels = input shifted by one), positions [B, seq_len] with
    data.document_positions, and with data.debug_doc_ids the document ids and positions of every window token and
    each row's source and shard. All copies: the rows may be reused."""
    batch = {"input": tokens[:, :-1].astype(np.int64), "labels": tokens[:, 1:].astype(np.int64)}
    if plan.positions:
        batch["positions"] = positions[:, :-1].copy()
    if plan.debug:
        batch["doc_ids"] = doc_ids.copy()
        batch["doc_positions"] = positions.copy()
        batch["source"] = np.array(sources, dtype=np.int64)
        batch["shard"] = np.array(shards, dtype=np.int64)
    return batch


def window_rows(plan: DataPlan, rows: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Buffers for ``rows`` windows: tokens in the type the sources store them in (copies of documents into it
    move fewer bytes; text: int64), and int64 positions and document ids when the plan asks for them."""
    width = plan.seq_len + 1
    positions = np.empty((rows, width), dtype=np.int64) if plan.positions or plan.debug else None
    doc_ids = np.empty((rows, width), dtype=np.int64) if plan.debug else None
    return np.empty((rows, width), dtype=plan.token_dtype()), positions, doc_ids


class MicroBatch(dict):
    """A micro-batch's tensors by name, with ``fingerprint``: the hash of its sequences (see
    trainer/fingerprint.py), computed where the batch is made so that the training thread never does."""

    fingerprint: int | None = None


def to_tensors(batch: dict[str, np.ndarray], pin_memory: bool = False, into: dict | None = None) -> dict:
    """The arrays as tensors sharing their memory (pinned copies with ``pin_memory``), put into ``into`` (a
    new dict by default)."""
    out = {} if into is None else into
    for k, v in batch.items():
        out[k] = torch.from_numpy(v).pin_memory() if pin_memory else torch.from_numpy(v)
    return out


def _keep(batch):
    # Workers send numpy arrays: pickled through the worker's pipe, which for batches of this size is
    # much cheaper than sharing every tensor through its own shared-memory file descriptor.
    return batch


class _RankDataset(IterableDataset):
    """One rank's micro-batches; inside loader worker w of K, only micro-batches w, w+K, ... ."""

    def __init__(self, plan: DataPlan, rank: int, world: int, batch_size: int, start: dict, snapshots: bool = True):
        self.plan, self.rank, self.world, self.batch_size = plan, rank, world, batch_size
        # snapshots=False: micro-batches carry no states, the reader takes them from the live streams (only right
        # when each micro-batch is consumed as soon as it is made: no worker process, no prefetch thread).
        self.snapshots = snapshots
        self.failed = False  # an error stopped a micro-batch half made: the live streams are past it
        self.start = start  # {"sequences": local sequences consumed, "shards": {str(j): ShardStream state}}
        self._streams: dict[int, ShardStream] = {}
        self._replayed = 0  # sequences generated only to skip them (shards shared between workers)

    # Stateful protocol (StatefulDataLoader.state_dict, on demand). TrainLoader does not use it: every
    # micro-batch carries the states of the shards it came from (see __iter__), which is exactly the state
    # after that micro-batch, wherever and however far ahead it was made, and costs a few small dicts
    # instead of a snapshot of the whole loader after every micro-batch. The state travels as one JSON
    # string: StatefulDataLoader flattens nested states key by key to diff them.
    def state_dict(self) -> dict:
        state = {"shards": {str(j): s.state_dict() for j, s in self._streams.items()}, "replayed": self._replayed}
        return {_STATE_KEY: json.dumps(state, separators=(",", ":"))}

    def load_state_dict(self, sd: dict) -> None:
        # Only reached through StatefulDataLoader.load_state_dict, which TrainLoader never calls: a
        # TrainLoader restarts its loader from its own (re-partitionable) state instead.
        for j, st in json.loads(sd[_STATE_KEY])["shards"].items():
            self.start["shards"][j] = st

    def _stream(self, j: int) -> ShardStream:
        stream = self._streams.get(j)
        if stream is None:
            stream = self._streams[j] = ShardStream(j, self.plan)
            saved = self.start["shards"].get(str(j))
            if saved is not None:
                stream.load_state_dict(saved)
        return stream

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        n_shards, world, rank, b = self.plan.num_shards, self.world, self.rank, self.batch_size
        self._streams, self._replayed = {}, 0
        streams = self._streams
        first = int(self.start["sequences"])
        micro = worker
        keys = [str(j) for j in range(n_shards)]
        # The windows are packed into the rows of buffers reused for every micro-batch (see window_rows); the
        # micro-batch's arrays are copies of them.
        tokens, positions, doc_ids = window_rows(self.plan, b)
        spare = np.empty_like(tokens[0])  # (windows only skipped)
        sources, shards = [0] * b, [0] * b
        snapshots = self.snapshots
        touched: dict = {}
        while True:
            self.failed = True  # while a micro-batch is being made
            if snapshots:
                touched = {}
            i = world * (first + micro * b) + rank  # global sequence number of the first row
            for row in range(b):
                j = i % n_shards
                stream, n = streams.get(j) or self._stream(j), i // n_shards
                if stream.n != n:
                    if stream.n > n:
                        raise DataError(f"data state of shard {j} is ahead of the loader ({stream.n} > {n})")
                    while stream.n < n:  # only when loader workers share a shard (see the module docstring)
                        stream.fill(spare)
                        self._replayed += 1
                sources[row] = stream.fill(tokens[row], None if positions is None else positions[row],
                                           None if doc_ids is None else doc_ids[row])
                shards[row] = j
                if snapshots:
                    touched[j] = stream
                i += world
            micro += num_workers
            # The micro-batch, its fingerprint, and the states after it of the shards it came from (snapshots:
            # nothing the stream changes later; TrainLoader makes state dicts of them only when asked), with
            # this worker's replay counter.
            states = {keys[j]: st.snapshot() for j, st in touched.items()} if snapshots else None
            arrays = batch_arrays(self.plan, tokens, positions, doc_ids, sources, shards)
            fingerprint = split_fingerprint(arrays["input"], arrays["labels"][:, -1])
            self.failed = False
            yield arrays, fingerprint, (worker, self._replayed, states)


# --------------------------------------------------------------------------------------------------
# Training loader
# --------------------------------------------------------------------------------------------------


class TrainLoader:
    """The training micro-batches of one data-parallel rank (an endless iterator).

    Each ``next()`` gives one micro-batch: {"input", "labels"} (LongTensor [local_batch_size, seq_len]),
    plus "positions" with data.document_positions and debugging tensors with data.debug_doc_ids. The
    trainer draws ``grad_accum_steps`` micro-batches per optimizer step.

    ``state_dict()`` is this rank's state (JSON-able); ``merge_states([...])`` of all ranks' states is a
    global state that ``load_state_dict`` / ``load_global_state`` accept with any data-parallel degree
    dividing data.num_shards (and the same micro-batch alignment).
    """

    def __init__(self, plan: DataPlan, *, dp_rank: int, dp_world_size: int, local_batch_size: int,
                 global_batch_size: int, num_workers: int = 0, prefetch_factor: int = 2, pin_memory: bool = False,
                 prefetch_batches: int = 0):
        self.plan = plan
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.local_batch_size, self.global_batch_size = local_batch_size, global_batch_size
        self.grad_accum_steps = global_batch_size // (local_batch_size * dp_world_size)
        self.num_workers, self.prefetch_factor, self.pin_memory = num_workers, prefetch_factor, pin_memory
        self.prefetch_batches = prefetch_batches
        self._start: dict = {"sequences": 0, "shards": {}}
        self._loader = None
        self._iter = None
        self._live: _RankDataset | None = None
        self._lost: str | None = None  # why the position is not known (closed after an error mid-micro-batch)
        self._prefetcher: Prefetcher | None = None
        # The states of the shards read since the start, as of the last micro-batch handed out that read each
        # (shards advance with the micro-batch number, so that is each one's newest), and the replay counter
        # of each loader worker.
        self._consumed_shards: dict[str, tuple] = {}  # snapshots (pipeline.ShardStream.snapshot)
        self._replayed: dict[int, int] = {}
        self._yielded = 0

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        """Same as the module-level merge_states."""
        return merge_states(states)

    def __iter__(self):
        # Start loading now (and prefetching, with prefetch_batches), before the first batch is asked for.
        if self._iter is None:
            self._start_loader()
        return self

    def __next__(self) -> MicroBatch:
        if self._iter is None:
            self._start_loader()
        batch, (worker, replayed, shards) = self._prefetcher.get() if self._prefetcher else self._produce()
        if shards is not None:
            self._consumed_shards.update(shards)
        self._replayed[worker] = replayed
        self._yielded += 1
        return batch

    def _start_loader(self) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        if self._lost:
            raise DataStateError(self._lost)

        # In this process with nothing made ahead, the state is read from the dataset's live streams when asked
        # for; otherwise every micro-batch carries the states of its shards.
        live = self.num_workers == 0 and self.prefetch_batches == 0
        dataset = _RankDataset(self.plan, self.dp_rank, self.dp_world_size, self.local_batch_size,
                               copy.deepcopy(self._start), snapshots=not live)
        self._live = dataset if live else None
        if self.num_workers == 0:
            # In this process: StatefulDataLoader would only hand the dataset's micro-batches through (its
            # per-batch bookkeeping was a sixth of the loader's time on token files), so iterate the dataset.
            self._loader, self._iter = None, iter(dataset)
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch >= 2.9
                # No snapshots: each micro-batch brings its own state (see _RankDataset.state_dict).
                self._loader = StatefulDataLoader(dataset, batch_size=None, num_workers=self.num_workers,
                                                  collate_fn=_keep, snapshot_every_n_steps=0,
                                                  prefetch_factor=self.prefetch_factor, persistent_workers=False)
                self._iter = iter(self._loader)
        self._yielded = 0
        if self.prefetch_batches > 0:
            self._prefetcher = Prefetcher(self._produce, self.prefetch_batches)

    def _produce(self) -> tuple[MicroBatch, tuple]:
        """The next micro-batch (tensors, pinned if asked, with its fingerprint) and what it brings of the
        state (runs on the prefetch thread when there is one)."""
        arrays, fingerprint, update = next(self._iter)
        batch = to_tensors(arrays, self.pin_memory, into=MicroBatch())
        batch.fingerprint = fingerprint
        return batch, update

    def close(self) -> None:
        """Stop the worker processes and the prefetch thread (the next ``next()`` starts them again from the
        current state). The training loop closes its loader at the end of a run."""
        if self._iter is not None:
            try:
                state = self.state_dict()
                self._start = {"sequences": state["sequences"], "shards": state["shards"]}
            except DataStateError as e:  # (closing after an error: the loader cannot go on, nor say where it is)
                self._lost = str(e)
        self._reset()

    def _reset(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        self._consumed_shards, self._replayed = {}, {}
        self._live = None
        self._iter = None
        self._loader = None
        self._yielded = 0

    # -- state ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's position: local sequences consumed and the state of each of its shards."""
        if self._lost:
            raise DataStateError(self._lost)
        shards = copy.deepcopy(self._start["shards"])
        if self._live is not None and not self._live.failed:
            shards.update({str(j): s.state_dict() for j, s in self._live._streams.items()})
        elif self._live is not None and self._yielded:  # (before the first micro-batch: the start state)
            raise DataStateError("the data loader stopped on an error in the middle of a micro-batch: its position "
                                 "is not known; resume from the last checkpoint")
        shards.update({j: shard_state(snap) for j, snap in self._consumed_shards.items()})
        return {
            "format": STATE_FORMAT, "kind": "rank", "fingerprint": self.plan.fingerprint(),
            "num_shards": self.plan.num_shards, "dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size,
            "local_batch_size": self.local_batch_size,
            "sequences": int(self._start["sequences"]) + self._yielded * self.local_batch_size,
            "shards": shards,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a state of this rank (same data-parallel layout) or from a global state."""
        self._check(state)
        if state["kind"] == "global":
            self.load_global_state(state)
            return
        if (state["dp_world_size"], state["dp_rank"]) != (self.dp_world_size, self.dp_rank):
            raise DataStateError(
                f"data state of rank {state['dp_rank']} of {state['dp_world_size']} cannot be loaded by rank "
                f"{self.dp_rank} of {self.dp_world_size}; save merge_states([...]) of all ranks and load that"
            )
        self._start = {"sequences": int(state["sequences"]), "shards": copy.deepcopy(state["shards"])}
        self._lost = None
        self._reset()

    def load_global_state(self, state: dict) -> None:
        """Take this rank's shards (j % dp_world_size == dp_rank) of a merged state, for any world size."""
        self._check(state)
        if state["kind"] != "global":
            raise DataStateError("load_global_state needs a merged state: merge_states([...]) of all ranks")
        total, world = int(state["sequences"]), self.dp_world_size
        if total % world or (total // world) % self.local_batch_size:
            raise DataStateError(
                f"the data state is at global sequence {total}, which is not a micro-batch boundary for "
                f"{world} ranks x local_batch_size {self.local_batch_size}; save it at a step boundary"
            )
        shards = {j: copy.deepcopy(st) for j, st in state["shards"].items() if int(j) % world == self.dp_rank}
        self._start = {"sequences": total // world, "shards": shards}
        self._lost = None
        self._reset()

    def _check(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise DataStateError(f"not a data-loader state of format {STATE_FORMAT!r}")
        if state["num_shards"] != self.plan.num_shards:
            raise DataStateError(
                f"the data state has {state['num_shards']} shards but data.num_shards is {self.plan.num_shards}; "
                "keep data.num_shards fixed for a run"
            )
        _check_fingerprint(state["fingerprint"], self.plan.fingerprint())

    # -- counters -------------------------------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """Counters of this rank's shards so far (see aggregate_stats)."""
        state = self.state_dict()
        owned = [j for j in range(self.plan.num_shards) if j % self.dp_world_size == self.dp_rank]
        stats = aggregate_stats(state["shards"], self.plan, owned)
        replayed = sum(self._replayed.values())
        # Sequences generated and thrown away to reach a shard's position: 0 unless loader workers share
        # shards (see build_train_loader's warning) or a state lacked a shard.
        stats["replayed_sequences"] = replayed
        return stats


def _check_fingerprint(saved: dict, current: dict) -> None:
    if saved == current:
        return
    diffs = [k for k in current if saved.get(k) != current.get(k)]
    detail = "; ".join(f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in diffs)
    raise DataStateError(f"the data changed since the data state was saved ({detail})")


def merge_states(states: list[dict], ranks: list[int] | None = None) -> dict:
    """Merge the state_dict() of every data-parallel rank (any order) into one global state.

    Pure Python on JSON-able dicts: the checkpoint manager all-gathers the per-rank states at save time and stores the
    result, which TrainLoader.load_state_dict / load_global_state load with any data-parallel degree.
    ``ranks``: the ranks whose states these are, when a process group holds only some of them (a replica group
    of a fault-tolerant job: its part of the stream); the result then has only their shards.
    """
    states = list(states)
    if not states:
        raise DataStateError("merge_states needs at least one state")
    if len(states) == 1 and states[0].get("kind") == "global":
        return copy.deepcopy(states[0])
    for s in states:
        if not isinstance(s, dict) or s.get("format") != STATE_FORMAT or s.get("kind") != "rank":
            raise DataStateError("merge_states takes the state_dict() of every rank")
    world = states[0]["dp_world_size"]
    expected = list(range(world)) if ranks is None else sorted(ranks)
    got = sorted(s["dp_rank"] for s in states)
    if got != expected or any(s["dp_world_size"] != world for s in states):
        which = f"the {world} ranks" if ranks is None else f"the ranks {expected[0]}..{expected[-1]} of {world}"
        raise DataStateError(f"merge_states needs exactly one state of each of {which}, got ranks {got}")
    positions = {s["sequences"] for s in states}
    if len(positions) != 1:
        raise DataStateError(f"the ranks' data states are at different positions ({sorted(positions)} sequences)")
    for s in states[1:]:
        _check_fingerprint(s["fingerprint"], states[0]["fingerprint"])
        if s["num_shards"] != states[0]["num_shards"]:
            raise DataStateError("the ranks' data states have different shard counts")
    shards: dict[str, dict] = {}
    for s in states:
        shards.update(copy.deepcopy(s["shards"]))
    return {"format": STATE_FORMAT, "kind": "global", "fingerprint": copy.deepcopy(states[0]["fingerprint"]),
            "num_shards": states[0]["num_shards"], "sequences": world * positions.pop(), "shards": shards}


def aggregate_stats(shard_states: dict, plan: DataPlan, shards: list[int] | None = None) -> dict:
    """Sum the counters of shard states: documents, tokens, sequences, skipped_* , long/truncated,
    epoch (completed epochs of the slowest shard-source with weight > 0), and per-source shares."""
    total = dict.fromkeys(STAT_KEYS, 0)
    total["sequences"] = 0
    per_source = [{"source": s.label, "weight": w, "sequences": 0, "documents": 0, "tokens": 0}
                  for s, w in zip(plan.sources, plan.weights)]
    epochs: list[int] = []
    shard_ids = range(plan.num_shards) if shards is None else shards
    for j in shard_ids:
        sources = shard_states.get(str(j), {}).get("sources", {})
        for s, w in enumerate(plan.weights):
            st = sources.get(str(s))
            if st is None:
                if w > 0:
                    epochs.append(0)
                continue
            for k in STAT_KEYS:
                total[k] += int(st["stats"].get(k, 0))
            if st["stats"].get("last_skipped"):
                total["last_skipped"] = st["stats"]["last_skipped"]
            total["sequences"] += int(st["sequences"])
            per_source[s]["sequences"] += int(st["sequences"])
            per_source[s]["documents"] += int(st["stats"].get("documents", 0))
            per_source[s]["tokens"] += int(st["stats"].get("tokens", 0))
            if w > 0:
                epochs.append(int(st["reader"]["epoch"]))
    for p in per_source:
        p["share"] = p["sequences"] / total["sequences"] if total["sequences"] else 0.0
    total["epoch"] = min(epochs) if epochs else 0
    total["max_epoch"] = max(epochs) if epochs else 0
    total["sources"] = per_source
    return total


# --------------------------------------------------------------------------------------------------
# Validation loader
# --------------------------------------------------------------------------------------------------


class ValLoader:
    """One deterministic pass over the validation source each time it is iterated.

    The validation data is packed as a single stream in file order (no shuffling); round t holds its
    sequences [t*W*B, (t+1)*W*B) and rank r gets those numbered r mod W. Only complete rounds are
    used, so every rank yields the same number of batches (a final partial round is dropped).
    """

    def __init__(self, plan: DataPlan, *, dp_rank: int, dp_world_size: int, local_batch_size: int):
        self.plan, self.dp_rank, self.dp_world_size = plan, dp_rank, dp_world_size
        self.local_batch_size = local_batch_size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        stream = ShardStream(0, self.plan)
        per_round = self.dp_world_size * self.local_batch_size
        tokens, positions, doc_ids = window_rows(self.plan, per_round)
        sources = [0] * per_round
        mine = slice(self.dp_rank, None, self.dp_world_size)
        while True:
            try:
                for row in range(per_round):
                    sources[row] = stream.fill(tokens[row], None if positions is None else positions[row],
                                               None if doc_ids is None else doc_ids[row])
            except StopIteration:
                return
            yield to_tensors(batch_arrays(self.plan, tokens[mine], None if positions is None else positions[mine],
                                          None if doc_ids is None else doc_ids[mine], sources[mine],
                                          [0] * self.local_batch_size))


# --------------------------------------------------------------------------------------------------
# Public builders
# --------------------------------------------------------------------------------------------------


def build_train_loader(config, tokenizer, *, dp_rank: int, dp_world_size: int) -> TrainLoader:
    """The training loader of one data-parallel rank (see TrainLoader). Raises ConfigError for impossible
    settings and for missing data, before any worker starts."""
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_world_size {dp_world_size}")
    b, g, _ = batch_geometry(config, dp_world_size)
    specs, weights = training_specs(config)
    d = config.data
    auto = None if config.explicitly_set("data.num_shards") else dp_world_size
    plan = build_plan(config, tokenizer, specs, weights, num_shards=d.num_shards, shuffle=d.shuffle, max_epochs=None,
                      shard_multiple=auto)
    workers = max(1, d.num_workers)
    if workers > 1 and (plan.num_shards // dp_world_size) % (b * workers):
        logger.warning(
            "data.num_shards (%d) is not a multiple of data-parallel degree (%d) x local_batch_size (%d) x "
            "data.num_workers (%d): loader workers will share shards and tokenize some data twice",
            plan.num_shards, dp_world_size, b, workers,
        )
    return TrainLoader(plan, dp_rank=dp_rank, dp_world_size=dp_world_size, local_batch_size=b,
                       global_batch_size=g, num_workers=d.num_workers, prefetch_factor=d.prefetch_factor,
                       pin_memory=d.pin_memory, prefetch_batches=d.prefetch_batches)


def build_val_loader(config, tokenizer, *, dp_rank: int, dp_world_size: int) -> ValLoader:
    """The validation batches of one rank: a fresh, deterministic pass each time it is iterated."""
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_world_size {dp_world_size}")
    b = int(config.validation.local_batch_size)  # >= 1: validated (trainer/config/rules.py)
    seq_len = config.validation.seq_len if config.validation.seq_len > 0 else config.training.seq_len
    plan = build_plan(config, tokenizer, [validation_spec(config)], [1.0], num_shards=1, shuffle=False, max_epochs=1,
                      seq_len=seq_len)
    return ValLoader(plan, dp_rank=dp_rank, dp_world_size=dp_world_size, local_batch_size=b)
