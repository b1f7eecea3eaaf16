"""torchrun for run_train.sh: a worker's failure ends the launcher with one line and the worker's exit code.

``python -m trainer.launch <torchrun options> -m trainer.train <trainer options>`` is
``python -m torch.distributed.run`` with the same options, except for what a failure prints. torchrun
reports a failed worker with a ``ChildFailedError`` traceback and exit code 1 whatever the worker said.
Here:

- a worker ending on a user's mistake (``TrainerError``: config 2, checkpoint or stopped 3, data 4) writes
  its one line to the error file torchrun gives each worker (``TORCHELASTIC_ERROR_FILE``; ``record_failure``);
- the launcher catches torchrun's ``ChildFailedError``, prints the first failed rank's line on stderr, and
  exits with that worker's code;
- a bug (any other exception) keeps its traceback (torchrun's ``record`` writes it to the error file, the
  worker prints it) and the launcher names the log;
- torchrun's own log lines and its full failure report go to ``<dump_folder>/launcher/<host>.log``, which
  every failure line names;
- the job holds the dump folder's run lock (trainer/runlock.py) for its whole life, torchrun's restarts
  included: the first node's launcher takes it, the job's other nodes join it (the job is named by its
  rendezvous id and endpoint), and a launch of another job into the same folder ends at once with one line
  and exit code 6;
- a dump folder it cannot write ends with one line and exit code 5;
- SIGTERM/SIGINT: torchrun forwards the signal, the workers save and exit (trainer/preemption.py), and the
  launcher prints their line and exits with 128 + the signal's number.
"""

from __future__ import annotations

if __name__ == "__main__":  # before torch's import, which takes seconds (trainer/startup.py)
    from trainer import startup

    startup.begin()

import json
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from trainer.config import load_config

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def record_failure(label: str, message: str) -> None:
    """Worker side: leave this process's one-line error where torchrun's agent reads it.

    Written whole or not at all (``write_file_atomic``: a file of its own, renamed onto the path): the agent
    parses the file of every failed worker, and on a half-written one its own process ends with a traceback
    instead of the job's failure line. A rank that sees another rank's failure can be stopped as it writes: the agent sends
    the surviving workers SIGTERM, and the training loop's handler for it is gone by then. A worker stopped
    before the rename leaves no file, and the agent reports it by its exit code."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return  # not under torchrun
    from trainer.checkpoint.layout import write_file_atomic

    line = " ".join(f"{label}: {message}".split("\n"))  # the launcher prints it as one line
    try:
        write_file_atomic(Path(path), json.dumps({"message": line, "timestamp": int(time.time())}).encode())
    except OSError:
        pass  # the console line was printed already; the report just lacks it


def _job(trainer_argv: list[str]) -> tuple[str, int, str | None, str]:
    """(job.dump_folder, job.lock_stale_after_s, the job's name for the run lock when it is one replica group
    of a fault-tolerant job, the folder this launch's outputs go to) of the trainer's command line."""
    from trainer.fault_tolerance.config import group_dump_folder, job_identity as replica_group_job

    try:
        config = load_config(trainer_argv)  # parsing only: the pre-flight validated
        # A replica group's outputs: <dump_folder>/replica_<id>.
        return (config.job.dump_folder, config.job.lock_stale_after_s, replica_group_job(config),
                group_dump_folder(config))
    except Exception:  # the pre-flight has validated the config; this is only where the log goes
        return "./outputs", 300, None, "./outputs"


def job_identity(args) -> str | None:
    """A multi-node job's name as every node's launcher sees it: its rendezvous id and endpoint (None for a
    single-node launch)."""
    max_nodes = str(getattr(args, "nnodes", "1")).split(":")[-1]
    if getattr(args, "standalone", False) or max_nodes == "1":
        return None
    return f"{args.rdzv_id}@{args.rdzv_endpoint}"


def _take_lock(dump_folder: str, stale_after_s: int, job: str | None):
    """The dump folder's run lock, for the whole job (torchrun restarts included): the first node's launcher
    takes it, the other nodes of the same job join it, any other job is refused."""
    from trainer.runlock import ENV, RunLock

    if stale_after_s <= 0:
        return None
    lock = RunLock(Path(dump_folder), stale_after_s, job=job).acquire()
    os.environ[ENV] = str(lock.path)  # the workers inherit it: held already (by this node or the job's first)
    return lock


def _summary_error(dump_folder: str) -> str | None:
    """The error line of the run's summary.json (e.g. a preemption's), if rank 0 wrote one."""
    try:
        s = json.loads((Path(dump_folder) / "summary.json").read_text())
        return s.get("error") if s.get("status") == "preempted" else None
    except (OSError, ValueError, AttributeError):
        return None


def _log_file(dump_folder: str) -> str:
    """torchrun's log lines (agent, rendezvous, failures) go to a file, not the console."""
    path = os.path.join(dump_folder, "launcher", f"{socket.gethostname()}.log")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    elastic = logging.getLogger("torch.distributed")
    elastic.handlers[:] = [handler]
    elastic.setLevel(logging.INFO)
    elastic.propagate = False
    elastic.info("launch: %s", " ".join(sys.argv))
    return path


def _failure_line(error, log_path: str) -> tuple[str, int]:
    """The console line and the exit code for torchrun's ChildFailedError."""
    rank, failure = error.get_first_failure()
    code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # a signal: 128 + its number
    message = failure.message
    if isinstance(message, dict):  # written by torchrun's `record` for an uncaught exception: a bug
        text = str(message.get("message", "")).strip().splitlines()
        return (f"error: rank {rank} failed with a bug (exit {code}): {text[-1] if text else '?'}; its traceback "
                f"is on that rank's console and in {log_path}"), code
    if failure.error_file_data.get("message") == message and message:  # the worker's own one line
        return f"{message} (rank {rank}; torchrun's report: {log_path})", code
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {code}"
    return f"error: rank {rank} {how}; the cause is on that rank's console; torchrun's report: {log_path}", code


def _import_torch_without_cpp_warnings() -> None:
    """The agent's own C++ warnings (a lost TCPStore connection prints a 30-frame C++ stack before the
    Python error is raised) are left out of the console: the failure is reported in one line. Only this
    process: the workers, started later, get the user's TORCH_CPP_LOG_LEVEL (read once, at torch's import)."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ or "torch" in sys.modules:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        import torch  # noqa: F401
    finally:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def _lost_rendezvous_line(error: BaseException, args, log_path: str) -> str:
    """One line for torchrun's rendezvous or store failing under this node's launcher: with c10d, when
    another node's launcher stops (its own start-up failed), this node loses the store it hosted or
    shared. The innermost error (DistNetworkError, ...) is the one that says what happened."""
    inner = error
    while inner.__cause__ is not None or inner.__context__ is not None:
        inner = inner.__cause__ or inner.__context__
    first = (str(inner).strip().splitlines() or [""])[0][:200]
    node = os.environ.get("NODE_RANK", getattr(args, "node_rank", "?"))
    return (f"error: node {node} lost the job's rendezvous ({getattr(args, 'rdzv_endpoint', '') or 'local'}): "
            f"another node's launcher or workers stopped first, and that node's console has the cause (or the "
            f"endpoint is unreachable); {type(inner).__name__}: {first}; torchrun's log: {log_path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _import_torch_without_cpp_warnings()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    from trainer import startup

    startup.imports_done()
    args = parse_args(argv)
    dump_folder, stale_after_s, replica_group_job, outputs = _job(list(args.training_script_args))
    from trainer.errors import PeerLost, TrainerError

    lock = None
    try:
        log_path = _log_file(outputs)
        lock = _take_lock(dump_folder, stale_after_s, replica_group_job or job_identity(args))
    except TrainerError as e:
        print(f"{e.label}: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print(f"output error: cannot write to job.dump_folder {dump_folder}: {e.strerror or e}; choose a writable "
              f"folder", file=sys.stderr)
        return 5
    try:
        run(args)
    except ChildFailedError as e:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(e.format_msg() + "\n")
        line, code = _failure_line(e, log_path)
        print(line, file=sys.stderr)
        return code
    except (DistError, RendezvousError) as e:  # the job's rendezvous or store is gone: another node stopped
        with open(log_path, "a", encoding="utf-8") as f:
            traceback.print_exc(file=f)
        print(_lost_rendezvous_line(e, args, log_path), file=sys.stderr)
        return PeerLost.exit_code
    except SignalException as e:  # SIGTERM/SIGINT to the launcher: the workers were stopped
        saved = _summary_error(outputs)
        print(f"stopped by signal {e.sigval.name}" + (f": {saved}" if saved else "") +
              f"; torchrun's log: {log_path}", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        if lock is not None:
            lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
