"""Failure diagnosis: the one line a rank reports when it fails because of something outside its own code.

A rank that waits on another rank that stopped or hung sees only gloo's or NCCL's error, which names no
rank, node or collective: :func:`peer_failure` turns it into one line naming this rank, its node and host,
the step, and the collective it was in (from the flight recorder, ``comm.trace_buf_size``). A write that
failed because of the disk or the folder is the user's to fix, not a bug: :func:`output_failure`. Anything
else is a bug and keeps its traceback (the callers re-raise it).
"""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.errors import OutputError

# Writing outputs failed because of the disk or the folder, not a bug: one line, exit code 5.
OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR,
                 errno.EEXIST}

_COLLECTIVE_FAILURES = ("timed out waiting", "watchdog caught collective operation timeout",
                        "connection closed by peer", "connection reset by peer")


def output_failure(exc: OSError, dump_folder: Path | str | None) -> OutputError | None:
    """The one-line error for a write the disk or the folder refused (full, read-only, not permitted), naming
    the file and the fix; None for any other OSError (a bug)."""
    if exc.errno not in OUTPUT_ERRNOS:
        return None
    where = exc.filename or (f"the dump folder {dump_folder}" if dump_folder is not None else "the dump folder")
    return OutputError(f"cannot write {where}: {exc.strerror}; free space or choose a writable job.dump_folder")


def collective_failure_note(exc: BaseException, step: int | None) -> str | None:
    """For a collective that timed out or lost its peer: one line naming this rank, its node and host, the
    step (``step``: the last one finished, None before training), and the collective it was in (the flight
    recorder's oldest unfinished entry: op, group, its ranks), since gloo's own error names none of these.
    None for any other error."""
    text = str(exc)
    if not (isinstance(exc, RuntimeError) and any(p in text.lower() for p in _COLLECTIVE_FAILURES)):
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    what = "timed out" if "time" in text.lower() else "lost a peer"
    where = (f"rank {dist.get_rank()} of {dist.get_world_size()} (node {os.environ.get('GROUP_RANK', 0)}, "
             f"local rank {os.environ.get('LOCAL_RANK', 0)}, host {socket.gethostname()})")
    if step is not None:
        where += f" after step {step}"
    return f"collective {what} on {where}: {pending_collective()}; error: {text.strip().splitlines()[0][:300]}"


def peer_failure(exc: BaseException, step: int | None) -> str | None:
    """The one line for an error that says another rank or node stopped or hung (a collective that timed out
    or lost its peer; the job's store gone, as when another node fails during start-up); None for others."""
    note = collective_failure_note(exc, step)
    if note is not None:
        return note
    if isinstance(exc, dist.DistError):  # DistNetworkError, DistStoreError: the job's TCP store
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        return (f"rank {os.environ.get('RANK', 0)} (node {os.environ.get('GROUP_RANK', 0)}, host "
                f"{socket.gethostname()}) lost the job's store: another node or rank stopped "
                f"first (its console has the cause) or the rendezvous endpoint is unreachable; error: {first}")
    return None


def pending_collective() -> str:
    """The collective this rank is stuck in, from the flight recorder (comm.trace_buf_size)."""
    try:
        from trainer.torch_compat import flight_recorder_dump, process_groups

        entries = []
        dumps = [flight_recorder_dump("generic", as_json=True)]
        if torch.cuda.is_available():
            dumps.append(flight_recorder_dump("nccl", as_json=True))
        for dump in dumps:
            try:
                entries += json.loads(dump()).get("entries", []) if dump is not None else []
            except Exception:  # one recorder unreadable: use the other
                pass
        if not entries:
            return "collective unknown (flight recorder empty or off: comm.trace_buf_size)"
        open_ = [e for e in entries if not e.get("retired") and e.get("state") != "completed"]
        e = min(open_, key=lambda x: x.get("time_created_ns", 0)) if open_ else entries[-1]
        name, desc = (list(e.get("process_group") or ["?", "?"]) + ["?"])[:2]
        ranks = next((dist.get_process_group_ranks(pg) for pg in process_groups() if pg.group_name == name), "?")
        return (f"{e.get('profiling_name', '?')} on process group {desc} (ranks {ranks}), its collective "
                f"#{e.get('collective_seq_id', '?')}, input sizes {e.get('input_sizes')}, timeout "
                f"{e.get('timeout_ms', '?')} ms")
    except Exception as err:  # diagnosis must never mask the original error
        return f"collective unknown ({err})"
