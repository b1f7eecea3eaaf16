"""``trainer eval``: lm-eval-harness on a native checkpoint (our model class) or on an exported HF folder.

The native path registers the lm-eval model ``trainer`` (:class:`NativeLM`): the model is loaded from the
DCP checkpoint with our own code and scored with our own forward, so no export is needed. It implements
``loglikelihood`` (batched, longest first), ``loglikelihood_rolling`` (lm-eval's disjoint rolling windows
at ``max_length``) and ``generate_until`` (batched, KV cache, greedy unless the task asks for sampling).

Tokenization follows what lm-eval's HF backend does with the exported tokenizer (BOS is added when the
HF tokenizer adds it: Llama 2 / Llama 3 tokenizers do, the bundled debug tokenizer does not), and
``max_length`` defaults to the flavor's context length (the export's ``max_position_embeddings``), so a
native checkpoint and its export get the same scores.

Usage (the argument names are lm-eval's)::

    trainer eval --checkpoint outputs/run --tasks hellaswag,arc_easy --limit 100 --batch_size 8 \
        --output_path results.json
    trainer eval --hf exported/ --tasks my_task --include_path tasks/ --output_path results.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

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


def _adds_bos(tok, config=None) -> bool:
    """Whether requests start with BOS: the run's BOS/EOS rule (tokenizer/_policy.py), which is also what the
    exported tokenizer does, so a checkpoint and its export are scored alike."""
    from tokenizer._policy import choose_separator, run_separator

    try:
        return (run_separator(config, tok) if config is not None else choose_separator(tok, "auto")).add_bos
    except ValueError:
        return False


@register_model("trainer")
class NativeLM(TemplateLM):
    """lm-eval model over our ``Transformer``.

    Either ``checkpoint=`` (a DCP step/checkpoint/dump folder; ``config``, ``flavor``, ``tokenizer``,
    ``step`` as in ``trainer export``) or ``model=`` and ``tokenizer=`` objects (in-process evaluation of a
    model being trained; it must be unsharded or replicated on this process).
    """

    def __init__(self, checkpoint: str | None = None, *, model=None, tokenizer=None, config=None,
                 flavor: str | None = None, tokenizer_path: str | None = None, step: int | None = None,
                 dtype: str = "fp32", device: str = "cpu", batch_size: int | str = 8,
                 max_length: int | None = None, max_gen_toks: int = 256, add_bos_token: bool | None = None,
                 context_length: int | None = None, **_ignored):
        super().__init__()
        if model is None:
            if checkpoint is None:
                raise ValueError("NativeLM needs checkpoint=... (or model= and tokenizer=)")
            from torchtitan_ext.native import load_native

            loaded = load_native(checkpoint, config_path=config, flavor=flavor, tokenizer_path=tokenizer_path,
                                 step=int(step) if step is not None else None, dtype=dtype, device=device)
            model, tokenizer, context_length = loaded.model, loaded.tokenizer, loaded.context_length
            config = loaded.config
        elif tokenizer is None:
            raise ValueError("NativeLM(model=...) also needs tokenizer=")
        self.model = model
        self.tok = tokenizer
        self._device = next(model.parameters()).device
        self.batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)
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
    def _logits(self, batch: torch.Tensor) -> torch.Tensor:
        return self.model(batch.to(self._device))

    # --- requests ------------------------------------------------------------------------------------

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """``[(cache_key, context_ids, continuation_ids)] -> [(logprob, is_greedy)]``, longest first."""
        from tqdm import tqdm

        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bs = override_bs or self.batch_size
        pbar = tqdm(total=len(requests), disable=disable_tqdm, desc="loglikelihood (native)")
        for b in range(0, len(order), bs):
            idx = order[b:b + bs]
            inputs, metas = [], []
            for i in idx:
                _, ctx, cont = requests[i]
                if not cont:
                    raise ValueError("empty continuation in a loglikelihood request")
                whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
                inp = whole[:-1]
                inputs.append(inp)
                metas.append((len(inp), list(cont)))
            width = max(len(x) for x in inputs)
            batch = torch.zeros((len(inputs), width), dtype=torch.long)  # right padding: causal, harmless
            for row, inp in enumerate(inputs):
                batch[row, :len(inp)] = torch.tensor(inp, dtype=torch.long)
            logprobs = F.log_softmax(self._logits(batch).float(), dim=-1).cpu()
            for row, (i, (inplen, cont)) in enumerate(zip(idx, metas)):
                n = len(cont)
                lp = logprobs[row, inplen - n:inplen]  # positions predicting the continuation
                target = torch.tensor(cont, dtype=torch.long)
                is_greedy = bool((lp.argmax(dim=-1) == target).all())
                answer = (float(lp.gather(-1, target[:, None]).sum()), is_greedy)
                results[i] = answer
                cache_key = requests[i][0]
                if cache_key is not None:
                    self.cache_hook.add_partial("loglikelihood", cache_key, answer)
                pbar.update(1)
        pbar.close()
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
        from torchtitan_ext.generate import generate

        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        eos_text = self.tok.decode([self.tok.eos_id]) if self.tok.eos_id is not None else ""
        for key, idx in groups.items():
            kwargs = dict(requests[idx[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            if eos_text and eos_text not in until:
                until.append(eos_text)
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            # Greedy unless the task explicitly samples (do_sample: true with a positive temperature).
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0) if do_sample else 0.0
            top_k = int(kwargs.pop("top_k", 0) or 0)
            top_p = float(kwargs.pop("top_p", 1.0) or 1.0)
            idx = sorted(idx, key=lambda i: -len(self.tok_encode(requests[i].args[0])))
            for b in range(0, len(idx), self.batch_size):
                chunk = idx[b:b + self.batch_size]
                contexts = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen)
                            for i in chunk]
                contexts = [c if c else [self.prefix_token_id] for c in contexts]
                stops = [u for u in until if u]

                def stop_fn(row, ids, _stops=stops):
                    text = self.tok.decode(ids)
                    return any(s in text for s in _stops)

                new = generate(self.model, contexts, max_gen, temperature=temperature, top_k=top_k, top_p=top_p,
                               eos_id=self.tok.eos_id, pad_id=self.tok.pad_id or 0, stop_fn=stop_fn)
                for i, ids in zip(chunk, new):
                    text = self.tok.decode(ids)
                    for s in stops:
                        if s in text:
                            text = text.split(s)[0]
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results  # type: ignore[return-value]


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
             num_fewshot: int | None = None, batch_size: int | None = None, seed: int = 1234,
             log_samples: bool = False, gen_kwargs: str | None = None, data_dir: str | Path | None = None,
             bootstrap_iters: int = 0) -> dict:
    """Run lm-eval's ``simple_evaluate`` on an LM object or a registered model name and return its results.

    Task datasets given with relative ``data_files`` are resolved against ``data_dir`` (default: the
    include_path folder), so a task folder can ship its own small JSON/JSONL data.
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
    with _working_dir(workdir):
        results = simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=num_fewshot, batch_size=batch_size, limit=limit,
            task_manager=task_manager, log_samples=log_samples, gen_kwargs=gen_kwargs, random_seed=seed,
            numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            bootstrap_iters=bootstrap_iters)
    return results


def main(argv: list[str] | None = None) -> int:
    from trainer import logs

    parser = argparse.ArgumentParser(
        prog="trainer eval",
        description="Evaluate a native checkpoint (lm-eval model 'trainer') or an exported HF folder (lm-eval's "
                    "'hf' backend) on lm-eval tasks.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="DCP step folder, folder of step-N folders, or a run's dump folder")
    source.add_argument("--hf", help="a Hugging Face Llama folder (e.g. from 'trainer export')")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
    parser.add_argument("--include_path", default=None, help="folder of extra task YAMLs (local tasks); relative "
                        "data_files in them are resolved against this folder")
    parser.add_argument("--limit", type=float, default=None, help="examples per task (a fraction if < 1)")
    parser.add_argument("--num_fewshot", type=int, default=None)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--output_path", default=None, help="JSON file for the results (a folder gets results.json)")
    parser.add_argument("--log_samples", action="store_true", help="also save per-example outputs in the JSON")
    parser.add_argument("--gen_kwargs", default=None, help="generation arguments, e.g. temperature=0,max_gen_toks=64")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--bootstrap_iters", type=int, default=0,
                        help="bootstrap resamples for standard errors (lm-eval's default is 100000; 0: none)")
    parser.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--step", type=int, default=None, help="with --checkpoint: this step instead of the latest")
    parser.add_argument("--config", default=None, help="the run's config.toml (default: found above the checkpoint)")
    parser.add_argument("--flavor", default=None, help="override the model flavor of the run's config")
    parser.add_argument("--tokenizer", default=None, help="override the tokenizer path of the run's config")
    parser.add_argument("--add_bos_token", choices=["auto", "true", "false"], default="auto",
                        help="prepend BOS to every request (auto: as the exported HF tokenizer does)")
    args = parser.parse_args(argv)
    logs.setup()
    if not HAVE_LM_EVAL:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        parser.error("--tasks is empty")
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    bos = None if args.add_bos_token == "auto" else args.add_bos_token == "true"
    t0 = time.perf_counter()
    try:
        if args.hf:
            from torchtitan_ext.native import parse_dtype

            if not (Path(args.hf) / "config.json").is_file():
                raise FileNotFoundError(f"{args.hf} is not a Hugging Face model folder (no config.json)")
            from lm_eval.models.huggingface import HFLM

            hf_kwargs: dict[str, Any] = dict(pretrained=str(Path(args.hf).resolve()), device=args.device,
                                             dtype=parse_dtype(args.dtype), batch_size=args.batch_size,
                                             max_length=args.max_length)
            if bos is not None:
                hf_kwargs["add_bos_token"] = bos
            lm = HFLM(**hf_kwargs)
            source = f"hf:{args.hf}"
        else:
            lm = NativeLM(args.checkpoint, config=args.config, flavor=args.flavor, tokenizer_path=args.tokenizer,
                          step=args.step, dtype=args.dtype, device=args.device, batch_size=args.batch_size,
                          max_length=args.max_length, add_bos_token=bos)
            source = f"checkpoint:{args.checkpoint}"
        output = Path(args.output_path).resolve() if args.output_path else None
        results = evaluate(lm, tasks, include_path=args.include_path, limit=limit, num_fewshot=args.num_fewshot,
                           batch_size=args.batch_size, seed=args.seed, log_samples=args.log_samples,
                           gen_kwargs=args.gen_kwargs, bootstrap_iters=args.bootstrap_iters)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"trainer eval: {e}", file=sys.stderr)
        return 2
    if results is None:  # non-zero ranks under lm-eval's own distribution
        return 0
    from lm_eval.utils import handle_non_serializable, make_table

    results.setdefault("config", {})["model_source"] = source
    logger.info("lm-eval finished in %.1f s\n%s", time.perf_counter() - t0, make_table(results))
    summary = {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
               for task, metrics in results.get("results", {}).items()}
    print(json.dumps({"results": summary}, indent=2))
    if output is not None:
        if output.is_dir() or args.output_path.endswith(("/", os.sep)):
            output.mkdir(parents=True, exist_ok=True)
            output = output / "results.json"
        output.parent.mkdir(parents=True, exist_ok=True)
        if not args.log_samples:
            results.pop("samples", None)
        output.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
        logger.info("results written to %s", output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
