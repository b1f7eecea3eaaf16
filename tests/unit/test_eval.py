"""trainer eval: the native lm-eval model ('trainer') against lm-eval's HF backend on the export of the same
checkpoint, on the local tasks in tests/assets/lm_eval_tasks (offline)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from torchtitan_ext.hf import main as export_main  # noqa: E402
from torchtitan_ext.lm_eval_model import NativeLM, main as eval_main  # noqa: E402
from torchtitan_ext.native import save_native_checkpoint  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.models.llama.model import Transformer  # noqa: E402
from trainer.models.config import resolve_model_args  # noqa: E402
from trainer.data.tokenizer import load_tokenizer  # noqa: E402
from tests.support.models import fast_model

TASKS_DIR = Path(__file__).resolve().parents[1] / "assets" / "lm_eval_tasks"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A debug_gqa checkpoint (random weights, seeded) and its fp32 export."""
    tmp = tmp_path_factory.mktemp("eval")
    config = load_config(["--model.flavor", "debug_gqa", "--training.seq_len", "64"], env={})
    tok = load_tokenizer(config)
    model = fast_model(resolve_model_args(config, tok.vocab_size))
    dump = tmp / "run"
    save_native_checkpoint(model.state_dict(), dump, step=5, config=config)
    assert export_main(["--checkpoint", str(dump), "--output", str(tmp / "hf"), "--dtype", "fp32"]) == 0
    return {"dump": dump, "hf": tmp / "hf", "tmp": tmp, "model": model, "tok": tok}


def _metrics(path: Path) -> dict[str, float]:
    results = json.loads(path.read_text())["results"]
    return {f"{task}/{name}": value for task, metrics in results.items() for name, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in name}


def test_eval_native_checkpoint_equals_hf_export(run, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # relative data_files resolve against --include_path, not the cwd
    common = ["--tasks", "tiny_mc,tiny_ppl,tiny_gen", "--include_path", str(TASKS_DIR), "--limit", "6",
              "--batch_size", "4", "--log_samples"]
    assert eval_main(["--checkpoint", str(run["dump"]), *common, "--output_path", "native.json"]) == 0
    assert eval_main(["--hf", str(run["hf"]), *common, "--output_path", "hf.json"]) == 0
    native, hf = _metrics(tmp_path / "native.json"), _metrics(tmp_path / "hf.json")
    for key in ("tiny_mc/acc,none", "tiny_mc/acc_norm,none", "tiny_ppl/bits_per_byte,none",
                "tiny_ppl/word_perplexity,none", "tiny_gen/exact_match,none"):
        assert key in native and key in hf, (key, native)
    assert native.keys() == hf.keys()
    for key, value in native.items():
        tol = 1e-4 * max(1.0, abs(value)) if "perplexity" in key else 1e-4
        assert abs(value - hf[key]) <= tol, (key, value, hf[key])
    # Per-example scores and generations agree too.
    a = json.loads((tmp_path / "native.json").read_text())["samples"]
    b = json.loads((tmp_path / "hf.json").read_text())["samples"]
    assert [s["filtered_resps"] for s in a["tiny_gen"]] == [s["filtered_resps"] for s in b["tiny_gen"]]
    for sa, sb in zip(a["tiny_mc"], b["tiny_mc"]):
        for ra, rb in zip(sa["resps"], sb["resps"]):
            assert abs(ra[0][0] - rb[0][0]) <= 1e-4
    assert json.loads((tmp_path / "native.json").read_text())["config"]["model_source"].startswith("checkpoint:")


class _Req:
    def __init__(self, *args):
        self.args = args


def test_native_lm_scores_match_direct_computation(run):
    from lm_eval.api.registry import get_model

    assert get_model("trainer") is NativeLM  # lm_eval.simple_evaluate(model="trainer", model_args=...)
    lm = get_model("trainer").create_from_arg_string(f"checkpoint={run['dump']},batch_size=3",
                                                     {"batch_size": None, "device": None})
    # Requests start with BOS, as every training document did (data.separator auto: bos).
    assert lm.batch_size == 3 and lm.max_length == 2048 and lm.add_bos_token is True
    tok, model = run["tok"], run["model"]
    context, continuation = "To be, or not to be:", " that is the question"
    [(logprob, greedy)] = lm.loglikelihood([_Req(context, continuation)], disable_tqdm=True)
    ctx, whole = tok.encode(context, bos=True), tok.encode(context + continuation, bos=True)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([whole[:-1]])).float(), -1)[0]
    expected = sum(lp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))
    assert abs(logprob - expected) < 1e-4 and greedy is False
    # Rolling loglikelihood of a short text = sum of all token log-probs after the prefix (BOS) token.
    text = "Shall I compare thee to a summer's day?"
    [rolling] = lm.loglikelihood_rolling([_Req(text)], disable_tqdm=True)
    ids = [tok.bos_id] + tok.encode(text, bos=True)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids[:-1]])).float(), -1)[0]
    assert abs(rolling - sum(lp[i - 1, ids[i]].item() for i in range(1, len(ids)))) < 1e-3
    # Batching and ordering do not change scores.
    reqs = [_Req("a b c", " d"), _Req("First Citizen:", " Before we proceed"), _Req("x", " y z w")]
    batched = lm.loglikelihood(reqs, disable_tqdm=True)
    single = [lm.loglikelihood([r], disable_tqdm=True)[0] for r in reqs]
    assert all(abs(x[0] - y[0]) < 1e-5 for x, y in zip(batched, single))
    # generate_until stops at the stop string and respects max_gen_toks.
    outs = lm.generate_until([_Req("Hello", {"until": ["e"], "max_gen_toks": 5}),
                              _Req("First Citizen:", {"until": ["\n\n"], "max_gen_toks": 3})], disable_tqdm=True)
    assert "e" not in outs[0] and len(tok.encode(outs[1])) <= 4


def test_eval_errors_are_reported(run, capsys, tmp_path):
    assert eval_main(["--checkpoint", str(tmp_path / "missing"), "--tasks", "tiny_mc",
                      "--include_path", str(TASKS_DIR)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert eval_main(["--hf", str(tmp_path), "--tasks", "tiny_mc", "--include_path", str(TASKS_DIR)]) == 2
    assert "config.json" in capsys.readouterr().err


def test_registry_task_offline_without_its_data_is_one_line(run, capsys):
    """hellaswag's dataset is not in the cache and the Hub is off (this module sets HF_DATASETS_OFFLINE): one
    line naming the task and the ways out, exit code 4, instead of the datasets library's traceback."""
    rc = eval_main(["--checkpoint", str(run["dump"]), "--tasks", "hellaswag", "--limit", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 4, err
    line = [l for l in err if l.startswith("trainer eval:")]
    assert len(line) == 1 and "hellaswag" in line[0] and "--include_path" in line[0], err
    assert not any("Traceback" in l for l in err), err


def test_requests_are_dealt_to_data_parallel_ranks_and_collective_forwards_stay_in_step(run):
    from torchtitan_ext.evaluation.lm import EvalLayout

    def share(rank, lockstep):
        lm = NativeLM(model=run["model"], tokenizer=run["tok"], layout=EvalLayout(rank, 2, lockstep=lockstep))
        return lm._my_batches(["a", "b", "c"])

    assert share(0, False) == ["a", "c"] and share(1, False) == ["b"]  # replicated models: no filler
    assert share(0, True) == ["a", "c"] and share(1, True) == ["b", None]  # a filler pass keeps FSDP in step


def test_lockstep_path_scores_and_generates_as_the_plain_one(run):
    """The path sharded models take (whole-sequence generation, widths padded for sequence parallel) gives
    what the plain path (KV cache) gives, in one process."""
    from torchtitan_ext.evaluation.lm import EvalLayout

    plain = NativeLM(model=run["model"], tokenizer=run["tok"], batch_size=2)
    lockstep = NativeLM(model=run["model"], tokenizer=run["tok"], batch_size=2,
                        layout=EvalLayout(lockstep=True, pad_multiple=4))
    gen = [_Req("Hello", {"until": ["e"], "max_gen_toks": 5}), _Req("First Citizen:", {"until": ["\n\n"],
                                                                                       "max_gen_toks": 3}),
           _Req("To be", {"until": ["\n"], "max_gen_toks": 4})]
    assert lockstep.generate_until(gen, disable_tqdm=True) == plain.generate_until(gen, disable_tqdm=True)
    reqs = [_Req("a b c", " d"), _Req("First Citizen:", " Before we proceed"), _Req("x", " y z w")]
    for (a, ga), (b, gb) in zip(lockstep.loglikelihood(reqs, disable_tqdm=True),
                                plain.loglikelihood(reqs, disable_tqdm=True)):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)) and ga == gb


def test_lm_eval_options_and_results_fields(run, tmp_path, capsys):
    """--write_out prints the first prompt through lm-eval's logger, --verbosity sets its level, and the
    results JSON records device, gen_kwargs and batch_sizes as lm_eval does."""
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    lm_logger = logging.getLogger("lm_eval")
    lm_logger.addHandler(handler)
    try:
        assert eval_main(["--checkpoint", str(run["dump"]), "--tasks", "tiny_gen", "--include_path", str(TASKS_DIR),
                          "--limit", "2", "--batch_size", "auto", "--max_batch_size", "4", "--device", "cpu",
                          "--gen_kwargs", "max_gen_toks=3", "--write_out", "--verbosity", "DEBUG",
                          "--output_path", str(tmp_path / "out.json")]) == 0
        assert lm_logger.getEffectiveLevel() == logging.DEBUG
    finally:
        lm_logger.removeHandler(handler)
        lm_logger.setLevel(logging.INFO)
    assert any("context prompt" in r for r in records), records[:5]
    saved = json.loads((tmp_path / "out.json").read_text())
    config = saved["config"]
    assert config["device"] == "cpu" and config["gen_kwargs"] == {"max_gen_toks": 3}
    assert config["batch_sizes"] == [4] and config["batch_size"] == "auto"
    assert "pretty_env_info" in saved and "transformers_version" in saved  # lm-eval's description of the machine


def test_in_training_evaluation_skips_the_machines_description(run, monkeypatch):
    """[eval] keeps only the scores: lm-eval's add_env_info (torch's collect_env starting pip and lscpu, an
    import of transformers) is left out of its call, and put back after it."""
    import lm_eval.evaluator as evaluator

    from torchtitan_ext.evaluation.lm import evaluate

    def refuse(results):
        raise AssertionError("add_env_info called")

    monkeypatch.setattr(evaluator, "add_env_info", refuse)
    lm = NativeLM(model=run["model"], tokenizer=run["tok"], batch_size=2)
    results = evaluate(lm, ["tiny_mc"], include_path=str(TASKS_DIR), limit=2, environment=False)
    assert "tiny_mc" in results["results"] and "pretty_env_info" not in results
    assert evaluator.add_env_info is refuse
    with pytest.raises(AssertionError, match="add_env_info called"):
        evaluate(lm, ["tiny_mc"], include_path=str(TASKS_DIR), limit=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line(run, capsys):
    assert eval_main(["--checkpoint", str(run["dump"]), "--tasks", "tiny_mc", "--include_path", str(TASKS_DIR),
                      "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no CUDA device" in err and "--device cpu" in err, err


def test_an_output_path_that_cannot_take_the_results_is_one_line_before_evaluating(run, capsys, tmp_path):
    """An existing file as --output_path (lm-eval's layout needs a folder there), a path under a file, a .json
    name that is a folder, a model folder taken by a file: exit 2 in one line naming the path, before anything
    is evaluated (no results table), and the file is left as it was. lm-eval itself only logs such a save,
    after the whole evaluation."""
    from lm_eval.utils import sanitize_model_name

    taken = tmp_path / "results"
    taken.write_text("earlier results\n")
    (tmp_path / "folder.json").mkdir()
    model_folder_taken = tmp_path / "out"
    model_folder_taken.mkdir()
    (model_folder_taken / sanitize_model_name(str(run["dump"].resolve()))).write_text("")
    for output, says in [(taken, "is a file, not a folder"), (taken / "sub", f"({taken} is not a folder, so"),
                         (taken / "r.json", f"({taken} is not a folder)"),
                         (tmp_path / "folder.json", "is a folder: a path ending in .json names the results file"),
                         (model_folder_taken, "is not a folder)")]:
        rc = eval_main(["--checkpoint", str(run["dump"]), "--tasks", "tiny_mc", "--include_path", str(TASKS_DIR),
                        "--limit", "2", "--output_path", str(output)])
        out, err = capsys.readouterr()
        assert rc == 2 and len(err.strip().splitlines()) == 1, (output, err)
        assert err.startswith(f"trainer eval: --output_path {output}") and says in err, err
        assert "acc" not in out, out  # no results table: nothing was evaluated
    assert taken.read_text() == "earlier results\n"


def test_results_that_cannot_be_saved_are_one_line_and_exit_5_after_the_table(run, capsys, tmp_path, monkeypatch):
    """A save that fails during the evaluation (here the disk fills up when the results file is written; in
    lm-eval's folder layout lm-eval logs that and goes on): one line, exit 5 (OutputError), no "results
    written", the table still printed."""
    import errno
    import logging

    from lm_eval.utils import sanitize_model_name

    real_write = Path.write_text

    def full_disk(path, *args, **kwargs):
        if path.name.startswith("results_") or path.name == "lost.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("trainer").addHandler(handler)
    try:
        for output, says in [(tmp_path / "out", f"could not be written under {tmp_path / 'out'}"),
                             (tmp_path / "lost.json", f"could not be written to {tmp_path / 'lost.json'} (No space")]:
            rc = eval_main(["--checkpoint", str(run["dump"]), "--tasks", "tiny_mc", "--include_path",
                            str(TASKS_DIR), "--limit", "2", "--output_path", str(output)])
            out, err = capsys.readouterr()
            line = [l for l in err.splitlines() if l.startswith("trainer eval:")]
            assert rc == 5 and len(line) == 1 and says in line[0], err
            assert "Traceback" not in err and "tiny_mc" in out
    finally:
        logging.getLogger("trainer").removeHandler(handler)
    assert not any("results written" in r for r in records), records
    assert not list(tmp_path.rglob("results_*.json")) and not (tmp_path / "lost.json").exists()
    # The model folder lm-eval made before the write failed: named from the checkpoint's absolute path.
    assert [p.name for p in (tmp_path / "out").iterdir()] == [sanitize_model_name(str(run["dump"].resolve()))]
    assert sanitize_model_name(str(run["dump"].resolve())) == str(run["dump"].resolve()).replace("/", "__")
