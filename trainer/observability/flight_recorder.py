"""The collective flight recorder: its environment (set before the process group) and per-rank dumps."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.torch_compat import flight_recorder_dump

logger = logging.getLogger("trainer")


_ENV_SET_HERE: set[str] = set()


def comm_traces_folder(config) -> Path:
    return Path(config.job.dump_folder) / config.comm.save_traces_folder


def setup_flight_recorder(config) -> None:
    """Environment for the collective flight recorder; must run before the process group is created.

    ``comm.trace_buf_size`` entries per rank; NCCL dumps them itself on a collective timeout (to
    ``<dump_folder>/<comm.save_traces_folder>/<prefix><rank>``), and the watchdog dumps them on a hang.
    Variables the user already set are left alone.
    """
    size = config.comm.trace_buf_size
    if size <= 0:
        return
    # torch >= 2.9 names; the older TORCH_NCCL_TRACE_BUFFER_SIZE / TORCH_NCCL_DEBUG_INFO_TEMP_FILE still
    # work but warn. A user's own setting of either name is respected, never overridden.
    values = {"TORCH_FR_BUFFER_SIZE": (str(size), "TORCH_NCCL_TRACE_BUFFER_SIZE"),
              "TORCH_FR_DUMP_TEMP_FILE": (str(comm_traces_folder(config) / config.comm.save_traces_file_prefix),
                                          "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")}
    for name, (value, old_name) in values.items():
        ours = name in _ENV_SET_HERE  # set by an earlier trainer in this process (tests): update it
        if ours or not (name in os.environ or old_name in os.environ):
            os.environ[name] = value
            _ENV_SET_HERE.add(name)
    if torch.cuda.is_available():
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        try:  # NCCL writes there on its own, so the folder must exist beforehand
            comm_traces_folder(config).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            logger.warning("cannot create %s for flight-recorder dumps: %s", comm_traces_folder(config), e)


def dump_flight_recorder(folder: Path, prefix: str, rank: int, extra_folder: Path | None = None) -> list[Path]:
    """Write this rank's flight-recorder buffer(s); returns the files written (none where unavailable).

    ``<folder>/<prefix><rank>`` holds the pickle that ``torchfrtrace <folder>`` reads: NCCL's recorder on
    GPU builds, otherwise the generic one (gloo). On GPU builds
    the generic recorder (the CPU/gloo collectives) is also written as JSON to ``extra_folder``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return []
    nccl = flight_recorder_dump("nccl") if torch.cuda.is_available() else None
    generic = flight_recorder_dump("generic")
    written = []
    main_dump = nccl or generic
    if main_dump is not None:
        path = folder / f"{prefix}{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        path.write_bytes(main_dump())
        written.append(path)
    generic_json = flight_recorder_dump("generic", as_json=True)
    if nccl is not None and generic_json is not None and extra_folder is not None:
        path = extra_folder / f"rank{rank}_gloo_flight_recorder.json"
        extra_folder.mkdir(parents=True, exist_ok=True)
        path.write_bytes(generic_json())
        written.append(path)
    return written
