"""Everything that reads a checkpoint checks it first, and refuses what does not fit, in one line with the
documented exit code: the tools (``trainer export/generate/eval``, ``trainer checkpoint list``), a resume
into a model of another shape, and retention across launches of one run. The real ``trainer.train.main``
runs in the test process (world size 1), a second or two per run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.launch import train_in_process
from trainer.checkpoint.layout import scan_folder

TASKS_DIR = Path(__file__).resolve().parent.parent / "assets" / "lm_eval_tasks"


def train(dump: Path, *args: str, monkeypatch) -> tuple[int, str]:
    """``trainer.train.main`` in this process, with the debug model's six blocks (the tests of other model
    shapes give fewer or more after them); returns (exit code, console output)."""
    return train_in_process(dump, "--model.n_layers", "6", "--lr_scheduler.decay_type", "constant",
                            "--checkpoint.enable", *args, monkeypatch=monkeypatch)


def flip_byte(path: Path, offset: int = 100) -> None:
    """Change one byte in place (same size: only a checksum can tell)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.fixture(scope="module")
def run(tmp_path_factory, mp):
    """4 steps, a full checkpoint at steps 2 and 4 and the final model-only export final-step-4."""
    dump = tmp_path_factory.mktemp("readers") / "run"
    rc, log = train(dump, "--training.steps", "4", "--checkpoint.interval", "2", monkeypatch=mp)
    assert rc == 0, log
    assert [c.path.name for c in scan_folder(dump / "checkpoint")] == ["step-2", "step-4", "final-step-4"]
    return dump


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def one_line(err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------------------------------
# The tools verify what they read
# --------------------------------------------------------------------------------------------------


def test_tools_refuse_a_bit_flipped_checkpoint(run, tmp_path, capsys):
    from torchtitan_ext.generate import main as generate_main
    from torchtitan_ext.hf import main as export_main

    dump = copy_run(run, tmp_path / "run")
    step4 = dump / "checkpoint" / "step-4"
    flip_byte(step4 / "__0_0.distcp")
    capsys.readouterr()
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(step4), "--output", str(out)]) == 3
    one_line(capsys.readouterr().err, "trainer export:", "step-4 is CORRUPT", "__0_0.distcp", "checksum")
    assert not out.exists()
    samples = tmp_path / "samples.json"
    assert generate_main(["--checkpoint", str(dump), "--step", "4", "--prompt", "a", "--max_new_tokens", "2",
                          "--output_json", str(samples)]) == 3
    one_line(capsys.readouterr().err, "trainer generate:", "step-4 is CORRUPT")
    assert not samples.exists()
    # The newest intact one is taken when none is named, as a resuming run does; when every one is
    # damaged, nothing is written.
    assert export_main(["--checkpoint", str(dump), "--output", str(out), "--dtype", "fp32"]) == 0
    capsys.readouterr()
    for name in ("step-2", "final-step-4"):
        flip_byte(dump / "checkpoint" / name / "__0_0.distcp")
    out2 = tmp_path / "hf2"
    assert export_main(["--checkpoint", str(dump), "--output", str(out2)]) == 3
    line = one_line(capsys.readouterr().err, "passes its checksums")
    assert all(n in line for n in ("step-2", "step-4", "final-step-4")), line
    assert not out2.exists()


def test_eval_refuses_a_bit_flipped_checkpoint(run, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval")
    from torchtitan_ext.evaluation.cli import main as eval_main

    monkeypatch.chdir(tmp_path)
    dump = copy_run(run, tmp_path / "run")
    step4 = dump / "checkpoint" / "step-4"
    flip_byte(step4 / "__0_0.distcp")
    capsys.readouterr()
    assert eval_main(["--checkpoint", str(step4), "--tasks", "tiny_mc", "--include_path", str(TASKS_DIR),
                      "--limit", "2", "--output_path", "out.json"]) == 3
    one_line(capsys.readouterr().err, "trainer eval:", "step-4 is CORRUPT")
    assert not list(tmp_path.glob("out*"))


# --------------------------------------------------------------------------------------------------
# `trainer checkpoint list` claims only what a run does
# --------------------------------------------------------------------------------------------------


def test_list_claims_the_checkpoint_a_run_resumes_from(run, tmp_path, capsys, mp):
    from trainer.checkpoint.cli import main as checkpoint_main

    dump = copy_run(run, tmp_path / "run")
    capsys.readouterr()
    assert checkpoint_main(["list", str(dump)]) == 0
    assert "resumes from step 4 (checksums verified)" in capsys.readouterr().out
    flip_byte(dump / "checkpoint" / "step-4" / "__0_0.distcp")
    assert checkpoint_main(["list", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "resumes from step 2 (checksums verified)" in out, out
    assert "step-4: __0_0.distcp fails its" in out and "resumes from step 4" not in out
    assert checkpoint_main(["list", str(dump), "--json"]) == 0
    import json

    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows["step-4"]["status"] == "corrupt" and rows["step-2"].get("verified") is True
    # Without reading checksums it claims no more than the markers show.
    assert checkpoint_main(["list", str(dump), "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert "newest committed checkpoint: step 4" in out and "trainer checkpoint verify" in out
    assert "resumes from" not in out
    # And a run does resume from step 2.
    rc, log = train(dump, "--training.steps", "4", "--checkpoint.interval", "2", monkeypatch=mp)
    assert rc == 0 and "step-2 loaded" in log, log


# --------------------------------------------------------------------------------------------------
# Retention counts the run's checkpoints, whichever launch wrote them
# --------------------------------------------------------------------------------------------------


def _names(dump: Path) -> list[str]:
    return [c.path.name for c in scan_folder(dump / "checkpoint")]


def test_keep_latest_k_counts_every_launch_of_the_run(tmp_path, mp):
    """A preemptible job: each launch continues the run a step or two. keep_latest_k holds for the folder,
    not for each launch (before, a launch that committed fewer than k-1 checkpoints deleted nothing)."""
    dump = tmp_path / "run"
    keep = ["--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "3"]
    rc, log = train(dump, "--training.steps", "2", *keep, monkeypatch=mp)
    assert rc == 0, log
    assert _names(dump) == ["step-1", "step-2", "final-step-2"]
    for steps in (3, 4, 5):
        rc, log = train(dump, "--training.steps", str(steps), *keep, monkeypatch=mp)
        assert rc == 0 and f"step-{steps - 1} loaded" in log, log
    # The newest 3 full checkpoints, and every launch's final export (retention never deletes those).
    assert _names(dump) == ["final-step-2", "step-3", "final-step-3", "step-4", "final-step-4", "step-5",
                            "final-step-5"]


def test_keep_latest_k_two_over_three_launches(tmp_path, mp):
    dump = tmp_path / "run"
    keep = ["--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2", "--checkpoint.last_save_model_only",
            "false"]
    for steps in (2, 4, 6):
        rc, log = train(dump, "--training.steps", str(steps), *keep, monkeypatch=mp)
        assert rc == 0, log
    assert _names(dump) == ["step-5", "step-6"]


def test_retention_keeps_damaged_and_resumed_checkpoints(tmp_path, mp):
    """A bit-flipped newest checkpoint is skipped on resume and not deleted (it may hold intact weights);
    the one resumed from stays until this launch has committed newer ones."""
    dump = tmp_path / "run"
    keep = ["--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "1", "--checkpoint.last_save_model_only",
            "false"]
    rc, log = train(dump, "--training.steps", "4", "--checkpoint.keep_latest_k", "0", "--checkpoint.interval", "2",
                    "--checkpoint.last_save_model_only", "false", monkeypatch=mp)
    assert rc == 0 and _names(dump) == ["step-2", "step-4"], log
    flip_byte(dump / "checkpoint" / "step-4" / "__0_0.distcp")
    # Resumes from step-2, saves step-3 (the last step; step-4 is after it): step-2 is deleted, the
    # damaged step-4 stays.
    rc, log = train(dump, "--training.steps", "3", *keep, monkeypatch=mp)
    assert rc == 0 and "step-2 loaded" in log, log
    assert _names(dump) == ["step-3", "step-4"]


# --------------------------------------------------------------------------------------------------
# A checkpoint of another model shape is refused, not half-loaded
# --------------------------------------------------------------------------------------------------


def _error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "checkpoint error" in line]


@pytest.mark.parametrize("layers,what", [("2", "not in this model: layers.2."), ("8", "missing from the checkpoint: "
                                                                                    "layers.6.")])
def test_resume_with_another_model_shape_is_refused(run, tmp_path, mp, layers, what):
    """debug_gqa has 6 layers: resuming with 2 (or 8) used to load the overlap and train on (exit 0)."""
    dump = copy_run(run, tmp_path / "run")
    before = sorted(p.name for p in (dump / "checkpoint").iterdir())
    metrics = (dump / "metrics.jsonl").read_text()
    rc, log = train(dump, "--training.steps", "6", "--checkpoint.interval", "2", "--model.n_layers", layers,
                    monkeypatch=mp)
    assert rc == 3, log
    assert "Traceback" not in log
    lines = _error_lines(log)
    assert len(lines) == 1 and "step-4 does not fit this run's config" in lines[0], log
    assert what in lines[0] and "in all)" in lines[0] and "model.n_layers" in lines[0], lines[0]
    assert "trying the previous one" not in log  # every checkpoint of the run would fail the same way
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == before  # nothing changed
    assert (dump / "metrics.jsonl").read_text() == metrics


def test_initial_load_of_another_model_shape_is_refused(run, tmp_path, mp):
    rc, log = train(tmp_path / "new", "--training.steps", "1", "--model.n_layers", "2",
                    "--checkpoint.initial_load_path", str(run / "checkpoint" / "step-4"), monkeypatch=mp)
    assert rc == 3 and "Traceback" not in log, log
    lines = _error_lines(log)
    assert len(lines) == 1 and "initial_load_path" in lines[0] and "not in this model: layers.2." in lines[0], log
    assert "_Incompatible" not in lines[0]


def test_matching_checkpoints_still_load(run, tmp_path, mp):
    """The legitimate cases: a model-only export as initial weights, exclude_from_loading, a plain resume."""
    rc, log = train(tmp_path / "new", "--training.steps", "1", "--checkpoint.enable", "false",
                    "--checkpoint.initial_load_path", str(run / "checkpoint" / "final-step-4"), monkeypatch=mp)
    assert rc == 0 and "initial weights loaded from" in log, log
    dump = copy_run(run, tmp_path / "run")
    rc, log = train(dump, "--training.steps", "5", "--checkpoint.interval", "2",
                    "--checkpoint.exclude_from_loading", "dataloader", monkeypatch=mp)
    assert rc == 0 and "step-4 loaded" in log and "not restored: dataloader" in log, log


def test_float8_conversion_keeps_the_checkpoint_names(run, tmp_path, mp):
    """Float8Linear keeps Linear's parameter names: a checkpoint of the plain model resumes under float8."""
    pytest.importorskip("torchao")
    dump = copy_run(run, tmp_path / "run")
    rc, log = train(dump, "--training.steps", "5", "--checkpoint.interval", "2", "--model.converters",
                    "quantize.linear.float8", monkeypatch=mp)
    assert rc == 0 and "step-4 loaded" in log and "float8" in log, log


def test_partial_model_load_by_name(run, tmp_path, mp):
    """checkpoint.partial_model_load: the weights both share are loaded, the rest stay initialised, the
    optimizer starts fresh, and the log says how many."""
    dump = copy_run(run, tmp_path / "run")
    rc, log = train(dump, "--training.steps", "5", "--checkpoint.interval", "2", "--model.n_layers", "8",
                    "--checkpoint.partial_model_load", monkeypatch=mp)
    assert rc == 0, log
    assert "checkpoint.partial_model_load: " in log and "missing from the checkpoint: layers.6." in log, log
    assert "step-4 loaded" in log and "not restored: optimizer" in log, log


def test_compare_model_uses_the_loaders_names_and_the_whole_model(run):
    """Names are compared after clean_fqn (wrapper segments), and against the whole model's shapes (a
    pipeline rank passes every stage's, gathered), so one stage's subset alone is not a mismatch."""
    from torch.distributed.checkpoint import FileSystemReader

    from trainer.checkpoint.restore import compare_model

    entries = dict(FileSystemReader(str(run / "checkpoint" / "step-4")).read_metadata().state_dict_metadata)
    shapes = {k[len("model."):]: tuple(v.size) for k, v in entries.items() if k.startswith("model.")}
    assert compare_model(shapes, entries) == (None, set(shapes))
    wrapped = {("model._orig_mod." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in entries.items()}
    assert compare_model(shapes, wrapped)[0] is None
    fewer = {k: v for k, v in shapes.items() if not k.startswith("layers.5.")}
    why, shared = compare_model(fewer, entries)
    assert "not in this model: layers.5." in why and shared == set(fewer)
    wider = dict(shapes, **{"norm.weight": (shapes["norm.weight"][0] * 2,)})
    why, shared = compare_model(wider, entries)
    assert "other shapes (saved -> now): norm.weight" in why and "norm.weight" not in shared
