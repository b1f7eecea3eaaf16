"""torchtitan v0.2.x users' files run unchanged: every JobConfig key, its flavor and dataset names, its
tokenizer folders, its command-line flags and its learning-rate schedule (docs/coming_from_torchtitan.md)."""

from __future__ import annotations

import functools
import json
import math
import typing

import pytest
import torch

from tests.support.data import make_c4
from tests.support.launch import ROOT
from tests.support.tokenizers import make_tokenizer_folder
from trainer.compat import REFUSED
from trainer.config import ConfigError, leaf_keys, load_config, section_of, validate
from trainer.optim.config import LRScheduler
from trainer.optim.optimizer import LRSchedule

ASSETS = ROOT / "tests" / "assets" / "torchtitan"
# torchtitan v0.2.2's JobConfig: every key with its type and default (facts read from its source).
TORCHTITAN_KEYS = json.loads((ASSETS / "job_config_v0.2.2.json").read_text())
TOMLS = {"debug_model": 1, "base_config": 8, "llama3_8b": 64, "llama3_70b": 64, "llama3_405b": 128,
         "llama3_ft_debug_model": 4}  # torchtitan's llama3_ft/train_configs/debug_model.toml: needs torchft



# --------------------------------------------------------------------------------------------------
# Assets a torchtitan user has: a Hugging Face tokenizer folder and a local copy of C4
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------------


def test_every_torchtitan_key_exists_with_its_type():
    ours = leaf_keys()
    assert len(TORCHTITAN_KEYS) == 149
    assert [k for k in TORCHTITAN_KEYS if k not in ours] == []


def test_every_torchtitan_key_loads_at_its_default(tmp_path):
    """A TOML setting all 149 keys to torchtitan's defaults (None cannot be written in TOML) is accepted."""
    sections: dict[str, list[str]] = {}
    for key, spec in TORCHTITAN_KEYS.items():
        if spec["default"] is not None:
            section, _, name = key.rpartition(".")
            sections.setdefault(section, []).append(f"{name} = {json.dumps(spec['default'])}")
    text = "\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in sections.items())
    (tmp_path / "all.toml").write_text(text)
    # c4_test without a local path is accepted by a dry run only (a real run needs training.dataset_path).
    config = load_config(["--job.config_file", str(tmp_path / "all.toml"), "--job.dry_run"], env={})
    validate(config, 1)


def non_default(key: str):
    """A value torchtitan accepts for ``key`` other than its default."""
    cls, f = leaf_keys()[key]
    tp, default = typing.get_type_hints(cls)[f.name], TORCHTITAN_KEYS[key]["default"]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    literal = next((a for a in [tp, *args] if typing.get_origin(a) is typing.Literal), None)
    if literal is not None:
        others = [c for c in typing.get_args(literal) if c != default]
        return others[0] if others else None
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 2
    if isinstance(default, list) or list[str] in [tp, *args]:
        return ["layers.0"]
    return "something"


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_unsupported_keys_are_refused_with_the_reason(key):
    value = non_default(key)
    if value is None:
        pytest.skip(f"{key} has a single value")
    config = load_config([], env={})
    section_of(config, key.rpartition(".")[0]).__setattr__(key.rpartition(".")[2], value)
    with pytest.raises(ConfigError) as e:
        validate(config)
    message = str(e.value)
    assert message.startswith(key) and "not supported" in message and "\n" not in message


def test_flavor_and_boolean_flags_from_torchtitan_command_lines():
    c = load_config(["--model.flavor", "8B", "--checkpoint.no_initial_load_model_only",
                     "--metrics.no-enable-tensorboard", "--compile.enable"], env={})
    assert c.model.flavor == "llama3_8b" and not c.checkpoint.initial_load_model_only
    assert c.metrics.enable_tensorboard is False and c.compile.enable is True
    assert load_config(["--model.name", "llama2", "--model.flavor", "70B"], env={}).model.flavor == "llama2_70b"
    with pytest.raises(ConfigError, match="takes no value"):
        load_config(["--checkpoint.no_enable=true"], env={})
    with pytest.raises(ConfigError, match="did you mean 'training.steps'"):
        load_config(["--training.no_steps"], env={})


def test_torchtitan_dataset_names_read_local_files(tmp_path):
    with pytest.raises(ConfigError, match="set training.dataset_path to a local copy"):
        validate(load_config(["--training.dataset", "c4"], env={}))
    c4 = make_c4(tmp_path / "c4", docs=5)
    from trainer.data.sources import training_specs, validation_spec

    c = load_config(["--training.dataset", "c4", "--training.dataset_path", str(c4), "--validation.enable",
                     "--validation.dataset", "c4_validation", "--validation.dataset_path", str(c4)], env={})
    assert training_specs(c)[0][0].path.endswith("c4-train.*") and validation_spec(c).path.endswith("c4-validation.*")
    sample = tmp_path / "c4_test"  # torchtitan's c4_test: a folder holding one JSON-lines file
    sample.mkdir()
    (sample / "data.json").write_text(json.dumps({"text": "a b c", "timestamp": "t", "url": "u"}) + "\n")
    spec = training_specs(load_config(["--training.dataset", "c4_test", "--training.dataset_path", str(sample)],
                                      env={}))[0][0]
    assert (spec.kind, spec.path) == ("jsonl", str(sample))
    import pyarrow as pa
    import pyarrow.parquet as pq

    converted = tmp_path / "c4_parquet" / "en"  # the hub's parquet conversion: same columns
    converted.mkdir(parents=True)
    pq.write_table(pa.table({"text": ["a b", "c d"], "timestamp": ["t", "t"], "url": ["u", "v"]}),
                   converted / "c4-train.00000-of-00001.parquet")
    spec = training_specs(load_config(["--training.dataset", "c4", "--training.dataset_path",
                                       str(converted.parent)], env={}))[0][0]
    assert spec.kind == "parquet" and spec.path.endswith("c4-train.*")


def test_print_config_logs_and_save_config_file_writes(tmp_path, caplog):
    from trainer.compat import announce

    c = load_config(["--job.print_config", "--job.save_config_file", "sub/config.json", "--job.dump_folder",
                     str(tmp_path), "--training.steps", "7"], env={})
    with caplog.at_level("INFO", logger="trainer"):
        announce(c, rank=0)
    assert "Running with configs" in caplog.text and '"steps": 7' in caplog.text
    assert json.loads((tmp_path / "sub" / "config.json").read_text())["training"]["steps"] == 7


# --------------------------------------------------------------------------------------------------
# The learning-rate schedule, held against torchtitan's formula
# --------------------------------------------------------------------------------------------------


def torchtitan_lrs(lr: float, steps: int, warmup: int, decay_ratio, decay_type: str, min_lr: float,
                   total_steps=None) -> list[float]:
    """An independent re-statement of torchtitan v0.2.2's schedule (components/lr_scheduler.py) driven the
    way its trainer drives it: a LambdaLR over the 0-based step, stepped after every optimizer step."""
    total = total_steps if total_steps is not None else steps
    warmup = min(int(warmup), total)
    decay = total - warmup
    if decay_ratio is not None:
        decay = min(round(total * decay_ratio), total - warmup)
    stable = total + 1 - warmup - decay  # the "virtual last step"

    def factor(current: int) -> float:
        if current < warmup:
            return float((current + 1) / warmup)
        if current < warmup + stable:
            return 1.0
        progress = float(current + 1 - (warmup + stable)) / decay
        adjust = {"linear": lambda: 1 - progress, "sqrt": lambda: 1 - math.sqrt(progress),
                  "cosine": lambda: 0.5 * (1.0 + math.cos(math.pi * progress))}[decay_type]()
        return min_lr + (1 - min_lr) * adjust

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(factor))
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


LR_CASES = [  # (steps, warmup, decay_ratio, decay_type, min_lr_factor, total_steps)
    (10, 2, 0.8, "linear", 0.0, None),  # torchtitan's debug_model.toml
    (1000, 200, None, "linear", 0.0, None),  # its 8B preset
    (30, 5, None, "cosine", 0.1, None),
    (30, 5, None, "sqrt", 0.2, None),
    (30, 3, 0.5, "cosine", 0.0, None),
    (20, 0, None, "linear", 0.0, None),
    (20, 8, 0.9, "linear", 0.0, None),  # warmup + decay longer than the run: decay clamped
    (10, 50, None, "linear", 0.0, None),  # warmup longer than the run: clamped with a warning
    (10, 4, 0.5, "cosine", 0.1, 40),  # a short run on a long run's curve
]


@pytest.mark.parametrize("steps, warmup, ratio, kind, min_lr, total", LR_CASES)
def test_learning_rate_equals_torchtitans_at_every_step(steps, warmup, ratio, kind, min_lr, total):
    expected = torchtitan_lrs(3e-4, steps, warmup, ratio, kind, min_lr, total)
    cfg = LRScheduler(warmup_steps=warmup, decay_ratio=ratio, decay_type=kind, min_lr_factor=min_lr,
                      total_steps=total)
    ours = LRSchedule(cfg, base_lr=3e-4, total_steps=steps)
    assert [ours.lr(s) for s in range(1, steps + 1)] == pytest.approx(expected, rel=1e-12, abs=0)


# --------------------------------------------------------------------------------------------------
# A tokenizer folder, the TOMLs, and ten steps of the debug model
# --------------------------------------------------------------------------------------------------


def test_hf_assets_folder_with_bos_and_eos_declared_in_tokenizer_config(tmp_path):
    from tokenizer import build_tokenizer

    folder = make_tokenizer_folder(tmp_path / "tokenizer")
    tok = build_tokenizer(folder)
    assert tok.bos_id is not None and tok.eos_id is not None and tok.bos_id != tok.eos_id
    ids = tok.encode("To be, or not to be", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[1:].count(tok.bos_id) == 0 and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "To be, or not to be"
    assert tok.vocab_size == max(tok.bos_id, tok.eos_id) + 1
    c = load_config(["--model.hf_assets_path", str(folder)], env={})
    assert c.model.tokenizer_path == str(folder)  # the tokenizer comes from the assets folder


@pytest.mark.parametrize("name", sorted(TOMLS))
def test_torchtitan_tomls_pass_a_dry_run_unchanged(name, tmp_path, monkeypatch, capsys):
    from trainer.train import main

    if name.startswith("llama3_ft"):
        pytest.importorskip("torchft")

    make_tokenizer_folder(tmp_path / "tests" / "assets" / "tokenizer")  # where the debug TOMLs look
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", str(TOMLS[name]))
    assert main(["--job.config_file", str(ASSETS / f"{name}.toml"), "--job.dry_run"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["status"] == "ok"


@pytest.mark.parametrize("name,cp", [("debug_model", 2), ("llama3_70b", 4)])
def test_torchtitan_tomls_with_context_parallel_pass_a_dry_run(name, cp, tmp_path, monkeypatch, capsys):
    """torchtitan's files with context_parallel_degree set (nothing else changed) at cp x their world size."""
    from trainer.train import main

    text = (ASSETS / f"{name}.toml").read_text()
    assert "context_parallel_degree = 1" in text
    (tmp_path / "cp.toml").write_text(text.replace("context_parallel_degree = 1", f"context_parallel_degree = {cp}"))
    make_tokenizer_folder(tmp_path / "tests" / "assets" / "tokenizer")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", str(TOMLS[name] * cp))
    assert main(["--job.config_file", str(tmp_path / "cp.toml"), "--job.dry_run"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["status"] == "ok" and f"cp={cp}" in report["layout"]


# --------------------------------------------------------------------------------------------------
# docs/coming_from_torchtitan.md: the key table, generated here from the facts above
# --------------------------------------------------------------------------------------------------

# Keys whose default differs from torchtitan's on purpose, and why (the same words as in the docs).
DEFAULT_DIFFERENCES = {
    "job.description": "empty rather than a placeholder (it is written to summary.json)",
    "profiling.profile_freq": "a trace every 10 steps slows a long run; torchtitan's own presets use 100",
    "metrics.enable_tensorboard": "the events are small and always worth plotting; set false to match",
    "model.hf_assets_path": "the bundled debug tokenizer stands in for torchtitan's ./tests/assets/tokenizer, "
                            "which exists only inside its repository",
    "model.flavor": "this trainer's debug model (4 key/value heads, vocabulary from the tokenizer); torchtitan's "
                    "is flavor debugmodel, key for key",
    "training.dataset": "the bundled Shakespeare sample needs no download",
    "validation.dataset": "the bundled Shakespeare sample's validation split",
    "validation.seq_len": "-1: training.seq_len, so the validation loss compares with the training loss",
    "validation.freq": "validating every 10 steps costs a lot in a long run; torchtitan's presets use 500",
    "validation.steps": "a bounded pass; -1 (the whole set) is still accepted",
    "activation_checkpoint.mode": "the small models one starts with need no recomputation",
    "activation_checkpoint.selective_ac_option": "with mode selective, per-op saving is the better default",
    "quantize.linear.float8.recipe_name": "torchtitan's None also means tensorwise scaling",
    "quantize.linear.float8.filter_fqns": "the output layer stays in high precision, as every torchtitan preset "
                                          "sets it",
}
_UNSET = (None, "", [])


def key_table() -> str:
    from trainer.compat import REFUSED
    from trainer.config import JobConfig

    ours = JobConfig()
    rows = ["| key | torchtitan v0.2.2 default | here |", "| --- | --- | --- |"]
    for key, spec in TORCHTITAN_KEYS.items():
        theirs, here = spec["default"], section_of(ours, key)
        if key in REFUSED:
            what = f"refused unless the default: {REFUSED[key]}"
        elif here == theirs or (here in _UNSET and theirs in _UNSET):
            what = "same"
        else:
            what = f"default `{json.dumps(here)}`: {DEFAULT_DIFFERENCES[key]}"
        rows.append(f"| `{key}` | `{json.dumps(theirs)}` | {what.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def test_docs_key_table_is_current():
    doc = (ROOT / "docs" / "coming_from_torchtitan.md").read_text()
    assert key_table() in doc, "regenerate: python -m tests.test_torchtitan_compat > the table in the doc"


if __name__ == "__main__":
    print(key_table(), end="")
