"""Checkpoints: save and resume the whole training state with ``torch.distributed.checkpoint`` (DCP).

One owner per concern:

* :mod:`~trainer.checkpoint.layout`: the folders on disk, the commit marker, the one scanner
  (:func:`scan_folder`), validation, atomic writes and sizes (no process group);
* :mod:`~trainer.checkpoint.state`: what a checkpoint holds and the explicit components it is taken from;
* :mod:`~trainer.checkpoint.manager`: :class:`CheckpointManager`, what the training loop calls, with
  :mod:`~trainer.checkpoint.saving`, :mod:`~trainer.checkpoint.loading`, :mod:`~trainer.checkpoint.space`
  and :mod:`~trainer.checkpoint.agree` (how all ranks agree on a save's or load's outcome);
* :mod:`~trainer.checkpoint.offline`: single-process reading for tools (export, eval, generate);
* :mod:`~trainer.checkpoint.cli`: ``trainer checkpoint list|inspect``.
"""

from trainer.checkpoint.cli import main
from trainer.checkpoint.layout import (
    DATALOADER_JSON,
    DATALOADER_PT,
    DCP_METADATA,
    DEFAULT_FOLDER,
    FORMAT_VERSION,
    MARKER,
    OLD_SUFFIX,
    TMP_SUFFIX,
    CheckpointInfo,
    checkpoint_folders,
    human_bytes,
    inspect_checkpoint,
    locate_folder,
    scan_folder,
    step_dirname,
    tree_size,
    validate_checkpoint,
)
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.offline import (
    CheckpointNotFound,
    checkpoint_model_entries,
    find_checkpoint,
    find_run_config,
    load_checkpoint_state_dict,
)
from trainer.checkpoint.state import (
    EXPORT_DTYPES,
    STATE_KEYS,
    TrainState,
    estimate_checkpoint_bytes,
    load_loader_global_state,
    merge_loader_states,
    merge_model_parts,
)
from trainer.errors import (
    CheckpointError,  # re-exported: where callers used to import it from
)

__all__ = [
    "DATALOADER_JSON", "DATALOADER_PT", "DCP_METADATA", "DEFAULT_FOLDER", "EXPORT_DTYPES", "FORMAT_VERSION", "MARKER",
    "OLD_SUFFIX", "STATE_KEYS", "TMP_SUFFIX", "CheckpointError", "CheckpointInfo",
    "CheckpointManager", "CheckpointNotFound", "TrainState", "checkpoint_folders", "checkpoint_model_entries",
    "estimate_checkpoint_bytes", "find_checkpoint", "find_run_config", "human_bytes",
    "inspect_checkpoint", "load_checkpoint_state_dict", "load_loader_global_state", "locate_folder", "main",
    "merge_loader_states", "merge_model_parts", "scan_folder", "step_dirname",
    "tree_size", "validate_checkpoint",
]
