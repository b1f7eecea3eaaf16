"""[fault_tolerance] without processes: its rules (one line each), what it changes for the data and the
output folders, the run lock shared by a job's replica groups, that a job without it never imports torchft,
and DiLoCo's model fragments. The runs themselves are in tests/distributed/test_fault_tolerance.py."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support import processes
from tests.support.launch import DEBUG_CONFIG, ROOT
from trainer.config import ConfigError, derive, load_config, validate
from trainer.fault_tolerance import config as ft_config
from trainer.fault_tolerance.config import data_parallel, group_dump_folder, job_identity
from trainer.runlock import RunLock, RunLockedError

ENABLED = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2", "--fault_tolerance.replica_id", "1"]


def config(*args: str):
    return load_config(["--job.config_file", str(DEBUG_CONFIG), *args], env={})


@pytest.mark.parametrize("args, message", [
    (["--fault_tolerance.group_size", "0"], "group_size must be the number of replica groups"),
    (["--fault_tolerance.replica_id", "2"], r"replica_id must be in 0 \.\. group_size - 1 \(1\), got 2"),
    (["--fault_tolerance.min_replica_size", "3"], r"min_replica_size \(3\) must be <= group_size \(2\)"),
    (["--fault_tolerance.process_group", "mpi"], "process_group must be one of gloo, nccl"),
    (["--fault_tolerance.semi_sync_method", "easgd"], "semi_sync_method must be unset"),
    (["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "5",
      "--fault_tolerance.num_fragments", "2"], r"sync_steps \(5\) must be a multiple of the number of model"),
    (["--fault_tolerance.sync_steps", "4", "--fault_tolerance.fragment_sync_delay", "4"],
     "fragment_sync_delay must be >= 0 and < sync_steps"),
    (["--fault_tolerance.fragment_update_alpha", "1.5"], r"fragment_update_alpha must be in \[0, 1\]"),
    (["--parallelism.data_parallel_replicate_degree", "2"], "the replica groups are the replicas"),
    (["--parallelism.pipeline_parallel_degree", "2"], "pipeline_parallel_degree > 1 is not supported"),
])
def test_unsupported_combinations_are_refused_in_one_line(args, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(config(*ENABLED, *args), 2)
    assert "\n" not in str(e.value)


def test_the_lighthouse_address_is_checked_before_launch(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match="needs the lighthouse's address in TORCHFT_LIGHTHOUSE: start one with "
                                          "`trainer lighthouse`"):
        validate(config(*ENABLED), 2)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://head:29510")
    validate(config(*ENABLED), 2)


def test_disabled_section_checks_nothing_and_imports_no_torchft():
    validate(config("--fault_tolerance.group_size", "0", "--fault_tolerance.process_group", "nccl"), 1)
    code = ("import sys; from trainer.train import Trainer; from trainer.config import load_config, validate; "
            f"validate(load_config(['--job.config_file', {str(DEBUG_CONFIG)!r}], env={{}}), 1); "
            "assert 'torchft' not in sys.modules, 'torchft imported'")
    out = processes.run([sys.executable, "-c", code], cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_missing_torchft_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setattr(ft_config, "torchft_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"needs torchft, which is not installed: pip install torchft"):
        validate(config(*ENABLED), 1)


def test_each_group_reads_its_own_part_of_the_stream():
    ft = config(*ENABLED).fault_tolerance
    # Group 1 of 2 with 4 ranks per group: the ranks HSDP's replica 1 would have (4..7 of 8).
    assert [data_parallel(ft, 4, r) for r in range(4)] == [(8, 4), (8, 5), (8, 6), (8, 7)]
    assert data_parallel(config().fault_tolerance, 4, 3) == (4, 3)


def test_each_group_writes_under_its_replica_folder(tmp_path):
    """The run's config (derived once) holds the group's output folder; the parsed one keeps the job's."""
    c = config(*ENABLED, "--job.dump_folder", str(tmp_path))
    assert group_dump_folder(c) == str(tmp_path / "replica_1")
    assert derive(c, "cpu").job.dump_folder == str(tmp_path / "replica_1") and c.job.dump_folder == str(tmp_path)
    plain = config("--job.dump_folder", str(tmp_path))
    assert group_dump_folder(plain) == str(tmp_path) == derive(plain, "cpu").job.dump_folder


def test_the_groups_of_one_job_share_the_dump_folder_lock(tmp_path):
    env = {"TORCHFT_LIGHTHOUSE": "http://head:29510"}
    name = job_identity(config(*ENABLED), env)
    assert name == "torchft@http://head:29510" and job_identity(config(), env) is None
    first = RunLock(tmp_path, 300, job=name).acquire()
    second = None
    try:
        second = RunLock(tmp_path, 300, job=name).acquire()
        assert second.joined  # another replica group of the job
        with pytest.raises(RunLockedError, match="in use by another run"):  # a job with another lighthouse
            RunLock(tmp_path, 300, job=job_identity(config(*ENABLED), {"TORCHFT_LIGHTHOUSE": "http://x:1"})).acquire()
        with pytest.raises(RunLockedError):
            RunLock(tmp_path, 300).acquire()  # a plain run
    finally:
        if second is not None:
            second.release()  # its heartbeat thread ends with it
        first.release()


def test_diloco_fragments_cover_the_model_once():
    pytest.importorskip("torchft")
    import torch

    from trainer.fault_tolerance.replicas import model_fragments
    from trainer.models.llama.model import Transformer
    from trainer.models.config import resolve_model_args

    c = config(*ENABLED, "--fault_tolerance.num_fragments", "2")
    with torch.device("meta"):
        model = Transformer(resolve_model_args(c, 2048))
    fragments = model_fragments(model, c.fault_tolerance)
    ids = [id(p) for f in fragments for p in f.parameters()]
    assert len(fragments) == 2 and sorted(ids) == sorted(id(p) for p in model.parameters())
    named = config(*ENABLED, "--fault_tolerance.module_fqns_per_model_fragment",
                   '[["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "layers.4", "layers.5", '
                   '"norm", "output"]]').fault_tolerance
    assert [len(list(f.children())) for f in model_fragments(model, named)] == [2, 7]
    partial = config(*ENABLED, "--fault_tolerance.module_fqns_per_model_fragment",
                     '[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]').fault_tolerance
    with pytest.raises(ConfigError, match="leaves out layers.2.attention"):
        model_fragments(model, partial)


def test_dilocos_outer_optimizer_is_the_configured_sgd(tmp_path):
    """fault_tolerance.outer_lr / outer_momentum (default: torchtitan's lr 0.7, momentum 0.9, Nesterov) reach
    each fragment's outer SGD; the measuring script's mean loss is over every group's records."""
    pytest.importorskip("torchft")
    import importlib.util

    import torch

    from trainer.fault_tolerance.replicas import outer_optimizers

    fragments = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)]
    for args, want in [((), (0.7, 0.9, True)), (("--fault_tolerance.outer_lr", "1", "--fault_tolerance.outer_momentum",
                                                  "0"), (1.0, 0.0, False))]:
        outer = outer_optimizers(fragments, config(*ENABLED, *args).fault_tolerance)
        assert len(outer) == 2 and [len(o.param_groups[0]["params"]) for o in outer] == [2, 2]
        g = outer[0].param_groups[0]
        assert (g["lr"], g["momentum"], g["nesterov"]) == want
    with pytest.raises(ConfigError, match=r"outer_momentum in \[0, 1\)"):
        validate(config(*ENABLED, "--fault_tolerance.outer_momentum", "1"), 2)
    spec = importlib.util.spec_from_file_location("measure_ft_semi_sync", ROOT / "scripts" / "measure_ft_semi_sync.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 11)) + '{"step": 11')
    assert script.last_mean([script.losses(metrics), {s: 0.0 for s in range(6, 11)}], 10) == 4.0


def test_a_diloco_run_names_its_outer_optimizer_and_settings_in_one_line():
    """The line a DiLoCo run logs once at start (tests/distributed/test_fault_tolerance.py sees it in a real
    run's log): the outer optimizer as built, and where a short run should look when it is the default."""
    pytest.importorskip("torchft")
    import torch

    from trainer.fault_tolerance.replicas import diloco_line, model_fragments, outer_optimizers
    from trainer.models.config import resolve_model_args
    from trainer.models.llama.model import Transformer

    def line(*args: str) -> str:
        c = config(*ENABLED, "--fault_tolerance.semi_sync_method", "diloco", *args).fault_tolerance
        with torch.device("meta"):
            model = Transformer(resolve_model_args(config(), 2048))
        return diloco_line(c, outer_optimizers(model_fragments(model, c), c))

    default = line("--fault_tolerance.sync_steps", "6", "--fault_tolerance.num_fragments", "2")
    assert default.startswith("fault tolerance: DiLoCo, 2 fragment(s), one synchronised every 3 step(s); outer "
                              "optimizer SGD lr 0.7, momentum 0.9, Nesterov (the default, torchtitan's"), default
    assert "for short runs see docs/multinode.md (fault_tolerance.outer_lr, outer_momentum)" in default
    assert line() in (ROOT / "docs" / "multinode.md").read_text().splitlines()  # the line the page quotes
    assert line("--fault_tolerance.outer_lr", "1", "--fault_tolerance.outer_momentum", "0") == (
        "fault tolerance: DiLoCo, 1 fragment(s), one synchronised every 5 step(s); outer optimizer SGD lr 1, "
        "momentum 0 (fault_tolerance.outer_lr, outer_momentum)")
    assert line("--fault_tolerance.outer_momentum", "0.5").endswith("lr 0.7, momentum 0.5, Nesterov "
                                                                     "(fault_tolerance.outer_lr, outer_momentum)")


def test_a_groups_checkpoints_merge_its_own_ranks_only():
    """The checkpoint manager is given the loader as the group's checkpoints see it: the merge keeps the
    states of this group's ranks (2..3 of 4 for group 1 with 2 ranks each); without fault tolerance it is
    the loader itself, which merges every rank."""
    from trainer.data.loader import build_train_loader
    from trainer.data.tokenizer import load_tokenizer
    from trainer.errors import DataStateError
    from trainer.fault_tolerance.replicas import GroupLoaderState, checkpointed_loader

    c = config(*ENABLED, "--training.local_batch_size", "2", "--training.seq_len", "32")
    tokenizer = load_tokenizer(c)
    group = [build_train_loader(c, tokenizer, dp_rank=r, dp_world_size=4) for r in (2, 3)]
    try:
        for loader in group:
            next(loader)
        seen = checkpointed_loader(c.fault_tolerance, group[0], dp=2)
        assert isinstance(seen, GroupLoaderState) and seen.ranks == [2, 3]
        assert seen.state_dict() == group[0].state_dict()
        state = seen.merge_states([loader.state_dict() for loader in group])
        assert state["kind"] == "global" and all(int(j) % 4 in (2, 3) for j in state["shards"])
        with pytest.raises(DataStateError, match="merge_states"):  # all four ranks' states are wanted there
            group[0].merge_states([loader.state_dict() for loader in group])
        assert checkpointed_loader(config().fault_tolerance, group[0], dp=2) is group[0]
    finally:
        for loader in group:
            loader.close()


def test_the_lighthouse_status_tells_live_groups_from_dead_ones(monkeypatch):
    """A real lighthouse (torchft's, in this process) and heartbeats under replica names, as Managers send
    them: a live group under this group's id is refused (exit 2), a dead one's entry is not; the wait for
    the job's groups ends when all are up, or at its timeout naming the missing ones; a lighthouse that
    does not answer is exit 7 naming TORCHFT_LIGHTHOUSE."""
    pytest.importorskip("torchft")
    import threading
    from datetime import timedelta

    from torchft.coordination import LighthouseClient, LighthouseServer

    from trainer.errors import PeerLost
    from trainer.fault_tolerance import lighthouse_status as status

    import time

    monkeypatch.setattr(status, "LIVENESS_WINDOW_S", 0.5)
    monkeypatch.setattr(status, "UP_WINDOW_S", 0.3)
    server = LighthouseServer(bind="[::]:0", min_replicas=1)
    stop = threading.Event()
    try:
        address = server.address()
        client = LighthouseClient(address, connect_timeout=timedelta(seconds=5))
        client.heartbeat("replica_1:dead")  # a group killed a moment ago: its entry stays, ageing

        def beat():  # a live group 0, heartbeating as a Manager does
            while not stop.wait(0.05):
                client.heartbeat("replica_0:live")

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        time.sleep(0.4)  # older than UP_WINDOW_S
        reader = status.StatusReader(address, 5.0)
        assert status.wait_for_groups(reader, 2, timeout_s=0.5) == [1]  # group 1's entry is too old by then
        with pytest.raises(ConfigError, match=rf"replica_id 0 is taken: another replica group with that id is "
                                              rf"training with the lighthouse {address}") as e:
            status.check_id_free(reader, 0, own=0)
        assert e.value.exit_code == 2
        status.check_id_free(reader, 1, own=0)  # only a dead group had id 1
        client.heartbeat("replica_1:again")
        status.check_id_free(reader, 1, own=1)  # ... and this group's own Manager, now listed
        client.heartbeat("replica_1:again")
        assert status.wait_for_groups(reader, 2, timeout_s=5) == []
    finally:
        stop.set()
        server.shutdown()
    with pytest.raises(PeerLost, match=rf"lighthouse at TORCHFT_LIGHTHOUSE={address} does not answer at start") as e:
        status.check_id_free(status.StatusReader(address, 1.0), 0, own=0)
    assert e.value.exit_code == 7


def test_a_skipped_step_without_a_reason_says_skipped_alone():
    from trainer.metrics import console_line

    record = {"step": 3, "loss": float("nan"), "grad_norm": 0.0, "lr": 1e-3, "tps": 0.0, "tflops": 0.0, "mfu": None,
              "memory": 0.0, "skipped": True}
    assert console_line(record, False).endswith("skipped")
    line = console_line({**record, "skip_reason": "not committed: a replica group failed during it; repeated"}, False)
    assert line.endswith("skipped (not committed: a replica group failed during it; repeated)")


def test_a_quorum_lost_after_a_step_that_was_not_committed_saves_the_step_before_it(tmp_path, monkeypatch):
    """The lighthouse can die inside a step: that step is not committed (it was to be repeated) and the next
    quorum fails. The group saves the last step it applied, the step every other group saves too; the step it
    could not commit is neither counted nor saved (not even on a save step)."""
    from tests.support.launch import train_in_process
    from trainer import train
    from trainer.checkpoint.layout import scan_folder
    from trainer.fault_tolerance.lighthouse_status import QuorumLost
    from trainer.fault_tolerance.replicas import SingleGroup

    class LighthouseDiesInStep4(SingleGroup):
        def start_step(self, step):
            if step == 5:  # the repeat of step 4 would be next: its quorum cannot form
                raise QuorumLost("no quorum: the lighthouse died")
            self.step = step
            return step

        def commit(self, skip):
            self.committed = self.step != 4
            return skip

    monkeypatch.setattr(train, "build_replicas", lambda *args, **kwargs: LighthouseDiesInStep4())
    rc, out = train_in_process(tmp_path, "--training.steps", "8", "--checkpoint.enable", "--checkpoint.interval",
                               "2", monkeypatch=monkeypatch)
    assert rc == QuorumLost.exit_code, out[-3000:]
    assert "no quorum: the lighthouse died; checkpoint step-3 saved" in out, out[-3000:]
    assert [c.step for c in scan_folder(tmp_path / "checkpoint") if c.complete] == [2, 3]


def test_a_last_step_that_was_not_committed_is_repeated_and_saved(tmp_path, monkeypatch):
    """As torchft's quorum does: the step after an uncommitted one is that step again; the run's last step
    too, and the final checkpoint is the last step applied."""
    from tests.support.launch import read_metrics, train_in_process
    from trainer import train
    from trainer.checkpoint.layout import scan_folder
    from trainer.fault_tolerance.replicas import SingleGroup

    class LastStepFailsOnce(SingleGroup):
        applied, failed = 0, False

        def start_step(self, step):
            self.step = self.applied + 1  # torchft: the step after the last one committed
            return self.step

        def commit(self, skip):
            self.committed = not (self.step == 6 and not self.failed)
            self.failed |= not self.committed
            self.applied = self.step if self.committed else self.applied
            return skip

    monkeypatch.setattr(train, "build_replicas", lambda *args, **kwargs: LastStepFailsOnce())
    rc, out = train_in_process(tmp_path, "--training.steps", "6", "--checkpoint.enable", monkeypatch=monkeypatch)
    assert rc == 0, out[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6, 6]
    assert [c.step for c in scan_folder(tmp_path / "checkpoint") if c.complete and c.kind == "full"] == [6]
