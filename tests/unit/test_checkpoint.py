"""Checkpoint features in one process: the real ``trainer.train.main`` (world size 1, gloo) called in
the test process, so each short run costs a second or two instead of a torchrun start. The multi-process
guarantees are in tests/distributed/test_checkpoint.py (resharding) and tests/e2e/test_checkpoint.py
(exact resume, kill -9, full disk)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.support.launch import DEBUG_CONFIG, FAST, FULL_WIDTH, read_metrics, train_in_process
from trainer.checkpoint.cli import main as checkpoint_main
from trainer.checkpoint.layout import MARKER, scan_folder, validate_checkpoint

COMMON = [*FAST, "--lr_scheduler.decay_type", "constant", "--checkpoint.enable"]


def train(dump: Path, *args: str, monkeypatch) -> tuple[int, str]:
    """``trainer.train.main`` in this process; returns (exit code, console output)."""
    return train_in_process(dump, *COMMON, *args, monkeypatch=monkeypatch, fast=False)


def losses(dump: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(dump)}


@pytest.fixture(scope="module")
def base(tmp_path_factory, mp):
    """6 steps, a checkpoint every 2 (full final save): the reference for several tests."""
    dump = tmp_path_factory.mktemp("base")
    rc, log = train(dump, "--training.steps", "6", "--checkpoint.interval", "2",
                    "--checkpoint.last_save_model_only", "false", monkeypatch=mp)
    assert rc == 0, log
    return dump


def copy_run(src: Path, dst: Path, keep: list[int]) -> Path:
    """A dump folder holding copies of some of ``src``'s checkpoints (no metrics)."""
    (dst / "checkpoint").mkdir(parents=True)
    for step in keep:
        shutil.copytree(src / "checkpoint" / f"step-{step}", dst / "checkpoint" / f"step-{step}")
    return dst


def test_layout_and_contents(base):
    folder = base / "checkpoint"
    infos = scan_folder(folder)
    assert [(c.step, c.status, c.kind) for c in infos] == [(2, "complete", "full"), (4, "complete", "full"),
                                                          (6, "complete", "full")]
    marker = json.loads((folder / "step-4" / MARKER).read_text())
    assert marker["step"] == 4 and marker["tokens_seen"] == 4 * 4 * 64 and marker["dataloader"] == "dataloader.json"
    assert set(marker["files"]) == {".metadata", "__0_0.distcp", "dataloader.json"}
    assert marker["estimated_bytes"] >= marker["bytes"] * 0.9
    # Other tools load plain FQNs under "model" without a process group.
    import torch.distributed.checkpoint as dcp
    from trainer.models.llama.model import Transformer
    from trainer.models.config import resolve_model_args
    from trainer.data.tokenizer import load_tokenizer
    from trainer.config import load_config

    cfg = load_config(["--job.config_file", str(DEBUG_CONFIG), *FAST])
    model = Transformer(resolve_model_args(cfg, load_tokenizer(cfg).vocab_size))
    sd = model.state_dict()
    assert "layers.0.attention.wq.weight" in sd
    dcp.load({"model": sd}, checkpoint_id=str(folder / "step-4"), no_dist=True)
    assert not any("_orig_mod" in k or "_checkpoint_wrapped" in k for k in sd)


def test_cli_list_and_inspect(base, tmp_path, capsys):
    assert checkpoint_main(["list", str(base)]) == 0
    out = capsys.readouterr().out
    assert "resumes from step 6" in out and "complete" in out
    assert checkpoint_main(["inspect", str(base / "checkpoint" / "step-4"), "--json", "--keys"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["status"] == "complete" and info["marker"]["step"] == 4
    assert info["entries"]["model.tok_embeddings.weight"]["dtype"] == "float32"
    assert set(info["groups"]) >= {"model", "optimizer", "train_state", "rng", "callbacks", "lr_scheduler"}
    # A truncated file: list says corrupt, inspect fails.
    bad = copy_run(base, tmp_path / "bad", [4])
    data = bad / "checkpoint" / "step-4" / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(1000)
    assert checkpoint_main(["list", str(bad), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert rows[0]["status"] == "corrupt" and "truncated" in rows[0]["reason"]
    assert checkpoint_main(["inspect", str(bad / "checkpoint" / "step-4")]) == 3
    assert "CORRUPT" in capsys.readouterr().out


def test_incomplete_and_corrupt_are_skipped(base, tmp_path, mp):
    """An interrupted save (step-6.tmp) and a truncated step-4: resume from step-2, exactly."""
    dump = copy_run(base, tmp_path / "run", [2, 4])
    shutil.copytree(base / "checkpoint" / "step-6", dump / "checkpoint" / "step-6.tmp")
    (dump / "checkpoint" / "step-6.tmp" / MARKER).unlink()
    with open(dump / "checkpoint" / "step-4" / "__0_0.distcp", "r+b") as f:
        f.truncate(4096)
    rc, log = train(dump, "--training.steps", "6", "--checkpoint.interval", "2",
                    "--checkpoint.last_save_model_only", "false", monkeypatch=mp)
    assert rc == 0, log
    assert "step-6.tmp is incomplete" in log
    assert "step-4 is CORRUPT" in log and "truncated" in log
    assert "step-2 loaded" in log
    ref, got = losses(base), losses(dump)
    assert sorted(got) == [3, 4, 5, 6]
    for s in got:
        assert got[s]["loss"] == ref[s]["loss"] and got[s]["data_fingerprint"] == ref[s]["data_fingerprint"]
    assert validate_checkpoint(dump / "checkpoint" / "step-4")[0] == "complete"  # saved again, replaced


def test_unloadable_checkpoint_falls_back(base, tmp_path, mp):
    """Damage the marker's size check cannot see (same-size garbage): DCP fails, the previous one loads."""
    dump = copy_run(base, tmp_path / "run", [2, 4])
    data = dump / "checkpoint" / "step-4" / ".metadata"
    data.write_bytes(b"\0" * data.stat().st_size)
    rc, log = train(dump, "--training.steps", "4", "--checkpoint.interval", "2",
                    "--checkpoint.last_save_model_only", "false", monkeypatch=mp)
    assert rc == 0, log
    assert "step-4 could not be loaded" in log and "trying the previous one" in log
    assert "step-2 loaded" in log
    assert losses(dump)[4]["loss"] == losses(base)[4]["loss"]


def test_load_step_and_exclude(base, tmp_path, mp):
    dump = copy_run(base, tmp_path / "run", [2, 4, 6])
    rc, log = train(dump, "--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.load_step", "2",
                    "--checkpoint.last_save_model_only", "false", monkeypatch=mp)
    assert rc == 0 and "step-2 loaded" in log, log
    assert losses(dump)[5]["loss"] == losses(base)[5]["loss"]
    # Without the data-loader state the data starts again from the beginning.
    dump2 = copy_run(base, tmp_path / "run2", [2])
    rc, log = train(dump2, "--training.steps", "3", "--checkpoint.exclude_from_loading", "dataloader,rng",
                    monkeypatch=mp)
    assert rc == 0 and "not restored: dataloader, rng" in log, log
    assert losses(dump2)[3]["data_fingerprint"] == losses(base)[1]["data_fingerprint"]
    # A step that does not exist is an error, not a silent fresh start.
    rc, log = train(dump2, "--training.steps", "3", "--checkpoint.load_step", "7", monkeypatch=mp)
    assert rc == 3 and "load_step=7" in log
    # A checkpoint that does not fit the config (8 sequences seen, now 3 per batch) stops the run with
    # the cause and a way out, without trying older checkpoints.
    dump3 = copy_run(base, tmp_path / "run3", [2, 4])
    rc, log = train(dump3, "--training.steps", "5", "--training.local_batch_size", "3", monkeypatch=mp)
    assert rc == 3 and "step-4 does not fit this run's config" in log and "exclude_from_loading" in log, log
    assert "trying the previous one" not in log


def test_keep_latest_k_and_model_only_export(tmp_path, mp, capsys):
    dump = tmp_path / "run"
    rc, log = train(dump, "--training.steps", "5", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2",
                    "--checkpoint.export_dtype", "bfloat16", monkeypatch=mp)
    assert rc == 0, log
    infos = scan_folder(dump / "checkpoint")
    # The last step's save is full; the model-only export is an addition under its own name.
    assert [(c.path.name, c.kind) for c in infos] == [("step-4", "full"), ("step-5", "full"),
                                                      ("final-step-5", "model_only")]
    assert infos[2].marker["dtype"] == "bfloat16" and infos[2].marker["bytes"] < infos[1].marker["bytes"] / 4
    # Extending the run resumes exactly from the full step-5; the earlier export stays.
    rc, log = train(dump, "--training.steps", "6", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2",
                    monkeypatch=mp)
    assert rc == 0 and "step-5 loaded" in log, log
    assert [c.path.name for c in scan_folder(dump / "checkpoint")] == ["step-5", "final-step-5", "step-6",
                                                                       "final-step-6"]
    # Running the finished command again: nothing to train.
    rc, log = train(dump, "--training.steps", "6", "--checkpoint.interval", "1", monkeypatch=mp)
    assert rc == 0 and "nothing to train" in log, log
    # A step that is not there is named with those that are, each once (step-6 and final-step-6: one step).
    rc, log = train(dump, "--training.steps", "6", "--checkpoint.load_step", "3", monkeypatch=mp)
    assert rc == 3 and "no complete checkpoint step-3" in log and "complete ones: 5, 6\n" in log, log
    from torchtitan_ext.hf import main as export_main

    assert export_main(["--checkpoint", str(dump), "--step", "3", "--output", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.strip().endswith("no step-3 in " + str(dump / "checkpoint") + "; available: 5, 6")


def test_seed_checkpoint_and_initial_load(base, tmp_path, mp):
    seed = tmp_path / "seed"
    rc, log = train(seed, "--checkpoint.create_seed_checkpoint", monkeypatch=mp)
    assert rc == 0, log
    assert [(c.step, c.kind) for c in scan_folder(seed / "checkpoint")] == [(0, "seed")]
    # Training in the seed's dump folder starts from its weights: identical to a fresh start.
    rc, log = train(seed, "--training.steps", "2", "--checkpoint.interval", "10", monkeypatch=mp)
    assert rc == 0 and "step-0 loaded" in log, log
    assert losses(seed)[2]["loss"] == losses(base)[2]["loss"]
    # initial_load_path, model only: the weights of base's step 6, a fresh optimizer, step 0.
    fresh = tmp_path / "fresh"
    rc, log = train(fresh, "--training.steps", "1", "--checkpoint.enable", "false",
                    "--checkpoint.initial_load_path", str(base / "checkpoint"), monkeypatch=mp)
    assert rc == 0 and "initial weights loaded from" in log and "step-6" in log, log
    assert losses(fresh)[1]["loss"] < losses(base)[1]["loss"] - 1.0


def test_initial_load_in_hf_errors_are_clear(tmp_path, mp):
    """Hugging Face weights load through the core's trainer.models.llama.hf_adapter.load_hf_into: a folder
    that is not a Hugging Face checkpoint stops the run with the cause, a missing one is a config error."""
    not_hf = tmp_path / "not_hf"
    not_hf.mkdir()
    rc, log = train(tmp_path / "run", "--training.steps", "1", "--checkpoint.initial_load_in_hf",
                    "--checkpoint.initial_load_path", str(not_hf), monkeypatch=mp)
    assert rc == 3 and "(Hugging Face) could not be loaded" in log and "no config.json" in log, log
    rc, log = train(tmp_path / "run2", "--training.steps", "1", "--checkpoint.initial_load_in_hf",
                    "--checkpoint.initial_load_path", str(tmp_path / "missing"), monkeypatch=mp)
    assert rc == 2 and "no such folder" in log, log


def test_failed_async_save_stops_the_run(tmp_path, mp):
    dump = tmp_path / "run"
    rc, log = train(dump, "--training.steps", "8", "--checkpoint.interval", "2", "--checkpoint.async_mode", "async",
                    "--checkpoint.drill_fail_save_steps", "4", monkeypatch=mp)
    assert rc == 3, log
    assert "injected write failure" in log and "stopping after 1 failed checkpoint save" in log
    # The outcome of a background save is agreed at the step boundary after it ended (as a synchronous
    # save's would be), not at the next save step: the run stopped there.
    m = re.search(r"checkpoint step-4 FAILED \(in the background: it ended during step (\d+), agreed by every rank "
                  r"after step (\d+)\)", log)
    assert m, log
    ended, agreed = map(int, m.groups())
    assert 4 <= ended <= agreed <= ended + 1 and max(losses(dump)) == agreed
    assert [c.step for c in scan_folder(dump / "checkpoint")] == [2]  # nothing half-written left behind


def test_failed_save_counted_then_run_continues(tmp_path, mp):
    dump = tmp_path / "run"
    rc, log = train(dump, "--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.max_failed_saves", "2",
                    "--checkpoint.drill_fail_save_steps", "2", monkeypatch=mp)
    assert rc == 0, log
    recs = losses(dump)
    assert recs[1]["checkpoint_failures"] == 0 and recs[6]["checkpoint_failures"] == 1
    assert [c.path.name for c in scan_folder(dump / "checkpoint")] == ["step-4", "step-6", "final-step-6"]


def test_a_background_save_failing_after_the_last_step_is_in_the_last_record(tmp_path, mp):
    """Step 5's background save fails 2 s into its write (the drill's delay), while step 6, the last, trains:
    its outcome is agreed before the last record is written, so that record counts it (not only summary.json)."""
    dump = tmp_path / "run"
    rc, log = train(dump, "--training.steps", "6", "--checkpoint.interval", "5", "--checkpoint.async_mode", "async",
                    "--checkpoint.max_failed_saves", "2", "--checkpoint.drill_fail_save_steps", "5",
                    "--checkpoint.drill_save_delay_s", "2", monkeypatch=mp)
    assert rc == 0, log
    assert "checkpoint step-5 FAILED" in log
    assert losses(dump)[6]["checkpoint_failures"] == 1


def test_short_disk_refuses_the_save(tmp_path, mp):
    dump = tmp_path / "run"
    rc, log = train(dump, "--training.steps", "6", "--checkpoint.interval", "2", "--model.n_layers", "6", *FULL_WIDTH,
                    "--checkpoint.drill_disk_bytes", str(100 << 20), monkeypatch=mp)  # 6 blocks: ~60 MiB a save
    assert rc == 3, log
    assert "disk space is short" in log  # warned at start
    assert "not enough disk space for checkpoint step-4" in log
    assert [(c.step, c.status) for c in scan_folder(dump / "checkpoint")] == [(2, "complete")]


def test_bad_exclude_is_a_config_error(tmp_path, mp):
    rc, log = train(tmp_path / "run", "--checkpoint.exclude_from_loading", "optimiser", monkeypatch=mp)
    assert rc == 2 and "exclude_from_loading" in log
