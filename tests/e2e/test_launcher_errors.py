"""Every mistake is one line before anything starts: through ./run_train.sh, each case exits with its
documented code (2 config, 3 stopped/checkpoint, 4 data), prints exactly one line on stderr and no
traceback. Most cases fail in the launcher's torch-free pre-flight (a fraction of a second); the few that
only a worker can see go through torchrun and the launcher's one-line report. Cases run two at a time."""

from __future__ import annotations

import os
import stat
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.launch import ROOT, run_train
from tests.support.processes import QUICK_S, run
from tests.support.tokenizers import TORCHTITAN_ASSETS as ASSETS, make_tokenizer_folder

SMALL = ["--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "2",
         "--metrics.enable_tensorboard", "false"]


def cases(tmp):
    """(name, environment, arguments, exit code, a fragment of the one line)."""
    (tmp / "a_file").write_text("x")
    (tmp / "a_text_document.idx").write_bytes(b"MMIDIDX")  # (never read: the path is refused first)
    read_only = tmp / "read_only"
    read_only.mkdir()
    read_only.chmod(stat.S_IRUSR | stat.S_IXUSR)
    (tmp / "latin1.toml").write_bytes(b"[job]\ndescription = \"caf\xe9\"\n")
    (tmp / "no_text.jsonl").write_text("".join(f'{{"content": "line {i}"}}\n' for i in range(300)))
    broken = tmp / "broken_tokenizer"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    tok = make_tokenizer_folder(tmp / "tokenizer")
    dump = lambda n: ["--job.dump_folder", str(tmp / f"out{n}")]  # noqa: E731 (one folder per worker case)
    return [
        ("unknown flavor", {}, ["--model.flavor", "9B"], 2, "unknown flavor '9B'"),
        ("unknown dataset", {}, ["--training.dataset", "c5"], 2, "unknown dataset or source kind 'c5'"),
        ("c4 without a local copy", {}, ["--training.dataset", "c4"], 2, "set training.dataset_path"),
        ("NaN lr", {}, ["--optimizer.lr", "nan"], 2, "optimizer.lr must be a finite number"),
        ("profiler schedule", {}, ["--profiling.enable_profiling", "--profiling.profile_freq", "3"], 2,
         "must not exceed profiling.profile_freq"),
        ("sources and dataset", {}, ["--data.sources", "shakespeare", "--training.dataset", "shakespeare"], 2,
         "set either data.sources or training.dataset"),
        ("NGPU=0", {"NGPU": "0"}, [], 2, "NGPU=0 must be a positive whole number"),
        ("NGPU=abc", {"NGPU": "abc"}, [], 2, "NGPU=abc must be a positive whole number"),
        ("non-UTF-8 TOML", {"CONFIG_FILE": str(tmp / "latin1.toml")}, [], 2, "is not UTF-8 text"),
        ("missing TOML", {"CONFIG_FILE": str(tmp / "nope.toml")}, [], 2, "no such file"),
        ("dump folder is a file", {}, ["--job.dump_folder", str(tmp / "a_file")], 2, "is a file"),
        ("read-only dump folder", {}, ["--job.dump_folder", str(read_only / "run")], 2, "is read-only"),
        ("missing data file", {}, ["--training.dataset", "jsonl", "--training.dataset_path", str(tmp / "no.jsonl")],
         2, "no such file or folder"),
        ("Megatron prefix as the default dataset's path", {}, ["--training.dataset_path", str(tmp / "a_text_document")],
         2, "prefix of a Megatron .idx/.bin pair: set training.dataset megatron"),
        ("missing tokenizer folder", {}, ["--model.hf_assets_path", str(tmp / "no_tokenizer")], 2,
         "model.hf_assets_path: no such file or folder"),
        ("unknown key", {}, ["--training.stepz", "5"], 2, "did you mean 'training.steps'"),
        ("wrong type", {}, ["--training.steps", "ten"], 2, "training.steps: expected int"),
        ("value after --no_", {}, ["--checkpoint.no_enable=true"], 2, "takes no value"),
        ("context parallel degree that cannot split the sequence", {"NGPU": "2"},
         ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "66"], 2,
         "training.seq_len (66) must be a multiple of 2 x context_parallel_degree (4)"),
        ("fault tolerance", {}, ["--fault_tolerance.enable"], 2, "fault_tolerance.group_size must be the number of "
                                                                 "replica groups"),
        ("RoPE restart without block_causal", {}, ["--model.rope_per_document"], 2,
         'set model.attn_mask_type = "block_causal" too'),
        ("layout", {}, ["--parallelism.tensor_parallel_degree", "2"], 2, "world size 1"),
        ("node rank", {"NNODES": "2", "NODE_RANK": "2"}, [], 2, "NODE_RANK=2 must be in [0, NNODES=2)"),
        ("torchtitan 405B TOML on one process", {"CONFIG_FILE": str(ASSETS / "llama3_405b.toml")}, [], 2,
         "set training.dataset_path"),
        ("too few pipeline micro-batches", {"NGPU": "2"},
         [*SMALL, *dump(4), "--parallelism.pipeline_parallel_degree", "2",
          "--parallelism.pipeline_parallel_microbatch_size", "2", "--parallelism.pipeline_parallel_schedule",
          "Interleaved1F1B"], 2, "multiple of pipeline_parallel_degree (2)"),
        # Seen only by a worker: the launcher prints the worker's line and exits with the worker's code.
        ("JSONL without the text field", {}, [*SMALL, *dump(1), "--model.hf_assets_path", str(tok),
                                              "--training.dataset", "jsonl", "--training.dataset_path",
                                              str(tmp / "no_text.jsonl"), "--data.num_shards", "1"], 4,
         "(data.text_field)?"),
        ("unreadable tokenizer", {}, [*SMALL, *dump(2), "--model.tokenizer_path", str(broken)], 2,
         "config error: model.tokenizer_path"),
        ("stability stop", {}, [*SMALL, *dump(3), "--debug.inject_nonfinite_loss_steps", "1,2",
                                "--stability.max_consecutive_bad_steps", "1"], 3, "stopped: stability"),
    ]


def run_case(case):
    name, env, args, _, _ = case
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT), **env}
    return run([str(ROOT / "run_train.sh"), *args], cwd=ROOT, env=full, timeout=300)


@pytest.mark.slow  # three cases start torchrun and a worker; the rest stop in the pre-flight
def test_each_mistake_is_one_line_with_its_exit_code(tmp_path):
    all_cases = cases(tmp_path)
    assert len(all_cases) >= 20
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run_case, all_cases))
    failures = []
    for (name, _, _, code, fragment), proc in zip(all_cases, results):
        err = proc.stderr.strip().splitlines()
        ok = (proc.returncode == code and len(err) == 1 and fragment in err[0]
              and "Traceback" not in proc.stderr + proc.stdout)
        if not ok:
            failures.append(f"{name}: exit {proc.returncode} (want {code}), stderr {proc.stderr!r}, "
                            f"stdout tail {proc.stdout[-300:]!r}")
    assert not failures, "\n".join(failures)
    # The worker cases name torchrun's report, kept in the dump folder.
    assert all(list((tmp_path / f"out{n}" / "launcher").glob("*.log")) for n in (1, 2, 3))


def test_impossible_layouts_fail_before_work(tmp_path):
    proc = run_train(tmp_path, "--parallelism.tensor_parallel_degree", "3", nproc=4, check=False)
    assert proc.returncode != 0
    assert "tensor_parallel_degree (3)" in proc.stderr + proc.stdout
    proc = run_train(tmp_path, "--parallelism.tensor_parallel_degree", "32", nproc=1, check=False)
    assert proc.returncode != 0
    assert "world size" in proc.stderr + proc.stdout


def test_launcher_rejects_bad_keys_before_any_work():
    for args in (["--training.no_such_key=1"], ["--training.stepz", "5"], ["--training.steps", "x"]):
        proc = run([str(ROOT / "run_train.sh"), *args], cwd=ROOT, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
                   timeout=QUICK_S)
        assert proc.returncode == 2, proc.stderr
        key = args[0].lstrip("-").split("=")[0]
        assert key in proc.stderr and "config error" in proc.stderr
        assert "Traceback" not in proc.stderr
