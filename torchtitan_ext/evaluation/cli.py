"""``trainer eval``: lm-eval's command line on a native checkpoint or an exported folder.

A user's ``lm_eval`` command works after changing the program name and the model arguments::

    lm_eval     --model hf --model_args pretrained=exports/run --tasks hellaswag --batch_size auto ...
    trainer eval --model hf --model_args pretrained=exports/run --tasks hellaswag --batch_size auto ...
    trainer eval --model_args checkpoint=outputs/run         --tasks hellaswag --batch_size auto ...

Arguments, short flags and defaults are lm-eval's (0.4.x ``lm_eval run``); ``--output_path DIR`` writes
lm-eval's layout (``DIR/<model>/results_<time>.json``, ``samples_<task>_<time>.jsonl``). What this command
cannot do is refused in one line (exit 2); docs/export_eval.md has the table.

``NGPU=N trainer eval ...`` (or the command under torchrun) splits the native model's requests over N
processes, each holding the whole model; rank 0 prints and writes the results.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("trainer")

# lm-eval arguments this command refuses, with the reason.
REFUSED = {
    "wandb_args": "Weights & Biases logging is lm_eval's own; run lm_eval on an export (trainer export) for it",
    "wandb_config_args": "Weights & Biases logging is lm_eval's own; run lm_eval on an export for it",
    "trackio_args": "Trackio logging is lm_eval's own; run lm_eval on an export (trainer export) for it",
    "hf_hub_log_args": "pushing results to the Hugging Face Hub is lm_eval's own; run lm_eval on an export for it",
}
NATIVE_REFUSED = {
    "apply_chat_template": "a pretraining checkpoint has no chat template; export it and add one to use this",
    "fewshot_as_multiturn": "multi-turn few-shot needs a chat template, which a pretraining checkpoint lacks",
}
MODELS = ("trainer", "hf")
DEFAULT_SEED = "0,1234,1234,1234"


class Refused(ValueError):
    """An lm-eval feature this command does not provide."""


def _seeds(value: str) -> list[int | None]:
    """lm-eval's --seed: one integer for all four seeds, or python,numpy,torch,fewshot with 'None' allowed."""
    items = []
    for item in value.split(","):
        item = item.strip().lower()
        try:
            items.append(None if item == "none" else int(item))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not an integer or None") from None
    if len(items) == 1:
        return items * 4
    if len(items) == 3:  # lm-eval fills the fourth from its default
        return items + [1234]
    if len(items) != 4:
        raise argparse.ArgumentTypeError(f"--seed takes 1 or 4 values, got {len(items)}")
    return items


def _cache_requests(value: str) -> dict[str, bool]:
    if value not in ("true", "refresh", "delete"):
        raise argparse.ArgumentTypeError(f"invalid value {value!r} (choose from true, refresh, delete)")
    return {"cache_requests": value in ("true", "refresh"), "rewrite_requests_cache": value == "refresh",
            "delete_requests_cache": value == "delete"}


def _key_values(values: list[str]) -> dict[str, Any]:
    """``k=v,k2=v2`` (several words allowed) or a JSON object, as lm-eval's --model_args / --metadata."""
    from lm_eval.utils import simple_parse_args_string

    out: dict[str, Any] = {}
    for value in values:
        value = value.strip()
        if value.startswith("{"):
            out.update(json.loads(value))
        elif value:
            out.update(simple_parse_args_string(value))
    return out


def build_parser() -> argparse.ArgumentParser:  # long: one add_argument per lm-eval option, in lm-eval's order
    p = argparse.ArgumentParser(
        prog="trainer eval", description="lm-eval on a native checkpoint (model 'trainer') or a Hugging Face "
        "folder (model 'hf'), with lm_eval's command line. See docs/export_eval.md.")
    a = p.add_argument
    a("--checkpoint", help="DCP step folder, folder of step-N folders, or a run's dump folder "
      "(= --model trainer --model_args checkpoint=...)")
    a("--hf", help="a Hugging Face folder (= --model hf --model_args pretrained=...)")
    a("--config", "-C", default=None, help="the run's config.toml (default: found above the checkpoint); "
      "lm_eval's YAML configs are refused")
    a("--tasks", "-t", nargs="+", default=None, help="task or group names, space or comma separated")
    a("--model", "-M", default=None, help="trainer (a native checkpoint) or hf (default: hf "
      "when the model arguments name 'pretrained', else trainer)")
    a("--model_args", "-a", nargs="+", default=[], help="model arguments as key=val,key2=val2 or JSON")
    a("--apply_chat_template", nargs="?", const=True, default=False, help="(hf only) apply the chat template")
    a("--limit", "-L", type=float, default=None, help="examples per task (a fraction if < 1)")
    a("--use_cache", "-c", default=None, help="sqlite cache of model responses (path prefix)")
    a("--num_fewshot", "-f", type=int, default=None)
    a("--batch_size", "-b", default="1", help="an integer, 'auto' or 'auto:N' (default 1)")
    a("--max_batch_size", type=int, default=None, help="upper bound for --batch_size auto (default 64)")
    a("--device", default=None, help="cuda, cuda:0, cpu, ... (default: cuda when available)")
    a("--gen_kwargs", nargs="+", default=None, help="generation arguments, e.g. temperature=0,max_gen_toks=64")
    a("--output_path", "-o", default=None, help="folder for lm-eval's layout (or a .json file)")
    a("--log_samples", "-s", action="store_true", help="also write every example's inputs and outputs")
    a("--samples", "-E", default=None, help="JSON of task -> example indices (instead of --limit)")
    a("--cache_requests", type=_cache_requests, nargs="?", const="true", default=None,
      metavar="true|refresh|delete")
    a("--check_integrity", action="store_true", help="run the tasks' test suites")
    a("--system_instruction", default=None, help="text put before every prompt")
    a("--fewshot_as_multiturn", nargs="?", const=True, default=None,
      type=lambda x: x.lower() in ("true", "1", "yes"), help="(hf with a chat template only)")
    a("--include_path", default=None, help="folder of extra task YAMLs; relative data_files are read from it")
    a("--verbosity", "-v", type=str.upper, default=None, help="log level of lm-eval (DEBUG, INFO, ...)")
    a("--write_out", "-w", action="store_true", help="print the prompts of the first examples")
    a("--show_config", action="store_true", help="print the whole results JSON")
    for name in REFUSED:
        a(f"--{name}", nargs="+", default=None, help=argparse.SUPPRESS)
    a("--predict_only", "-x", action="store_true", help="save outputs only (implies --log_samples)")
    a("--seed", type=_seeds, default=_seeds(DEFAULT_SEED), metavar="<python,numpy,torch,fewshot>",
      help=f"random seeds, one or four values (default {DEFAULT_SEED})")
    a("--trust_remote_code", action="store_true", help="(hf) allow the folder's own code")
    a("--confirm_run_unsafe_code", action="store_true", help="allow tasks that execute model output")
    a("--metadata", nargs="+", default=None, help="task metadata as key=val or JSON")
    g = p.add_argument_group("this project's options")
    g.add_argument("--bootstrap_iters", type=int, default=100000,
                   help="bootstrap resamples for standard errors (lm-eval's default; 0: none)")
    g.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (trainer default fp32; hf: the folder's)")
    g.add_argument("--max_length", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--step", type=int, default=None, help="(trainer) this step instead of the latest")
    g.add_argument("--flavor", default=None, help="(trainer) override the model flavor of the run's config")
    g.add_argument("--tokenizer", default=None, help="(trainer) override the run's tokenizer path")
    g.add_argument("--add_bos_token", choices=["auto", "true", "false"], default="auto",
                   help="prepend BOS to every request (auto: the run's BOS/EOS rule, as the export does)")
    return p


def _model_and_args(args) -> tuple[str, dict[str, Any]]:
    """The model name and its arguments (lm-eval's --model/--model_args plus this command's shortcuts)."""
    model_args = _key_values(args.model_args)
    if args.checkpoint:
        model_args["checkpoint"] = args.checkpoint
    if args.hf:
        model_args["pretrained"] = args.hf
    if "checkpoint" in model_args and "pretrained" in model_args:
        raise ValueError("give a checkpoint (--checkpoint, checkpoint=) or a Hugging Face folder (--hf, "
                         "pretrained=), not both")
    model = args.model or ("hf" if "pretrained" in model_args else "trainer")
    if model not in MODELS:
        raise Refused(f"--model {model}: trainer eval runs 'trainer' (native checkpoints) and 'hf'; run lm_eval "
                      "itself for other backends")
    if model == "trainer":
        if "checkpoint" not in model_args:
            raise ValueError("name the checkpoint: --checkpoint DIR or --model_args checkpoint=DIR")
        for key, value in (("config", args.config), ("flavor", args.flavor), ("tokenizer_path", args.tokenizer),
                           ("step", args.step), ("dtype", args.dtype or "fp32"), ("max_length", args.max_length)):
            if value is not None:
                model_args.setdefault(key, value)
        for name, reason in NATIVE_REFUSED.items():
            if getattr(args, name):
                raise Refused(f"--{name}: {reason}")
    else:
        if "pretrained" not in model_args:
            raise ValueError("name the model folder: --hf DIR or --model_args pretrained=DIR")
        if not (Path(str(model_args["pretrained"])) / "config.json").is_file():
            raise FileNotFoundError(f"{model_args['pretrained']} is not a Hugging Face model folder (no config.json)")
        for key, value in (("dtype", args.dtype and _torch_dtype(args.dtype)), ("max_length", args.max_length),
                           ("trust_remote_code", args.trust_remote_code or None)):
            if value is not None:
                model_args.setdefault(key, value)
    for path_key in ("checkpoint", "pretrained", "config", "tokenizer_path"):  # the task data is read elsewhere
        if isinstance(model_args.get(path_key), str) and Path(model_args[path_key]).exists():
            model_args[path_key] = str(Path(model_args[path_key]).resolve())
    if args.add_bos_token != "auto":
        model_args["add_bos_token"] = args.add_bos_token == "true"
    return model, model_args


def _torch_dtype(name: str):
    from torchtitan_ext.native import parse_dtype

    return parse_dtype(name)


def _refuse(args) -> None:
    for name, reason in REFUSED.items():
        if getattr(args, name) is not None:
            raise Refused(f"--{name}: {reason}")
    if args.config and not args.config.endswith(".toml"):
        raise Refused("--config: lm_eval's YAML configs are not read; write their arguments on the command line "
                      "(--config here is a run's config.toml)")


def _device(args) -> str:
    """The device to evaluate on: --device, else CUDA when present; under torchrun each process takes the
    GPU of its LOCAL_RANK. --device cuda on a machine without CUDA is refused."""
    import os

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA device (torch {torch.__version__}); "
                         "use --device cpu")
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    return device


def _build_lm(model: str, model_args: dict, args, layout=None):
    extra = {"batch_size": args.batch_size, "max_batch_size": args.max_batch_size, "device": _device(args)}
    if model == "hf":
        from lm_eval.models.huggingface import HFLM

        return HFLM.create_from_arg_obj(dict(model_args), extra)
    from torchtitan_ext.evaluation.lm import NativeLM

    return NativeLM.create_from_arg_obj(dict(model_args, layout=layout), extra)


def _run(lm, model: str, model_args: dict, args, tasks: list[str]):
    """simple_evaluate with every lm-eval option given (those this lm-eval lacks are refused)."""
    from lm_eval.loggers import EvaluationTracker

    from torchtitan_ext.evaluation.lm import evaluate

    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    tracker = EvaluationTracker(output_path=str(Path(args.output_path).resolve())) if args.output_path else None
    options: dict[str, Any] = dict(
        max_batch_size=args.max_batch_size, use_cache=args.use_cache, **(args.cache_requests or {}),
        samples=json.loads(args.samples) if args.samples else None, check_integrity=args.check_integrity or None,
        write_out=args.write_out or None, evaluation_tracker=tracker, system_instruction=args.system_instruction,
        apply_chat_template=args.apply_chat_template or None, fewshot_as_multiturn=args.fewshot_as_multiturn,
        verbosity=args.verbosity, predict_only=args.predict_only or None,
        confirm_run_unsafe_code=args.confirm_run_unsafe_code or None,
        metadata=_key_values(args.metadata) if args.metadata else None, model_args=model_args,
        device=_device(args))
    from lm_eval import simple_evaluate

    accepted = inspect.signature(simple_evaluate).parameters
    missing = [k for k, v in options.items() if v is not None and k not in accepted]
    if missing:
        raise Refused(f"--{missing[0]}: this lm-eval version lacks it; upgrade lm-eval")
    options = {k: v for k, v in options.items() if v is not None}
    cpu = time.process_time()
    results = evaluate(lm, tasks, include_path=args.include_path, limit=limit, num_fewshot=args.num_fewshot,
                       batch_size=args.batch_size, seed=args.seed, log_samples=args.log_samples,
                       gen_kwargs=_key_values(args.gen_kwargs or []),
                       bootstrap_iters=args.bootstrap_iters if _rank() == 0 else 0, **options)
    cpu_seconds = _per_rank(time.process_time() - cpu, getattr(lm, "layout", None))
    if results is not None:  # each process's CPU seconds in the evaluation (trainer bench eval reads them)
        results["eval_cpu_seconds_per_process"] = cpu_seconds
    return results, tracker


def _per_rank(value: float, layout) -> list[float]:
    """``value`` of every process under torchrun (rank order), else ``[value]``."""
    if layout is None or not layout.distributed:
        return [value]
    import torch.distributed as dist

    values: list = [None] * dist.get_world_size(layout.group)
    dist.all_gather_object(values, value, group=layout.group)
    return values


def _tokenizer_info(lm) -> dict[str, Any]:
    """The tokenizer fields lm-eval records for its HF backend, for the native model."""
    from tokenizer.policy import token_string

    tok = getattr(lm, "tok", None)
    if tok is None:
        return {}
    info = {f"tokenizer_{name}_token": [token_string(tok, tid), str(tid)]
            for name, tid in (("pad", tok.pad_id), ("eos", tok.eos_id), ("bos", tok.bos_id))}
    return {**info, "eot_token_id": lm.eot_token_id, "max_length": lm.max_length}


def _results_name(model_args: dict) -> str:
    """The model's name in the results and lm-eval's folder layout: its absolute path (resolved by
    ``_model_and_args``), so the folder does not depend on the directory the command runs from."""
    return str(model_args.get("pretrained") or model_args.get("checkpoint"))


def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` cannot be created or written into, or None: the nearest part of it that exists must be a
    writable folder."""
    import os

    folder = folder.absolute()
    existing = folder
    while not (existing.exists() or existing.is_symlink()) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a folder" if existing == folder else (
            f"{existing} is not a folder, so {folder} cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def _check_output_path(args, model_args: dict) -> None:
    """--output_path can take the results, checked before anything is evaluated: lm-eval only logs a failed
    save, after the whole evaluation."""
    if args.output_path is None:
        return
    from lm_eval.utils import sanitize_model_name

    path = Path(args.output_path)
    if args.output_path.endswith(".json"):
        if path.is_dir():
            raise ValueError(f"--output_path {args.output_path} is a folder: a path ending in .json names the "
                             "results file; give another file name, or drop .json for lm-eval's folder layout")
        folder = path.parent
    else:
        if path.exists() and not path.is_dir():
            raise ValueError(f"--output_path {args.output_path} is a file, not a folder: lm-eval's layout writes "
                             "DIR/<model>/results_<time>.json; give a folder, or a path ending in .json for one "
                             "results file")
        folder = path / sanitize_model_name(_results_name(model_args))
    reason = _unwritable(folder)
    if reason is not None:
        raise ValueError(f"--output_path {args.output_path}: the results cannot be written there ({reason}); "
                         "give another --output_path")


def _save(results: dict, tracker, model: str, model_args: dict, args) -> Path | None:
    """Write the results as lm-eval does (a .json --output_path: exactly that file, samples inside); returns
    the results file, None without --output_path. A save lm-eval could not do (it only logs it) raises
    OutputError."""
    from lm_eval.utils import handle_non_serializable, sanitize_model_name

    from trainer.errors import OutputError

    name = _results_name(model_args)
    source = f"checkpoint:{model_args['checkpoint']}" if model == "trainer" else f"hf:{model_args['pretrained']}"
    results.setdefault("config", {}).update(model=model, model_args=model_args, model_source=source)
    samples = results.pop("samples", None) if (args.log_samples or args.predict_only) else None
    results.pop("samples", None)
    if args.output_path is None:
        return None
    if args.output_path.endswith(".json"):
        out = Path(args.output_path)
        body = dict(results, samples=samples) if samples is not None else results
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(body, indent=2, default=handle_non_serializable, ensure_ascii=False))
        except OSError as e:
            raise OutputError(f"the results could not be written to {out} ({e.strerror or e}); the evaluation's "
                              "table follows") from None
        logger.info("results written to %s", out)
        return out
    tracker.general_config_tracker.model_name = name
    tracker.general_config_tracker.model_name_sanitized = sanitize_model_name(name)
    tracker.save_results_aggregated(results=results, samples=samples)
    out = Path(tracker.output_path) / sanitize_model_name(name) / f"results_{getattr(tracker, 'date_id', '')}.json"
    if not out.is_file():
        raise OutputError(f"the results could not be written under {args.output_path} (lm-eval's warning above "
                          "says why); the evaluation's table follows")
    if samples is not None:
        for task_name in results.get("configs", {}):
            tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    logger.info("results written to %s", out)
    return out


def _report(results: dict, model: str, model_args: dict, args, seconds: float) -> None:
    from lm_eval.utils import handle_non_serializable, make_table

    if args.show_config:
        print(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    sizes = ",".join(map(str, results.get("config", {}).get("batch_sizes", [])))
    gen_kwargs = _key_values(args.gen_kwargs or [])
    print(f"{model} ({model_args}), gen_kwargs: ({gen_kwargs}), limit: {args.limit}, num_fewshot: "
          f"{args.num_fewshot}, batch_size: {args.batch_size}{f' ({sizes})' if sizes else ''}")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    logger.info("lm-eval finished in %.1f s", seconds)


def _unreachable_hub(error: OSError) -> bool:
    """A task's dataset could not be fetched: offline mode, no network, the Hub unreachable (datasets and
    huggingface_hub raise ConnectionError; requests its own ConnectionError, an OSError too)."""
    return isinstance(error, ConnectionError) or type(error).__module__.split(".")[0] in (
        "requests", "urllib3", "huggingface_hub")


def _launch(ngpu: int, argv: list[str]) -> int:
    """``NGPU=N trainer eval ...``: the same command in N processes under torchrun (one node). A process that
    fails on a user's mistake has printed its one line (rank 0); torchrun's report is not shown, and its exit
    code is that process's."""
    import os

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logger.info("trainer eval: %d processes (NGPU=%d) under torchrun", ngpu, ngpu)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it; said here so it is not a warning
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(["--standalone", "--nproc_per_node", str(ngpu), "-m", "torchtitan_ext.lm_eval_model",
                        *argv]))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        if code not in (2, 3):  # not a mistake rank 0 has already named
            print(f"trainer eval: process {rank} failed (exit {code}); the cause is on its console above",
                  file=sys.stderr)
        return code
    return 0


def _layout():
    """Under torchrun (WORLD_SIZE > 1): the process group, and this process's share of the requests (the
    model is loaded whole on every process; the answers are gathered to every rank, rank 0 writes)."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch.distributed as dist

    from torchtitan_ext.evaluation.lm import EvalLayout
    from trainer.setup import init_device, init_process_group

    init_process_group(init_device(), timeout_s=1800)
    return EvalLayout(dp_rank=dist.get_rank(), dp_size=dist.get_world_size(), group=dist.group.WORLD)


def _rank() -> int:
    """This process's rank under torchrun (0 alone): only rank 0's results are written, so the others skip
    lm-eval's bootstrapped standard errors."""
    import os

    return int(os.environ.get("RANK", "0"))


def _ngpu() -> int:
    import os

    value = os.environ.get("NGPU", "1") or "1"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"NGPU={value}: give the number of processes, a positive integer")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    finally:
        _close_process_group()


def _close_process_group() -> None:
    """Under torchrun (a process group was made: torch is imported)."""
    if "torch.distributed" in sys.modules:
        from trainer.setup import close_process_group

        close_process_group()


def _main(argv: list[str] | None) -> int:
    import os

    from trainer import logs
    from trainer.errors import CheckpointError, OutputError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # lm_eval run ... (lm-eval >= 0.4.10's subcommand form)
        argv = argv[1:]
    elif argv[:1] in (["ls"], ["validate"]):
        print(f"trainer eval: 'lm_eval {argv[0]}' is lm_eval's own; run lm_eval {argv[0]} ...", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    logs.setup()
    try:
        import lm_eval  # noqa: F401
        from lm_eval.utils import setup_logging
    except ImportError:
        from torchtitan_ext.evaluation.lm import INSTALL_HINT

        print(INSTALL_HINT, file=sys.stderr)
        return 2
    if args.verbosity is not None and not isinstance(logging.getLevelName(args.verbosity), int):
        print(f"trainer eval: --verbosity {args.verbosity}: not a log level (DEBUG, INFO, WARNING, ERROR, "
              "CRITICAL)", file=sys.stderr)
        return 2
    setup_logging(args.verbosity or "INFO")  # lm_eval's console logging (--write_out prints through it)
    tasks = [t.strip() for item in (args.tasks or []) for t in item.split(",") if t.strip()]
    rank = _rank()
    t0 = time.perf_counter()
    try:
        if not tasks:
            raise ValueError("--tasks is required (lm-eval task or group names)")
        _refuse(args)
        model, model_args = _model_and_args(args)
        _check_output_path(args, model_args)
        _device(args)
        ngpu = _ngpu()
        if ngpu > 1 and "WORLD_SIZE" not in os.environ:
            return _launch(ngpu, argv)
        lm = _build_lm(model, model_args, args, layout=_layout() if model == "trainer" else None)
        results, tracker = _run(lm, model, model_args, args, tasks)
    except CheckpointError as e:  # a damaged checkpoint: nothing was evaluated
        if rank == 0:
            print(f"trainer eval: {e}", file=sys.stderr)
        return e.exit_code
    except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
        if rank == 0:
            print(f"trainer eval: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if not _unreachable_hub(e):
            raise
        if rank == 0:
            print(f"trainer eval: the data of {', '.join(tasks)} is not on this machine and the Hugging Face Hub "
                  f"cannot be reached ({str(e).strip().splitlines()[0][:160]}): fetch it once where the Hub is "
                  "reachable (it stays in the datasets cache, HF_DATASETS_CACHE), or point at local data with a "
                  "task YAML (dataset_path: json, data_files) in a folder given by --include_path "
                  "(docs/export_eval.md, Local tasks)", file=sys.stderr)
        return 4
    if results is None or rank != 0:  # ranks other than 0 under torchrun
        return 0
    for key, value in _tokenizer_info(lm).items():
        results.setdefault(key, value)
    try:
        _save(results, tracker, model, model_args, args)
    except OutputError as e:  # after a save lm-eval only logged: the table is still worth printing
        print(f"trainer eval: {e}", file=sys.stderr)
        _report(results, model, model_args, args, time.perf_counter() - t0)
        return e.exit_code
    _report(results, model, model_args, args, time.perf_counter() - t0)
    return 0
