"""``trainer data audit`` / ``prepare`` (in-process) and the throughput measurement."""

from __future__ import annotations

import json

import pytest

from trainer.data.cli import main
from trainer.data.sources import REGISTRY
from tests.support.data import make_config, synthetic_texts, write_jsonl


def test_audit_json_on_bundled_corpus(capsys):
    assert main(["audit", "--json", "--", "--training.seq_len", "256"]) == 0
    report = json.loads(capsys.readouterr().out)
    with open(REGISTRY["shakespeare"]["train"][1], encoding="utf-8") as f:
        lines = sum(1 for line in f if line.strip())
    assert report["doubled_separators"] == 0
    assert report["missing_separators"] == 0
    assert report["separators_per_boundary"] == 1.0
    assert report["documents"] == lines  # one pass: every document once
    assert report["skipped_empty"] == report["skipped_malformed"] == report["skipped_undecodable"] == 0
    assert report["sequences"] > 0 and report["mixture"][0]["share"] == 1.0


def test_audit_table_and_errors(tmp_path, capsys):
    write_jsonl(tmp_path / "a.jsonl", synthetic_texts(30, seed=1))
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "x"}\nnot json\n{"text": ""}\n' * 5)
    args = ["audit", "--sequences", "50", "--data.sources", f"jsonl:{tmp_path}/a.jsonl,jsonl:{tmp_path}/b.jsonl",
            "--data.weights", "3,1", "--training.seq_len", "16", "--data.num_shards", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "doubled separators" in out and "skipped: malformed" in out and "b.jsonl" in out
    assert main(args + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sequences"] == 50 and report["skipped_malformed"] > 0
    assert [m["share"] for m in report["mixture"]] == pytest.approx([0.75, 0.25], abs=0.03)

    assert main(["audit", "--training.dataset", "jsonl", "--training.dataset_path", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_without_a_config_file_the_data_tools_read_what_run_train_sh_trains(tmp_path, capsys, monkeypatch):
    """No --job.config_file and no $CONFIG_FILE: the config ./run_train.sh trains by default (its seq_len, not the
    bare default's 2048), named in the reports; $CONFIG_FILE is honoured as run_train.sh honours it."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run_train_config = root / "train_configs" / "debug_model.toml"
    assert 'CONFIG_FILE=${CONFIG_FILE:-"$ROOT/train_configs/debug_model.toml"}' in (root / "run_train.sh").read_text()
    monkeypatch.delenv("CONFIG_FILE", raising=False)
    assert main(["audit", "--json", "--sequences", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    want = tomllib.loads(run_train_config.read_text())["training"]["seq_len"]
    assert report["config"] == str(run_train_config) and report["seq_len"] == want != 2048
    other = tmp_path / "other.toml"
    other.write_text("[training]\nseq_len = 48\n")
    monkeypatch.setenv("CONFIG_FILE", str(other))
    assert main(["audit", "--sequences", "4"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert lines[0] == ["config", str(other)], out
    assert lines[2][:6] == ["seq_len", "/", "shards", "/", "separator", "48"], out


def test_an_audit_that_packs_nothing_exits_4_after_its_report(tmp_path, capsys):
    """Fewer tokens per shard than a window: the report, then one line with the reason and the data exit code. The
    shard count left at its default is lowered for the small source as training lowers it."""
    write_jsonl(tmp_path / "a.jsonl", synthetic_texts(20, seed=1))
    assert main(["audit", "--json", "--data.sources", f"jsonl:{tmp_path}/a.jsonl", "--training.seq_len", "1024"]) == 4
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["sequences"] == 0 and 1 < report["num_shards"] < 64
    assert len(err.strip().splitlines()) == 1 and err.startswith(
        "data error: trainer data audit: packed no sequence: no shard holds seq_len + 1 = 1025 tokens"), err
    assert "lower training.seq_len or data.num_shards" in err


def test_prepare_command(tmp_path, capsys):
    write_jsonl(tmp_path / "a.jsonl", synthetic_texts(30, seed=2))
    out = tmp_path / "prepared"
    assert main(["prepare", "--output", str(out), "--workers", "2", "--no-progress",
                 "--training.dataset", "jsonl", "--training.dataset_path", str(tmp_path / "a.jsonl")]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stats"]["documents"] == 30
    assert "tokens:" in capsys.readouterr().out
    assert main(["prepare", "--output", str(out), "--source", f"jsonl:{tmp_path}/a.jsonl"]) == 2  # exists
    # The prepared folder audits like the text it came from.
    common = ["audit", "--json", "--training.seq_len", "32", "--data.num_shards", "2"]
    assert main(common + ["--training.dataset", "tokens", "--training.dataset_path", str(out)]) == 0
    from_tokens = json.loads(capsys.readouterr().out)
    assert main(common + ["--training.dataset", "jsonl", "--training.dataset_path", str(tmp_path / "a.jsonl")]) == 0
    from_text = json.loads(capsys.readouterr().out)
    for key in ("documents", "tokens", "sequences", "boundaries", "doubled_separators"):
        assert from_tokens[key] == from_text[key], key


def test_measure_throughput_smoke(tmp_path):
    from trainer.tools.bench.data import measure_throughput

    write_jsonl(tmp_path / "a.jsonl", synthetic_texts(200, seed=3, max_len=400))
    config = make_config(**{"training.dataset": "jsonl", "training.dataset_path": str(tmp_path / "a.jsonl"),
                            "training.seq_len": 64, "training.local_batch_size": 4, "data.num_shards": 4})
    result = measure_throughput(config, seconds=0.2, prepare_workers=1)
    assert result["tokens_per_s_on_the_fly"] > 0 and result["tokens_per_s_pretokenized"] > 0
