"""Tokenizers' BOS/EOS rule, lm_eval's command line and evaluation during training.

- Two tokenizers made with `tokenizers`: one whose post-processor adds ``<s> ... </s>`` (with a
  tokenizer_config.json), one GPT-2-style (only ``<|endoftext|>``, no tokenizer_config.json). For each, the
  data pipeline packs a document as the exported tokenizer encodes it, and the real ``lm_eval`` CLI on the
  export scores exactly as ``trainer eval`` on the checkpoint, both given the same lm_eval command line
  (``--batch_size auto``, ``--seed 0,1234,1234,1234``, ``--log_samples``, ``--output_path``), both writing
  lm_eval's layout.
- (``[eval]`` under FSDP, HSDP, TP and PP against ``trainer eval`` of the checkpoint: tests/distributed/test_eval.py.)
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from tests.support.launch import ROOT  # noqa: E402
from tests.support.processes import popen  # noqa: E402
from tests.support.models import fast_model  # noqa: E402
from tokenizer.policy import files_rule, run_separator  # noqa: E402
from torchtitan_ext.evaluation.callback import flatten_results  # noqa: E402
from torchtitan_ext.hf import main as export_main  # noqa: E402
from torchtitan_ext.lm_eval_model import main as eval_main  # noqa: E402
from torchtitan_ext.native import save_native_checkpoint  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.data.tokenizer import load_tokenizer  # noqa: E402
from trainer.models.config import resolve_model_args  # noqa: E402

TASKS_DIR = ROOT / "tests" / "assets" / "lm_eval_tasks"
CORPUS = ROOT / "trainer" / "data" / "sample" / "shakespeare_train.jsonl"
LM_EVAL = Path(sys.executable).parent / "lm_eval"
TASKS = "tiny_mc,tiny_ppl,tiny_gen"
# A typical lm_eval command line, after the model arguments. trainer eval gets --batch_size auto; lm_eval
# gets 8 (its automatic batch size probes with full-length batches, a minute on a CPU).
COMMON = ["--tasks", TASKS, "--include_path", str(TASKS_DIR), "--limit", "6", "--max_batch_size", "8",
          "--seed", "0,1234,1234,1234", "--log_samples", "--device", "cpu"]
TEXT = "First Citizen: Before we proceed any further, hear me speak."


@functools.lru_cache(maxsize=None)
def _trained(kind: str) -> str:
    """The tokenizer.json text of :func:`make_tokenizer`'s kind, trained once per process (a CPU-second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()[:2000]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"] if kind == "llama" else ["<|endoftext|>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if kind == "llama":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1", special_tokens=[("<s>", 0), ("</s>", 1)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str(pretty=True)


def make_tokenizer(kind: str, folder: Path) -> Path:
    """A byte-level BPE tokenizer trained on the bundled corpus: "llama" (<s> $A </s> post-processor and a
    tokenizer_config.json) or "gpt2" (only <|endoftext|>, no tokenizer_config.json)."""
    folder.mkdir(parents=True)
    if kind == "llama":
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
             "pad_token": "<pad>"}))
    (folder / "tokenizer.json").write_text(_trained(kind))
    return folder


def lm_eval_outputs(out: Path) -> tuple[dict[str, float], list[str], dict]:
    """(metrics, file names relative to the output folder, results JSON) of an lm_eval output folder."""
    [model_dir] = [p for p in out.iterdir() if p.is_dir()]
    [results_file] = model_dir.glob("results_*.json")
    results = json.loads(results_file.read_text())
    names = sorted(p.name.rsplit("_", 1)[0] for p in model_dir.iterdir())  # the timestamp dropped
    return flatten_results(results), names, results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """For each tokenizer kind: a checkpoint (seeded random weights), its export and both evaluations: the
    real lm_eval CLI on the export (both kinds at once, in the background), trainer eval on the checkpoint."""
    out, procs = {}, {}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def start_lm_eval(info):  # lm_eval resolves the tasks' relative data_files against the working directory
        return popen(
            [str(LM_EVAL), "--model", "hf", "--model_args", f"pretrained={info['hf']},max_length=256", *COMMON,
             "--batch_size", "8", "--output_path", str(info["tmp"] / "lm_eval")], cwd=TASKS_DIR, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    for kind in ("llama", "gpt2"):
        tmp = tmp_path_factory.mktemp(kind)
        tok_dir = make_tokenizer(kind, tmp / "tokenizer")
        config = load_config(["--model.flavor", "debug_gqa", "--model.tokenizer_path", str(tok_dir),
                              "--training.seq_len", "64"], env={})
        tok = load_tokenizer(config)
        model = fast_model(resolve_model_args(config, tok.vocab_size))
        dump, hf = tmp / "run", tmp / "hf"
        save_native_checkpoint(model.state_dict(), dump, step=3, config=config)
        assert export_main(["--checkpoint", str(dump), "--output", str(hf), "--dtype", "fp32"]) == 0
        out[kind] = {"kind": kind, "config": config, "tok": tok, "dump": dump, "hf": hf, "tmp": tmp}
    # Two cores: one lm_eval at a time beside this process's trainer eval runs.
    procs["llama"] = start_lm_eval(out["llama"])
    for kind, info in out.items():
        assert eval_main(["--model_args", f"checkpoint={info['dump']},max_length=256", *COMMON,
                          "--batch_size", "auto", "--output_path", str(info["tmp"] / "trainer")]) == 0
    procs["gpt2"] = start_lm_eval(out["gpt2"])
    for kind, proc in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log[-4000:]
    return out


@pytest.fixture(params=["llama", "gpt2"])
def exported(request, runs):
    return runs[request.param]


def packed_document(config, tok, tmp: Path) -> list[int]:
    """The first packed tokens of a one-document corpus, as training reads them."""
    from trainer.data.loader import build_plan
    from trainer.data.pipeline import ShardStream
    from trainer.data.sources import training_specs

    (tmp / "doc.jsonl").write_text(json.dumps({"text": TEXT}) + "\n")
    config = load_config(["--model.tokenizer_path", config.model.tokenizer_path, "--training.seq_len", "128",
                          "--data.sources", f"jsonl:{tmp / 'doc.jsonl'}", "--data.num_shards", "1"], env={})
    specs, weights = training_specs(config)
    plan = build_plan(config, tok, specs, weights, num_shards=1, shuffle=False, max_epochs=None)
    return [int(t) for t in ShardStream(0, plan).next().tokens]


@pytest.mark.slow  # the lm_eval CLI or a 2-process run
def test_training_and_export_follow_one_bos_eos_rule(exported):
    tok, hf = exported["tok"], exported["hf"]
    plain = tok.encode(TEXT)
    packed = packed_document(exported["config"], tok, exported["tmp"])
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf))
    sep = run_separator(exported["config"], tok)
    if exported["kind"] == "llama":
        # The post-processor adds <s> ... </s>; training puts one <s> before every document, and so does
        # the export (its </s> removed from the post-processor and tokenizer_config.json).
        assert (sep.name, tok.bos_id) == ("bos", 0)
        assert packed[:len(plain) + 2] == [0, *plain, 0]
        assert hf_tok.encode(TEXT) == [0, *plain]
        rule = files_rule(hf)
        assert (rule.adds_bos, rule.adds_eos) == (True, False)
        cfg = json.loads((hf / "tokenizer_config.json").read_text())
        assert (cfg["add_bos_token"], cfg["add_eos_token"]) == (True, False)
    else:
        # Only <|endoftext|>: it is the EOS and separates documents; the export adds nothing.
        assert (tok.bos_id, tok.eos_id, sep.name) == (None, 0, "eos")
        assert packed[:len(plain) + 1] == [*plain, 0]
        assert hf_tok.encode(TEXT) == plain and hf_tok.eos_token_id == 0


@pytest.mark.slow  # the lm_eval CLI or a 2-process run
def test_export_of_an_eos_separated_run_adds_nothing(runs, tmp_path):
    """data.separator = eos with a tokenizer that adds <s> ... </s>: the exported files add nothing."""
    import shutil

    from tokenizer.policy import align_exported_tokenizer, choose_separator

    tok = runs["llama"]["tok"]
    folder = shutil.copytree(Path(runs["llama"]["config"].model.tokenizer_path), tmp_path / "export")
    assert align_exported_tokenizer(folder, tok, choose_separator(tok, "eos"))
    rule = files_rule(folder)
    assert (rule.adds_bos, rule.adds_eos) == (False, False)
    assert transformers.AutoTokenizer.from_pretrained(str(folder)).encode(TEXT) == tok.encode(TEXT)


@pytest.mark.slow  # the lm_eval CLI or a 2-process run
def test_lm_eval_cli_on_export_equals_trainer_eval_on_checkpoint(exported):
    theirs, their_files, their_json = lm_eval_outputs(exported["tmp"] / "lm_eval")
    ours, our_files, our_json = lm_eval_outputs(exported["tmp"] / "trainer")
    for key in ("eval/tiny_mc/acc", "eval/tiny_mc/acc_norm", "eval/tiny_ppl/bits_per_byte",
                "eval/tiny_ppl/word_perplexity", "eval/tiny_gen/exact_match"):
        assert key in ours, (key, ours)
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert abs(value - theirs[key]) <= 1e-4 * max(1.0, abs(value)), (key, value, theirs[key])
    # lm_eval's layout: <output_path>/<model>/results_<time>.json and samples_<task>_<time>.jsonl.
    assert our_files == their_files == ["results", "samples_tiny_gen", "samples_tiny_mc", "samples_tiny_ppl"]
    assert set(their_json) <= set(our_json)
    assert set(their_json["config"]) <= set(our_json["config"])
    assert our_json["config"]["model"] == "trainer" and their_json["config"]["model"] == "hf"
    assert our_json["config"]["random_seed"] == 0 and our_json["config"]["fewshot_seed"] == 1234
    for key in ("device", "gen_kwargs"):  # as lm_eval writes them (batch_sizes: ours ran with auto)
        assert our_json["config"][key] == their_json["config"][key], (key, our_json["config"][key])
    assert our_json["config"]["batch_sizes"] == [8] and their_json["config"]["batch_sizes"] == []


def test_eval_cli_refusals(capsys, tmp_path):
    base = ["--model_args", f"checkpoint={tmp_path}", "--tasks", "tiny_mc"]
    for extra, words in ((["--wandb_args", "project=x"], "--wandb_args"),
                         (["--apply_chat_template"], "chat template"),
                         (["--config", "run.yaml"], "YAML"),
                         (["--hf_hub_log_args", "hub_results_org=x"], "Hub"),
                         (["--model", "vllm"], "other backends")):
        assert eval_main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    assert eval_main(["ls", "tasks"]) == 2
    assert eval_main(["--model", "hf", "--model_args", f"pretrained={tmp_path}", "--tasks", "x"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_audit_reports_special_token_text(tmp_path, capsys):
    from trainer.data.cli import main as data_main

    tok_dir = make_tokenizer("llama", tmp_path / "tok")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "a <s> b </s> c </s>"}) + "\n"
                                      + json.dumps({"text": "plain"}) + "\n")
    assert data_main(["audit", "--json", "--", "--model.tokenizer_path", str(tok_dir), "--data.sources",
                      f"jsonl:{tmp_path / 'd.jsonl'}", "--data.num_shards", "1", "--training.seq_len", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["literal_special_tokens"] == {"documents": 1, "occurrences": {"</s>": 2, "<s>": 1}}


def test_eval_config_rules():
    from trainer.config import validate
    from trainer.errors import ConfigError

    def check(*args):
        validate(load_config(list(args), env={}), 1, files=False)

    with pytest.raises(ConfigError, match="multiple of metrics.log_freq"):
        check("--eval.freq", "3", "--eval.tasks", "tiny_mc", "--metrics.log_freq", "5")
    with pytest.raises(ConfigError, match="eval.tasks is empty"):
        check("--eval.freq", "5", "--metrics.log_freq", "5")
    check("--eval.freq", "10", "--eval.tasks", "tiny_mc", "--metrics.log_freq", "5")
    # Tensor and pipeline parallel are evaluated as they are sharded (tests/distributed/test_eval.py).
    for layout in (["--parallelism.tensor_parallel_degree", "2"], ["--parallelism.pipeline_parallel_degree", "2"]):
        validate(load_config(["--eval.freq", "5", "--eval.tasks", "tiny_mc", "--metrics.log_freq", "5", *layout],
                             env={}), 2, files=False)
    # Context parallel too; beside pipeline parallel it is one line.
    cp = ["--eval.freq", "5", "--eval.tasks", "tiny_mc", "--metrics.log_freq", "5",
          "--parallelism.context_parallel_degree", "2"]
    validate(load_config(cp, env={}), 2, files=False)
    with pytest.raises(ConfigError, match="context_parallel_degree > 1 and pipeline_parallel_degree > 1"):
        validate(load_config([*cp, "--parallelism.pipeline_parallel_degree", "2"], env={}), 4, files=False)
