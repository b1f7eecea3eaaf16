"""``[fault_tolerance]``: torchtitan v0.2.2's keys (its core section and the semi-synchronous keys its
``torchtitan.components.ft.config`` adds), with their names, defaults and meanings, and their rules.

A fault-tolerant job is several replica groups, each its own launch (``run_train.sh``) with its own
``fault_tolerance.replica_id``; FSDP (and TP) run inside a group, and the groups average their gradients
through torchft's Manager, whose process group is rebuilt whenever a group leaves or joins (quorum through
a lighthouse: ``trainer lighthouse``, address in ``TORCHFT_LIGHTHOUSE``). See docs/multinode.md.

Torch-free, and torchft is looked up (not imported) here: a job without the section never imports it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field

from trainer.errors import ConfigError

SEMI_SYNC_METHODS = ("local_sgd", "diloco")
PROCESS_GROUPS = ("gloo", "nccl")
# torchtitan's module that only adds the semi-synchronous keys below: its files name it, and it is honoured
# by this section itself.
TORCHTITAN_FT_CONFIG_MODULE = "torchtitan.components.ft.config"
INSTALL_HINT = "pip install torchft (or the project's dev extra)"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"

logger = logging.getLogger("trainer")


@dataclass
class FaultTolerance:
    enable: bool = False
    """Train as one replica group of a fault-tolerant job (torchft): the groups average gradients every step
    through torchft's Manager; a group that dies is left out of the next step and the others keep
    training; when it is started again it takes the weights and optimizer state from a live group. Needs
    torchft (pip install torchft), a lighthouse (`trainer lighthouse`, its address in TORCHFT_LIGHTHOUSE),
    one launch per group with its replica_id, and parallelism.data_parallel_replicate_degree = 1 (the groups
    are the replicas). See docs/multinode.md."""
    process_group: str = "gloo"
    """Backend of the process group between replica groups: "gloo" (CPU and GPU) or "nccl" (GPU only)."""
    process_group_timeout_ms: int = 10000
    """A collective between replica groups that takes longer than this aborts, and the group that hung is
    left out of the next quorum."""
    quorum_timeout_ms: int = 60000
    """torchft's quorum_timeout: how long a step's quorum may take. A lighthouse that died mid-run is found
    after this long: the group saves a checkpoint of its last step (checkpoint.enable) and stops in one line
    naming TORCHFT_LIGHTHOUSE (exit 7)."""
    connect_timeout_ms: int = 60000
    """torchft's connect_timeout: how long a connection to the lighthouse (or another group's Manager) may
    take. A lighthouse that does not answer at start stops the group in one line naming TORCHFT_LIGHTHOUSE
    (exit 7) before anything is written."""
    join_timeout_ms: int = 10000
    """At start, how long a group waits for all group_size groups to be up at the lighthouse before its
    first step, so that groups launched together take step 1 together (as `trainer lighthouse
    --join_timeout_ms` is how long a quorum waits for them); past it, the group starts with those that are
    up and says which are missing. A group joining a job that is already training does not wait."""
    replica_id: int = 0
    """This replica group's id, 0 .. group_size - 1: its part of the data stream, its log folder
    <dump_folder>/replica_<id>, its name in the lighthouse. A group started with an id that a live group
    of the job already has stops in one line (exit 2) before it writes or trains anything."""
    group_size: int = 0
    """The number of replica groups of the job (must be >= 1 when enabled). The data stream is split over
    group_size x the data-parallel ranks of one group."""
    min_replica_size: int = 1
    """The fewest replica groups a step needs; with fewer, the step is not committed (the groups wait for
    more to join)."""
    semi_sync_method: str | None = None
    """None: synchronous training (gradients averaged every step). "local_sgd" or "diloco": each group
    steps on its own and the groups synchronise every sync_steps steps (torchft's LocalSGD / DiLoCo)."""
    sync_steps: int = 5
    """Steps between two synchronisations of semi_sync_method (unused without it)."""
    should_quantize: bool = False
    """DiLoCo: quantise the pseudo-gradients before their all-reduce (needs Triton on GPUs; unused without
    semi_sync_method)."""
    fragment_sync_delay: int = 0
    """DiLoCo: inner steps between issuing a fragment's all-reduce and waiting for it (Streaming DiLoCo's
    tau; must be < sync_steps)."""
    fragment_update_alpha: float = 0.0
    """DiLoCo: how much of the local parameters to mix into the synchronised ones (0: take the global ones,
    so every group holds the same weights after a synchronisation)."""
    module_fqns_per_model_fragment: list[list[str]] = field(default_factory=list)
    """DiLoCo: the module names of each model fragment, e.g. [["tok_embeddings","layers.0"],["layers.1",
    "norm","output"]]; empty: num_fragments fragments of consecutive layers."""
    num_fragments: int = 1
    """DiLoCo: fragments the model is split into (Streaming DiLoCo syncs them in turn); unused with
    module_fqns_per_model_fragment."""
    outer_lr: float = 0.7
    """DiLoCo: the learning rate of the outer SGD applied to the averaged pseudo-gradients (0.7, with
    outer_momentum 0.9 and Nesterov, is the DiLoCo paper's and torchtitan's fixed choice; 1 with momentum 0
    makes a synchronisation the plain average of the groups' parameters, as local_sgd)."""
    outer_momentum: float = 0.9
    """DiLoCo: the outer SGD's momentum (Nesterov when > 0). Tuned in the DiLoCo paper for hundreds of
    inner steps per synchronisation; over few, short rounds it overshoots (docs/multinode.md)."""


SECTION_DOC = {
    "fault_tolerance": "Replica groups that survive a dead group (torchft): see docs/multinode.md.",
}


def torchft_installed() -> bool:
    return importlib.util.find_spec("torchft") is not None


def check_config(config) -> None:
    """The section's rules; nothing is checked while it is disabled (torchtitan's files set its keys)."""
    ft: FaultTolerance = config.fault_tolerance
    if not ft.enable:
        return
    if ft.process_group not in PROCESS_GROUPS:
        raise ConfigError(f"fault_tolerance.process_group must be one of {', '.join(PROCESS_GROUPS)}, got "
                          f"{ft.process_group!r}")
    if ft.semi_sync_method is not None and ft.semi_sync_method.lower() not in SEMI_SYNC_METHODS:
        raise ConfigError(f"fault_tolerance.semi_sync_method must be unset, \"local_sgd\" or \"diloco\", got "
                          f"{ft.semi_sync_method!r}")
    for key in ("process_group_timeout_ms", "quorum_timeout_ms", "connect_timeout_ms", "sync_steps", "num_fragments",
                "min_replica_size"):
        if getattr(ft, key) < 1:
            raise ConfigError(f"fault_tolerance.{key} must be >= 1, got {getattr(ft, key)}")
    if ft.join_timeout_ms < 0:
        raise ConfigError(f"fault_tolerance.join_timeout_ms must be >= 0 (0: do not wait for the other groups), got "
                          f"{ft.join_timeout_ms}")
    if not 0 <= ft.fragment_sync_delay < ft.sync_steps:
        raise ConfigError(f"fault_tolerance.fragment_sync_delay must be >= 0 and < sync_steps ({ft.sync_steps}), "
                          f"got {ft.fragment_sync_delay}")
    if ft.outer_lr <= 0 or not 0.0 <= ft.outer_momentum < 1.0:
        raise ConfigError(f"fault_tolerance.outer_lr must be > 0 and outer_momentum in [0, 1), got {ft.outer_lr} and "
                          f"{ft.outer_momentum}")
    if not 0.0 <= ft.fragment_update_alpha <= 1.0:
        raise ConfigError(f"fault_tolerance.fragment_update_alpha must be in [0, 1], got {ft.fragment_update_alpha}")
    if ft.semi_sync_method is not None and ft.semi_sync_method.lower() == "diloco":
        fragments = len(ft.module_fqns_per_model_fragment) or ft.num_fragments
        if ft.sync_steps % fragments:
            raise ConfigError(f"fault_tolerance.sync_steps ({ft.sync_steps}) must be a multiple of the number of "
                              f"model fragments ({fragments}): DiLoCo syncs one fragment every sync_steps / fragments "
                              "steps")
        if ft.fragment_sync_delay >= ft.sync_steps // fragments:
            raise ConfigError(f"fault_tolerance.fragment_sync_delay ({ft.fragment_sync_delay}) must be < sync_steps / "
                              f"fragments ({ft.sync_steps // fragments})")
    if not config.job.dry_run:  # a torchtitan file names the groups on the command line: a dry run checks the file
        if ft.group_size < 1:
            raise ConfigError("fault_tolerance.group_size must be the number of replica groups (>= 1) when "
                              "fault_tolerance.enable is true")
        if not 0 <= ft.replica_id < ft.group_size:
            raise ConfigError(f"fault_tolerance.replica_id must be in 0 .. group_size - 1 ({ft.group_size - 1}), got "
                              f"{ft.replica_id}")
        if ft.min_replica_size > ft.group_size:
            raise ConfigError(f"fault_tolerance.min_replica_size ({ft.min_replica_size}) must be <= group_size "
                              f"({ft.group_size})")
    p = config.parallelism
    if p.data_parallel_replicate_degree != 1:
        raise ConfigError(f"parallelism.data_parallel_replicate_degree = {p.data_parallel_replicate_degree} with "
                          "fault_tolerance.enable: the replica groups are the replicas; set it to 1 and launch "
                          "fault_tolerance.group_size groups")
    if p.pipeline_parallel_degree > 1:
        raise ConfigError("fault_tolerance.enable with parallelism.pipeline_parallel_degree > 1 is not supported: "
                          "use FSDP (and TP) inside each replica group")
    if not torchft_installed():
        raise ConfigError(f"fault_tolerance.enable needs torchft, which is not installed: {INSTALL_HINT}")
    if not config.job.dry_run and not os.environ.get(LIGHTHOUSE_ENV):
        raise ConfigError(f"fault_tolerance.enable needs the lighthouse's address in {LIGHTHOUSE_ENV}: start one with "
                          "`trainer lighthouse` and export the address it prints (docs/multinode.md)")


def data_parallel(ft: FaultTolerance, dp: int, dp_rank: int) -> tuple[int, int]:
    """The loader's (degree, rank) over the whole job: each replica group reads its own part of the stream,
    group g's data-parallel rank r being g x dp + r of group_size x dp, as one HSDP job's ranks would."""
    if not ft.enable:
        return dp, dp_rank
    logger.info("fault tolerance: replica group %d of %d (lighthouse %s); this group reads data-parallel parts "
                "%d..%d of %d", ft.replica_id, ft.group_size, os.environ.get(LIGHTHOUSE_ENV, "unset"),
                ft.replica_id * dp, ft.replica_id * dp + dp - 1, ft.group_size * dp)
    return ft.group_size * dp, ft.replica_id * dp + dp_rank


def group_dump_folder(config) -> str:
    """Where this launch writes its outputs (config.toml, metrics.jsonl, TensorBoard, summary.json): a replica
    group of a fault-tolerant job under <job.dump_folder>/replica_<id>, so that the groups of one job share
    its dump folder (and its checkpoints, trainer/checkpoint/replicas.py); any other run in job.dump_folder.
    The run's config holds it as job.dump_folder (trainer/config/derive.py)."""
    ft: FaultTolerance = config.fault_tolerance
    if ft.enable:
        return os.path.join(config.job.dump_folder, f"replica_{ft.replica_id}")
    return config.job.dump_folder


def job_identity(config, env=os.environ) -> str | None:
    """The name the replica groups of one fault-tolerant job share for the run lock: their lighthouse."""
    if config.fault_tolerance.enable and env.get(LIGHTHOUSE_ENV):
        return f"torchft@{env[LIGHTHOUSE_ENV]}"
    return None
