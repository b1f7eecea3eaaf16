"""lm-eval-harness on a native checkpoint (our model class), for ``trainer eval`` and the ``[eval]`` section.

The native path registers the lm-eval model ``trainer`` (:class:`NativeLM`): the model is loaded from the
DCP checkpoint with our own code and scored with our own forward, so no export is needed. It implements
``loglikelihood`` (batched, longest first), ``loglikelihood_rolling`` (lm-eval's disjoint rolling windows
at ``max_length``) and ``generate_until`` (batched, KV cache, greedy unless the task asks for sampling).

Requests start with BOS when the run trained with BOS before every document (its BOS/EOS rule,
tokenizer/policy.py), which is what the exported tokenizer does too (lm-eval's HF backend), and
``max_length`` defaults to the flavor's context length (the export's ``max_position_embeddings``), so a
native checkpoint and its export get the same scores.

Over several ranks (``trainer eval`` under torchrun, ``[eval]`` on a sharded model) the data-parallel ranks
split the requests and gather the answers back in lm-eval's order (:class:`EvalLayout`); under tensor
parallel the vocabulary-sharded logits are gathered, under pipeline parallel the training's schedule runs
forward-only passes (:class:`PipelineEval`).

Usage (the argument names are lm-eval's)::

    trainer eval --model_args checkpoint=outputs/run --tasks hellaswag,arc_easy --limit 100 --batch_size auto \
        --output_path results/
    trainer eval --model hf --model_args pretrained=exported/ --tasks my_task --include_path tasks/
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainer.torch_compat import pipeline_loss_disabled

logger = logging.getLogger("trainer")

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    HAVE_LM_EVAL = True
except ImportError:  # pragma: no cover - exercised only without the eval extra
    HAVE_LM_EVAL = False
    TemplateLM = object  # type: ignore[misc,assignment]

    def register_model(*_names):  # type: ignore[no-redef]
        return lambda cls: cls


INSTALL_HINT = "trainer eval needs lm-eval: pip install 'lm-eval[hf]>=0.4.5' (or the project's [eval] extra)"


@dataclass
class EvalLayout:
    """How this process takes part in an evaluation spread over ranks.

    The requests are cut into batches in one deterministic order (longest first); batch ``k`` goes to the
    data-parallel rank ``k % dp_size``. Every rank runs the same number of forward passes (a rank out of
    batches runs a one-token filler), because a sharded model's forward is collective: FSDP gathers each
    layer from its shard group, tensor parallel and pipeline stages exchange activations. The answers are
    then gathered over ``group`` to every rank and put back in lm-eval's order, so each rank's lm-eval
    computes the same scores as one process would.

    ``lockstep``: the forward is collective (a sharded model); ``False`` for replicated models (``trainer
    eval`` under torchrun), whose ranks need to meet only for the final gather. ``pad_multiple``: batch
    widths are padded to a multiple of it (sequence parallel splits the sequence over the TP ranks).
    ``pipeline``: the schedule, when the model is split into pipeline stages.
    """

    dp_rank: int = 0
    dp_size: int = 1
    group: Any = None
    lockstep: bool = False
    pad_multiple: int = 1
    pipeline: PipelineEval | None = None

    @property
    def distributed(self) -> bool:
        return self.group is not None and torch.distributed.get_world_size(self.group) > 1


@dataclass
class PipelineEval:
    """Forward-only passes through this rank's pipeline stages with the training schedule's ``eval()``.
    Every pass has the schedule's own shape (``rows`` x ``width``: the training's local batch and sequence
    length): the stages' communication buffers are sized by the first pass of a mode, so eval batches are
    padded to it. Only ranks holding the last stage get logits; generated tokens go from there to the
    other stages over ``pp_group``."""

    schedule: Any
    has_first: bool
    has_last: bool
    pp_group: Any
    rows: int
    width: int

    def forward(self, batch: torch.Tensor, device) -> torch.Tensor | None:
        n, w = batch.shape
        if n > self.rows or w > self.width:
            raise ValueError(f"eval batch {n}x{w} exceeds the pipeline's shape {self.rows}x{self.width}")
        padded = torch.zeros((self.rows, self.width), dtype=torch.long, device=device)
        padded[:n, :w] = batch.to(device)
        schedule = self.schedule
        # Forward only, and no loss: the training's loss (and the loss terms callbacks add to it) must not
        # see evaluation batches.
        with pipeline_loss_disabled(schedule):
            out = schedule.eval(padded) if self.has_first else schedule.eval()
        if not self.has_last:
            return None
        full_tensor = getattr(out, "full_tensor", None)
        out = full_tensor() if full_tensor is not None else out
        return out[:n, :w]

    def last_stage_rank(self) -> int:
        """The global rank of this pipeline's last stage (rank 0 of the pipeline under the V schedules)."""
        if not hasattr(self, "_last"):
            flags = [None] * torch.distributed.get_world_size(self.pp_group)
            torch.distributed.all_gather_object(flags, (torch.distributed.get_rank(), self.has_last),
                                                group=self.pp_group)
            self._last = next(rank for rank, last in flags if last)
        return self._last


def _adds_bos(tok, config=None) -> bool:
    """Whether requests start with BOS. With the run's config: its BOS/EOS rule (tokenizer/policy.py), which
    the export follows too, so a checkpoint and its export are scored alike; without one: what the
    tokenizer's own files add."""
    from tokenizer.policy import run_separator, tokenizer_rule

    if config is None or isinstance(config, (str, Path)):
        return tokenizer_rule(tok).adds_bos and tok.bos_id is not None
    return run_separator(config, tok, trained=True).add_bos


@register_model("trainer")
class NativeLM(TemplateLM):
    """lm-eval model over our ``Transformer``.

    Either ``checkpoint=`` (a DCP step/checkpoint/dump folder; ``config``, ``flavor``, ``tokenizer``,
    ``step`` as in ``trainer export``) or ``model=`` and ``tokenizer=`` objects (in-process evaluation of a
    model being trained, sharded or not: ``layout`` says how this rank takes part, see :class:`EvalLayout`).
    """

    def __init__(self, checkpoint: str | None = None, *, model=None, tokenizer=None, config=None,
                 flavor: str | None = None, tokenizer_path: str | None = None, step: int | None = None,
                 dtype: str = "fp32", device: str | None = "cpu", batch_size: int | str | None = 8,
                 max_batch_size: int | None = None, max_length: int | None = None, max_gen_toks: int = 256,
                 add_bos_token: bool | None = None, context_length: int | None = None,
                 trust_remote_code: bool | None = None, layout: EvalLayout | None = None):
        super().__init__()
        if model is None:
            if checkpoint is None:
                raise ValueError("NativeLM needs checkpoint=... (or model= and tokenizer=)")
            from torchtitan_ext.native import load_native

            loaded = load_native(checkpoint, config_path=config, flavor=flavor, tokenizer_path=tokenizer_path,
                                 step=int(step) if step is not None else None, dtype=dtype, device=device or "cpu")
            model, tokenizer, context_length = loaded.model, loaded.tokenizer, loaded.context_length
            config = loaded.config
        elif tokenizer is None:
            raise ValueError("NativeLM(model=...) also needs tokenizer=")
        self.model = model
        self.tok = tokenizer
        self._device = next(model.parameters()).device
        # auto / auto:N: the largest batch (max_batch_size, default 64), halved on CUDA out-of-memory.
        self._auto_batch = str(batch_size).startswith("auto")
        self.batch_size = int(max_batch_size or 64) if self._auto_batch else int(batch_size or 1)
        # What lm-eval records as results["config"]["batch_sizes"]: the size found for --batch_size auto.
        self.batch_sizes: dict[int, int] = {0: self.batch_size} if self._auto_batch else {}
        self.layout = layout or EvalLayout()
        if self.layout.pipeline is not None and self.batch_size > self.layout.pipeline.rows:
            logger.info("eval batches hold %d requests, not %d: under pipeline parallel a batch is the "
                        "schedule's (training.local_batch_size)", self.layout.pipeline.rows, self.batch_size)
            self.batch_size = self.layout.pipeline.rows
        rope_len = int(model.rope_cache.shape[0])
        self._max_length = int(max_length or context_length or rope_len)
        if self._max_length > rope_len:
            raise ValueError(f"max_length {self._max_length} exceeds the model's RoPE table ({rope_len})")
        self.max_gen_toks = int(max_gen_toks)
        if isinstance(add_bos_token, str):
            add_bos_token = add_bos_token.lower() in ("1", "true", "yes")
        self.add_bos_token = _adds_bos(tokenizer, config) if add_bos_token is None else bool(add_bos_token)
        self.tokenizer = None  # lm-eval reads HF tokenizer attributes from .tokenizer; ours is .tok

    # --- lm-eval plumbing ---------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self._device

    def get_model_info(self) -> dict:
        """The fields lm-eval's HF backend records in results["config"]."""
        params = sum(p.numel() for p in self.model.parameters())
        dtype = next(self.model.parameters()).dtype
        return {"model_num_parameters": int(params), "model_dtype": str(dtype), "model_revision": "",
                "model_sha": ""}

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tok, "path", type(self.tok).__name__)).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        bos = self.add_bos_token if add_special_tokens is None else (add_special_tokens and self.add_bos_token)
        ids = self.tok.encode(string, bos=bos)
        if left_truncate_len:
            ids = ids[-left_truncate_len:]
        return ids

    def tok_decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    @torch.no_grad()
    def _logits(self, batch: torch.Tensor) -> torch.Tensor | None:
        """Logits of a ``[rows, width]`` batch; None on pipeline ranks without the last stage."""
        layout = self.layout
        if layout.pad_multiple > 1 and batch.shape[1] % layout.pad_multiple:  # right padding: causal, harmless
            width = -(-batch.shape[1] // layout.pad_multiple) * layout.pad_multiple
            batch = F.pad(batch, (0, width - batch.shape[1]))
        if layout.pipeline is not None:
            return layout.pipeline.forward(batch, self._device)
        try:
            logits = self.model(batch.to(self._device))
        except torch.cuda.OutOfMemoryError:
            if not self._auto_batch or batch.shape[0] == 1 or layout.lockstep:
                raise
            torch.cuda.empty_cache()
            half = batch.shape[0] // 2
            self.batch_size = min(self.batch_size, half)  # later batches start at the size that fitted
            self.batch_sizes = {0: self.batch_size}
            return torch.cat([self._logits(batch[:half]), self._logits(batch[half:])])
        full_tensor = getattr(logits, "full_tensor", None)  # vocabulary-sharded logits (tensor parallel)
        return full_tensor() if full_tensor is not None else logits

    def _my_batches(self, batches: list) -> list:
        """This rank's share of ``batches`` (every dp_size-th, from its dp rank), padded with ``None`` (a
        filler pass) to the number of rounds every rank runs when the forward is collective."""
        layout = self.layout
        mine = batches[layout.dp_rank::layout.dp_size]
        if layout.lockstep:
            rounds = -(-len(batches) // layout.dp_size)
            mine = mine + [None] * (rounds - len(mine))
        return mine

    def _gather(self, local: dict[int, Any], n: int) -> list:
        """Every rank's answers (request index -> answer) merged, in request order, on every rank."""
        if self.layout.distributed:
            parts: list[Any] = [None] * torch.distributed.get_world_size(self.layout.group)
            torch.distributed.all_gather_object(parts, local, group=self.layout.group)
            local = {}
            for part in parts:
                local.update(part)
        missing = [i for i in range(n) if i not in local]
        if missing:
            raise RuntimeError(f"no rank scored eval request(s) {missing[:5]}")
        return [local[i] for i in range(n)]

    def _any(self, flag: bool) -> bool:
        """``flag`` on any rank of the evaluation (one all-reduce when the forward is collective)."""
        if not (self.layout.lockstep and self.layout.distributed):
            return flag
        t = torch.tensor([int(flag)], device=self._device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.layout.group)
        return bool(t.item())

    # --- requests ------------------------------------------------------------------------------------

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """``[(cache_key, context_ids, continuation_ids)] -> [(logprob, is_greedy)]``, longest first, each
        data-parallel rank scoring its share of the batches (see :class:`EvalLayout`)."""
        from tqdm import tqdm

        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        bs = override_bs or self.batch_size
        batches = [order[b:b + bs] for b in range(0, len(order), bs)]
        local: dict[int, tuple[float, bool]] = {}
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood (native)")
        for idx in self._my_batches(batches):
            inputs, metas = [], []
            for i in idx or ():
                _, ctx, cont = requests[i]
                if not cont:
                    raise ValueError("empty continuation in a loglikelihood request")
                whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
                inp = whole[:-1]
                inputs.append(inp)
                metas.append((len(inp), list(cont)))
            if not inputs:  # a filler pass: the other ranks' forward needs this rank's part of the model
                inputs = [[self.prefix_token_id]]
            width = max(len(x) for x in inputs)
            batch = torch.zeros((len(inputs), width), dtype=torch.long)  # right padding: causal, harmless
            for row, inp in enumerate(inputs):
                batch[row, :len(inp)] = torch.tensor(inp, dtype=torch.long)
            logits = self._logits(batch)
            if logits is None or not idx:
                continue
            logprobs = F.log_softmax(logits.float(), dim=-1).cpu()
            for row, (i, (inplen, cont)) in enumerate(zip(idx, metas)):
                n = len(cont)
                lp = logprobs[row, inplen - n:inplen]  # positions predicting the continuation
                target = torch.tensor(cont, dtype=torch.long)
                is_greedy = bool((lp.argmax(dim=-1) == target).all())
                local[i] = (float(lp.gather(-1, target[:, None]).sum()), is_greedy)
                pbar.update(1)
        pbar.close()
        results = self._gather(local, len(requests))
        for (cache_key, _, _), answer in zip(requests, results):
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils

        windows, owners = [], []
        for r, req in enumerate(requests):
            (string,) = req.args
            for window in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None,) + tuple(window))
                owners.append(r)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for r, (lp, _) in zip(owners, scores):
            totals[r] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy unless a task samples; batches of one generation setting, longest first, each
        data-parallel rank generating its share (see :class:`EvalLayout`)."""
        batches: list[tuple[dict, list[int]]] = []
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        for idx in groups.values():
            idx = sorted(idx, key=lambda i: -len(self.tok_encode(requests[i].args[0])))
            batches += [(requests[idx[0]].args[1], idx[b:b + self.batch_size])
                        for b in range(0, len(idx), self.batch_size)]
        eos_text = self.tok.decode([self.tok.eos_id]) if self.tok.eos_id is not None else ""
        local: dict[int, str] = {}
        for item in self._my_batches(batches):
            if item is None:  # a filler: the other ranks' passes need this rank's part of the model
                self._generate_lockstep([], 0, {})
                continue
            settings, chunk = item
            kwargs = dict(settings)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            if eos_text and eos_text not in until:
                until.append(eos_text)
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            # Greedy unless the task explicitly samples (do_sample: true with a positive temperature).
            do_sample = bool(kwargs.pop("do_sample", False))
            sampling = {"temperature": float(kwargs.pop("temperature", 0.0) or 0.0) if do_sample else 0.0,
                        "top_k": int(kwargs.pop("top_k", 0) or 0), "top_p": float(kwargs.pop("top_p", 1.0) or 1.0)}
            contexts = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen)
                        for i in chunk]
            contexts = [c if c else [self.prefix_token_id] for c in contexts]
            stops = [u for u in until if u]

            def stop_fn(row, ids, _stops=stops):
                text = self.tok.decode(ids)
                return any(s in text for s in _stops)

            if self.layout.lockstep:
                new = self._generate_lockstep(contexts, max_gen, sampling, stop_fn)
            else:
                from torchtitan_ext.generate import generate

                new = generate(self.model, contexts, max_gen, **sampling, eos_id=self.tok.eos_id,
                               pad_id=self.tok.pad_id or 0, stop_fn=stop_fn)
            for i, ids in zip(chunk, new):
                text = self.tok.decode(ids)
                for s in stops:
                    if s in text:
                        text = text.split(s)[0]
                local[i] = text
        results = self._gather(local, len(requests))
        for req, text in zip(requests, results):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return results

    @torch.no_grad()
    def _generate_lockstep(self, contexts: list[list[int]], max_gen: int, sampling: dict,
                           stop_fn=None) -> list[list[int]]:
        """Generation when the forward is collective (a sharded model): the whole sequence runs through
        the training forward at every token (no KV cache: tensor parallel's sequence split and the pipeline
        schedule take whole sequences), and every rank runs passes until no rank has a row left. Under
        pipeline parallel the last stage picks the tokens and sends them to the other stages."""
        from torchtitan_ext.generate import record_new_tokens, sample_next

        tokens = [list(c) for c in contexts] or [[self.prefix_token_id]]
        out: list[list[int]] = [[] for _ in tokens]
        done = torch.tensor([not contexts] * len(tokens))
        rows = torch.arange(len(tokens))
        pipeline = self.layout.pipeline
        step = 0
        while self._any(not bool(done.all()) and step < max_gen):
            batch = torch.zeros((len(tokens), max(len(t) for t in tokens)), dtype=torch.long)
            for row, t in enumerate(tokens):
                batch[row, :len(t)] = torch.tensor(t, dtype=torch.long)
            logits = self._logits(batch)
            if logits is not None:
                last = torch.tensor([len(t) - 1 for t in tokens])
                nxt = sample_next(logits[rows.to(logits.device), last.to(logits.device)], **sampling).to(self._device)
            else:
                nxt = torch.zeros(len(tokens), dtype=torch.long, device=self._device)
            if pipeline is not None:
                torch.distributed.broadcast(nxt, src=pipeline.last_stage_rank(), group=pipeline.pp_group)
            nxt = nxt.cpu()
            for row in range(len(tokens)):
                if not done[row] and step < max_gen:
                    tokens[row].append(int(nxt[row]))
            if step < max_gen:
                record_new_tokens(nxt, done, out, self.tok.eos_id, stop_fn)
            else:
                done[:] = True
            step += 1
        return out if contexts else []

# --------------------------------------------------------------------------------------------------
# trainer eval
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _working_dir(path: Path | None):
    if path is None:
        yield
        return
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextlib.contextmanager
def _without_environment_info(skip: bool):
    """lm-eval's ``simple_evaluate`` ends by adding the machine's description to its results
    (``lm_eval.evaluator.add_env_info``: torch's ``collect_env``, which starts pip, lscpu and other programs,
    and an import of transformers; 2 s on rank 0 of an idle machine, 10 s and more on a loaded one), with no
    option to leave it out. With ``skip`` (the in-training evaluation, which keeps only the scores) that step
    is replaced for the call; `trainer eval` keeps it (its results JSON is lm-eval's)."""
    if not skip:
        yield
        return
    import lm_eval.evaluator as evaluator

    original = evaluator.add_env_info
    evaluator.add_env_info = lambda results: None
    try:
        yield
    finally:
        evaluator.add_env_info = original


_TASK_MANAGERS: dict[tuple[str | None, bool], Any] = {}


def _task_manager(include: str | None, tasks: list[str]):
    """A (cached) lm-eval TaskManager. Indexing lm-eval's built-in tasks takes ~10 s, so when every
    requested task is in the include folder only that folder is indexed."""
    from lm_eval.tasks import TaskManager

    if include:
        key = (include, False)
        if key not in _TASK_MANAGERS:
            try:
                _TASK_MANAGERS[key] = TaskManager(include_path=include, include_defaults=False)
            except TypeError:  # an lm-eval without include_defaults
                _TASK_MANAGERS[key] = None
        local = _TASK_MANAGERS[key]
        if local is not None and all(local.match_tasks([t]) for t in tasks):
            return local
    key = (include, True)
    if key not in _TASK_MANAGERS:
        _TASK_MANAGERS[key] = TaskManager(include_path=include) if include else TaskManager()
    return _TASK_MANAGERS[key]


def evaluate(lm, tasks: list[str], *, include_path: str | None = None, limit: float | None = None,
             num_fewshot: int | None = None, batch_size: int | str | None = None,
             seed: int | list[int | None] = 1234, log_samples: bool = False,
             gen_kwargs: str | dict | None = None,
             data_dir: str | Path | None = None, bootstrap_iters: int = 0, environment: bool = True,
             **options) -> dict:
    """Run lm-eval's ``simple_evaluate`` on an LM object and return its results (without the machine's
    description when ``environment`` is False: :func:`_without_environment_info`).

    ``seed``: one value for lm-eval's four seeds, or [python, numpy, torch, fewshot]. ``options`` go to
    ``simple_evaluate`` as they are (``write_out``, ``evaluation_tracker``, ...). Task datasets given with
    relative ``data_files`` are resolved against ``data_dir`` (default: the include_path folder), so a task
    folder can ship its own small JSON/JSONL data.
    """
    from lm_eval import simple_evaluate

    include = str(Path(include_path).resolve()) if include_path else None
    task_manager = _task_manager(include, tasks)
    unknown = [t for t in tasks if not task_manager.match_tasks([t])]
    if unknown:
        hint = f" (looked in lm-eval's tasks and {include})" if include else " (add --include_path for local tasks)"
        raise ValueError(f"unknown task(s): {', '.join(unknown)}{hint}")
    workdir = Path(data_dir).resolve() if data_dir else (Path(include) if include else None)
    if workdir is not None and workdir.is_file():
        workdir = workdir.parent
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * 4
    with _working_dir(workdir), _without_environment_info(not environment):
        results = simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=num_fewshot, batch_size=batch_size, limit=limit,
            task_manager=task_manager, log_samples=log_samples, gen_kwargs=gen_kwargs, random_seed=seeds[0],
            numpy_random_seed=seeds[1], torch_random_seed=seeds[2], fewshot_random_seed=seeds[3],
            bootstrap_iters=bootstrap_iters, **options)
    return results
