"""The ``trainer`` console script: one entry point for the jobs around training.

Training itself runs through ``./run_train.sh`` (torchrun); ``trainer train`` is the same entry for
one process.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from trainer import extensions

# The core's commands: name -> (module with main(argv) -> int, one-line description). Extensions add theirs
# through the registry (trainer/extensions.py).
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("trainer.train", "train in this process (use ./run_train.sh for torchrun and several processes)"),
    "config": ("trainer.config", "print the resolved config as TOML (--markdown: the config reference)"),
    "data": ("trainer.data.cli", "audit a config's data, inspect token files, or tokenize a corpus into token files (prepare)"),
    "checkpoint": ("trainer.checkpoint.cli", "list, inspect or verify checkpoints"),
    "plan": ("trainer.tools.plan.cli", "parameters, FLOPs and memory per GPU for a config and GPU count"),
    "bench": ("trainer.tools.bench", "benchmarks: framework overhead, data loader, checkpoint, GPU"),
    "simulate": ("trainer.tools.simulate.cli", "build and step a layout on N simulated ranks: memory, FLOPs, collectives"),
    "lighthouse": ("trainer.fault_tolerance.lighthouse", "the torchft lighthouse of a fault-tolerant job (prints its "
                   "TORCHFT_LIGHTHOUSE)"),
}


def available() -> dict[str, tuple[str, str]]:
    commands = {**COMMANDS, **extensions.registry().commands}
    return {name: spec for name, spec in commands.items() if importlib.util.find_spec(spec[0]) is not None}


def usage() -> str:
    lines = ["usage: trainer COMMAND [ARGS...]", "", "commands:"]
    for name, (_, doc) in available().items():
        lines.append(f"  {name:<11} {doc}")
    lines += ["", "Run 'trainer COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from trainer import startup
    from trainer.interrupt import quiet_keyboard_interrupt

    if argv is None:  # the process's own command line: its start-up, torch's import included (trainer/startup.py)
        startup.begin("interrupted (Ctrl-C)")
        argv = sys.argv[1:]
    else:  # called by another program: Ctrl-C is one line, the collector is left alone
        quiet_keyboard_interrupt("interrupted (Ctrl-C)")
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    commands = available()
    if name not in commands:
        print(f"trainer: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(commands[name][0])
    startup.imports_done()
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
