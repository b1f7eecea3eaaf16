"""``trainer data ...`` subcommands: audit, inspect and prepare.

    trainer data audit [--json] [--sequences N] [CONFIG OVERRIDES]
    trainer data inspect [--source SPEC ...] [--json] [--documents N] [CONFIG OVERRIDES]
    trainer data prepare --output DIR [--source SPEC] [--workers N] [--overwrite] [CONFIG OVERRIDES]

Config overrides are the training command line (``--job.config_file x.toml --training.seq_len 256``),
optionally after a ``--``. Without a config file (``--job.config_file`` or ``$CONFIG_FILE``) the config is
the one ``./run_train.sh`` trains by default, train_configs/debug_model.toml; the reports name the file.
An audit that finds a boundary without exactly one separator, or packs no sequence, exits 4 with the reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainer.config import ConfigError, load_config, validate
from trainer.errors import DataError, TrainerError

# What ./run_train.sh trains without CONFIG_FILE; the data tools default to it too.
RUN_TRAIN_CONFIG = Path(__file__).resolve().parents[2] / "train_configs" / "debug_model.toml"


def _build_tokenizer(config):
    from tokenizer import DEBUG_TOKENIZER_PATH, build_tokenizer

    return build_tokenizer(config.model.tokenizer_path or DEBUG_TOKENIZER_PATH)


def _split_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        args, unknown = parser.parse_known_args(argv[:cut])
        return args, unknown + argv[cut + 1:]
    return parser.parse_known_args(argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainer data", description="Inspect and prepare training data. The config "
                                     "is the training command line's; without a config file (--job.config_file or "
                                     "CONFIG_FILE), train_configs/debug_model.toml, as ./run_train.sh.")
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("audit", help="report documents, tokens, sequences, separators, skips and mixture shares",
                       description="Walk the training data of a config (one pass by default) and report on it; "
                                   "exit 4 after the report when no sequence is packed or a document boundary does "
                                   "not carry exactly one separator. Other options are config overrides, as for "
                                   "training.")
    a.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    a.add_argument("--sequences", type=int, default=None,
                   help="stop after this many packed sequences (default: one full pass over the data)")
    i = sub.add_parser("inspect", help="documents, tokens, lengths, largest id and separators of token files",
                       description="Read pre-tokenized sources (megatron, numpy, token arrow, prepared tokens) as "
                                   "training reads them and report on them. Other options are config overrides "
                                   "(the tokenizer and model give the EOS/BOS ids and the vocabulary).")
    i.add_argument("--source", action="append", default=None,
                   help="source spec, e.g. 'megatron:/data/dolma_text_document' (repeatable; default: the config's "
                        "training sources)")
    i.add_argument("--json", action="store_true", help="print the reports as JSON (for scripts)")
    i.add_argument("--documents", type=int, default=None, help="stop after this many documents per source")
    p = sub.add_parser("prepare", help="tokenize a corpus into memory-mapped token files (the fastest source)",
                       description="Tokenize a source in parallel into a folder usable as a 'tokens:DIR' source. "
                                   "Other options are config overrides, as for training.")
    p.add_argument("--output", "-o", required=True, help="output folder")
    p.add_argument("--source", default=None,
                   help="source spec, e.g. 'jsonl:/data/*.jsonl' (default: the config's single training source)")
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: all CPUs)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing prepared folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str]) -> int:
    """Entry point of ``trainer data``; returns the process exit code."""
    parser = _parser()
    args, overrides = _split_overrides(parser, list(argv))
    try:
        config = load_config(overrides)
        if not config.job.config_file and RUN_TRAIN_CONFIG.is_file():
            config = load_config(["--job.config_file", str(RUN_TRAIN_CONFIG), *overrides])
        validate(config)
        tokenizer = _build_tokenizer(config)
        if args.command == "audit":
            return _audit(args, config, tokenizer)
        if args.command == "inspect":
            return _inspect(args, config, tokenizer)
        return _prepare(args, config, tokenizer)
    except TrainerError as e:  # data errors exit 4, config errors 2 (trainer/errors.py)
        print(f"{e.label}: {e}", file=sys.stderr)
        return e.exit_code
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _inspect(args, config, tokenizer) -> int:
    from trainer.data.inspector import format_reports, inspect_sources

    if args.documents is not None and args.documents < 1:
        raise ConfigError("--documents must be >= 1")
    reports = inspect_sources(config, tokenizer, args.source, max_documents=args.documents)
    for r in reports:
        r["config"] = config_name(config)
    print(json.dumps(reports, indent=2) if args.json else format_reports(reports))
    return 0


def config_name(config) -> str:
    """The config file a data tool read, as the reports show it."""
    return config.job.config_file or "none (built-in defaults)"


def _audit(args, config, tokenizer) -> int:
    from trainer.data.audit import audit, audit_problem, format_table

    if args.sequences is not None and args.sequences < 1:
        print("error: --sequences must be >= 1", file=sys.stderr)
        return 2
    report = audit(config, tokenizer, max_sequences=args.sequences)
    report["config"] = config_name(config)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
    problem = audit_problem(report)
    if problem:
        sys.stdout.flush()  # the report first, then the one line on stderr
        raise DataError(f"trainer data audit: {problem}")
    return 0


def _prepare(args, config, tokenizer) -> int:
    from trainer.errors import ConfigError
    from trainer.data.prepare import prepare
    from trainer.data.sources import training_specs

    if args.source is not None:
        source = args.source
    else:
        specs, _ = training_specs(config)
        if len(specs) != 1:
            raise ConfigError("the config trains on a mixture; choose one source with --source")
        source = specs[0]
    meta = prepare(source, args.output, tokenizer, workers=args.workers, text_field=config.data.text_field,
                   text_document=config.data.text_document, overwrite=args.overwrite,
                   progress=not args.no_progress)
    s = meta["stats"]
    print(f"config: {config_name(config)}")
    print(f"wrote {args.output}: {s['documents']:,} documents, {s['tokens']:,} tokens ({meta['dtype']}); skipped "
          f"empty {s['skipped_empty']:,}, malformed {s['skipped_malformed']:,}, undecodable {s['skipped_undecodable']:,}")
    print(f"train on it with --data.sources tokens:{args.output} (or --training.dataset tokens "
          f"--training.dataset_path {args.output})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
