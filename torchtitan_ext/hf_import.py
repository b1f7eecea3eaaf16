"""``trainer import``: a Hugging Face Llama, Mixtral or Llama 4 folder -> a DCP seed checkpoint for continued
pretraining.

The architecture comes from the folder's config.json alone (:func:`read_hf_args`, the reader that
``generate --hf`` and ``eval --hf`` use too): nothing is taken from a flavor, and a field this model
cannot represent stops the import with one line. The output is what ``checkpoint.create_seed_checkpoint``
writes: ``<output>/checkpoint/step-0`` holding the model only (step 0, committed with its marker), which
the trainer loads under any parallel layout (DCP reshards on load), plus ``<output>/import.toml``, the
``[model]`` keys (flavor ``custom``; a Mixtral's ``[model.moe]`` keys too) and ``[checkpoint]
initial_load_path`` to train with.

Memory: DCP asks its planner for each tensor just before writing it, and this planner reads that tensor
from the safetensors files then (mapping its name, undoing the RoPE permutation of ``wq``/``wk``,
casting), so the process holds one tensor at a time, never the model: a 70B import needs memory for
its largest matrix (the embedding), not for 140 GB of weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import warnings
from pathlib import Path

import torch

from trainer.errors import CheckpointError, ConfigError
from trainer.models.config import model_config_keys
from trainer.models.llama.hf_adapter import (
    HFReader,
    hf_sources,
    native_shape,
    native_weight_names,
    read_hf_args,
    read_native,
)

logger = logging.getLogger("trainer")

IMPORT_TOML = "import.toml"
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def _source_names(args, reader: HFReader, folder: Path) -> dict[str, list[str]]:
    """``{native name: its HF weight names}`` for every entry of the seed (``output.weight`` of a tied model is
    the embedding matrix, saved under both names as the trainer's own checkpoints hold it)."""
    names = {name: hf_sources(name, args, reader) for name in native_weight_names(args)}
    if args.tie_word_embeddings:
        names["output.weight"] = ["model.embed_tokens.weight"]
    missing = sorted({hf for sources in names.values() for hf in sources if hf not in reader})
    if missing:
        raise ConfigError(f"{folder} lacks {len(missing)} weight(s) its config.json calls for, e.g. "
                          f"{', '.join(missing[:3])} (an incomplete download?)")
    return names


def _expected_shape(args, name: str) -> tuple[int, ...]:
    head, kv, dim, ffn = args.head_dim, args.num_kv_heads, args.dim, args.ffn_hidden_dim
    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    experts, hidden = (args.moe.num_experts, args.expert_hidden_dim) if args.moe is not None else (0, 0)
    shared = hidden * args.moe.num_shared_experts if args.moe is not None else 0
    return {
        "moe.shared_experts.w1.weight": (shared, dim), "moe.shared_experts.w3.weight": (shared, dim),
        "moe.shared_experts.w2.weight": (dim, shared),
        "tok_embeddings.weight": (args.vocab_size, dim), "output.weight": (args.vocab_size, dim), "norm.weight": (dim,),
        "attention.wq.weight": (args.n_heads * head, dim), "attention.wk.weight": (kv * head, dim),
        "attention.wv.weight": (kv * head, dim), "attention.wo.weight": (dim, args.n_heads * head),
        "feed_forward.w1.weight": (ffn, dim), "feed_forward.w3.weight": (ffn, dim), "feed_forward.w2.weight": (dim, ffn),
        "attention_norm.weight": (dim,), "ffn_norm.weight": (dim,),
        "moe.router.gate.weight": (experts, dim), "moe.experts.w1": (experts, hidden, dim),
        "moe.experts.w3": (experts, hidden, dim), "moe.experts.w2": (experts, dim, hidden),
    }[leaf]


def _make_planner(loaders: dict):
    """A DCP save planner whose tensors are read only when DCP writes them (``loaders``: fqn -> callable)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class LazySavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            load = loaders.get(index.fqn)
            return load() if load is not None else super().lookup_object(index)

    return LazySavePlanner()


def import_hf(hf_folder: str | Path, output: str | Path, *, dtype: str = "fp32", overwrite: bool = False) -> Path:
    """Write ``<output>/checkpoint/step-0`` (model-only seed) and ``<output>/import.toml`` from a Hugging
    Face Llama, Mixtral or Llama 4 folder; returns the step folder."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.layout import DEFAULT_FOLDER, FORMAT_VERSION, TMP_SUFFIX, commit, step_dirname

    folder = Path(hf_folder)
    if not folder.is_dir():
        raise ConfigError(f"--hf: no such folder '{folder}'")
    args = read_hf_args(folder)
    torch_dtype = _DTYPES[dtype]
    reader = HFReader(folder)
    names = _source_names(args, reader, folder)
    for native, sources in names.items():
        try:
            shape = tuple(reader.shape(sources[0])) if native == "output.weight" else native_shape(reader, native, args)
        except ValueError as e:
            raise ConfigError(f"{folder}: {e}") from None
        if shape != _expected_shape(args, native):
            what = sources[0] if len(sources) == 1 else f"{sources[0]} .. {sources[-1]} (stacked)"
            raise ConfigError(f"{folder}: {what} has shape {shape}, its config.json implies "
                              f"{_expected_shape(args, native)}")

    out = Path(output)
    final = out / DEFAULT_FOLDER / step_dirname(0)
    if final.exists() and not overwrite:
        raise ConfigError(f"--output: {final} exists; pass --overwrite to replace it")
    tmp = final.with_name(final.name + TMP_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    def loader(native: str, sources: list[str]):
        def load() -> torch.Tensor:
            t = reader.get(sources[0]) if native == "output.weight" else read_native(reader, native, args)
            return t.to(torch_dtype).contiguous()
        return load

    # Placeholders on the meta device: DCP plans with shapes and dtypes, and asks for the data when writing.
    state = {"model": {n: torch.empty(_expected_shape(args, n), dtype=torch_dtype, device="meta") for n in names}}
    loaders = {f"model.{n}": loader(n, hf) for n, hf in names.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp), thread_count=1), planner=_make_planner(loaders))
    marker = {"format": FORMAT_VERSION, "step": 0, "kind": "seed", "dtype": str(torch_dtype).replace("torch.", ""),
              "tokens_seen": 0, "skipped_steps": 0, "lr": None, "world_size": 1,
              "layout": "imported from Hugging Face", "source": str(folder.resolve()), "torch": torch.__version__}
    try:
        commit(tmp, final, marker)
    except (OSError, CheckpointError) as e:
        raise CheckpointError(f"could not commit {final}: {e}") from None
    (out / IMPORT_TOML).write_text(import_toml(args, final, folder))
    logger.info("imported %s (%d tensors, %s) to %s", folder, len(names), marker["dtype"], final)
    return final


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def import_toml(args, step_dir: Path, folder: Path) -> str:
    """The config to continue pretraining with: the folder's architecture as [model] keys (and [model.moe]
    for a Mixtral), the seed as checkpoint.initial_load_path, and the folder as hf_assets_path when it holds
    a tokenizer."""
    model = {"name": "llama3", **model_config_keys(args)}
    moe = model.pop("moe", None)
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        model["hf_assets_path"] = str(folder.resolve())
    lines = [f"# {folder.resolve()} as imported by `trainer import`: add to your training config.", "[model]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in model.items()]
    if moe is not None:
        where = "docs/moe.md (Llama 4)" if args.moe.num_shared_experts else "docs/export_eval.md (Mixtral folders)"
        which = "Llama 4's" if args.moe.num_shared_experts else "Mixtral's"
        lines += ["", f"# {which} routing, no load balancing: to add some, see {where}", "[model.moe]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in moe.items()]
    lines += ["", "[checkpoint]", f"initial_load_path = {_toml_value(str(step_dir.resolve()))}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``trainer import --hf DIR --output DIR [--dtype fp32]``."""
    from trainer import logs

    parser = argparse.ArgumentParser(
        prog="trainer import",
        description="Turn a Hugging Face Llama, Mixtral or Llama 4 folder (config.json + safetensors) into a seed "
                    "checkpoint "
                    "(<output>/checkpoint/step-0) and print the [model] keys to continue pretraining with "
                    "(also written to <output>/import.toml).")
    parser.add_argument("--hf", required=True, help="the Hugging Face model folder")
    parser.add_argument("--output", required=True, help="folder to write checkpoint/step-0 and import.toml into")
    parser.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES),
                        help="weight dtype of the seed (default fp32, the trainer's master weights)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing step-0 in --output")
    ns = parser.parse_args(argv)
    logs.setup()
    try:
        import_hf(ns.hf, ns.output, dtype=ns.dtype, overwrite=ns.overwrite)
    except (ConfigError, CheckpointError) as e:
        print(f"trainer import: {e}", file=sys.stderr)
        return e.exit_code
    print((Path(ns.output) / IMPORT_TOML).read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
