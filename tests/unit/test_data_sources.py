"""Sources and documents: formats, bad data, the separator policy, the pre-tokenized path."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.config import ConfigError
from trainer.data.loader import build_train_loader
from trainer.data.sources import DataError
from trainer.data.audit import audit
from trainer.data.prepare import prepare
from tests.support.data import ByteTokenizer, make_config, synthetic_texts, token_map, write_jsonl

TOK = ByteTokenizer()


def loader_for(source: str, *, tokenizer=TOK, **kw):
    base = {"data.sources": [source], "training.seq_len": 16, "training.local_batch_size": 4,
            "data.num_shards": 2, "data.shuffle_window": 4, "data.debug_doc_ids": True}
    base.update(kw)
    return build_train_loader(make_config(**base), tokenizer, dp_rank=0, dp_world_size=1)


def one_epoch(loader, limit=2000):
    """Batches until every shard has started its second epoch (so each document was used whole)."""
    batches = []
    while loader.stats["epoch"] < 1:
        batches.append(next(loader))
        assert len(batches) < limit, "the loader does not get through its data"
    return batches


def texts_seen(batches, tokenizer=TOK):
    """The document texts reassembled from the packed tokens (separators removed)."""
    out = set()
    for doc in token_map(batches).values():
        ids = [doc[p] for p in sorted(doc)]
        assert sorted(doc) == list(range(len(ids))), "a document has holes"
        out.add(tokenizer.decode([i for i in ids if i < 256]))
    return out


# --------------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------------


def test_jsonl_text_and_globs(tmp_path):
    texts = synthetic_texts(30, seed=3)
    write_jsonl(tmp_path / "a.jsonl", texts[:15])
    write_jsonl(tmp_path / "b.jsonl", texts[15:])
    assert texts_seen(one_epoch(loader_for(f"{tmp_path}/*.jsonl"))) == set(texts)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x.txt").write_text("\n".join(texts[:10]) + "\n")
    assert texts_seen(one_epoch(loader_for(f"text:{tmp_path}/t"))) == set(texts[:10])  # a folder
    for i, t in enumerate(texts[:6]):
        (tmp_path / "t" / f"doc{i}.txt").write_text(t + "\nsecond line")
    files = loader_for(f"text:{tmp_path}/t/doc*.txt", **{"data.text_document": "file"})
    assert texts_seen(one_epoch(files)) == {t + "\nsecond line" for t in texts[:6]}


def test_parquet_and_arrow(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = synthetic_texts(40, seed=4)
    table = pa.table({"id": list(range(40)), "content": texts})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=7)
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table.slice(0, 20), max_chunksize=6)
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table.slice(20), max_chunksize=6)
    kw = {"data.text_field": "content"}
    assert texts_seen(one_epoch(loader_for(f"{tmp_path}/a.parquet", **kw))) == set(texts)
    assert texts_seen(one_epoch(loader_for(f"arrow:{tmp_path}/*.arrow", **kw))) == set(texts)
    with pytest.raises(ConfigError, match="data.text_field"):
        loader_for(f"{tmp_path}/a.parquet")


def test_hf_datasets_local(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    texts = synthetic_texts(20, seed=5)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    assert texts_seen(one_epoch(loader_for(f"hf:{tmp_path}/saved"))) == set(texts)
    # Exact resume also holds for the HF stream (coordinates count examples).
    loader = loader_for(f"hf:{tmp_path}/saved")
    [next(loader) for _ in range(3)]
    state = loader.state_dict()
    expected = [next(loader) for _ in range(3)]
    again = loader_for(f"hf:{tmp_path}/saved")
    again.load_state_dict(state)
    for a, b in zip(expected, [next(again) for _ in range(3)]):
        assert torch.equal(a["input"], b["input"])


def test_a_new_source_kind_is_its_class_and_one_table_entry(tmp_path, monkeypatch):
    """sources.KINDS is the only place a kind is registered: with one entry added, a bare path with the class's
    extension is that kind, ``kind:path`` reads it, and error messages list it."""
    from trainer.data import sources
    from trainer.data.source_base import OK

    class ReversedText(sources.TextSource):  # each line, read backwards
        kind, extensions = "rtext", (".rtxt",)

        def decode(self, payload):
            status, text = super().decode(payload)
            return (status, text[::-1]) if status == OK else (status, text)

    texts = synthetic_texts(12, seed=9)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.rtxt").write_text("\n".join(texts) + "\n")
    with pytest.raises(ConfigError, match="cannot tell the source kind"):
        loader_for(str(tmp_path / "d" / "a.rtxt"))
    monkeypatch.setitem(sources.KINDS, "rtext", ReversedText)
    backwards = {t[::-1] for t in texts}
    assert texts_seen(one_epoch(loader_for(str(tmp_path / "d" / "a.rtxt")))) == backwards  # by its extension
    assert texts_seen(one_epoch(loader_for(f"rtext:{tmp_path}/d"))) == backwards  # a folder of its files
    with pytest.raises(ConfigError, match="kinds: .*numpy, rtext"):
        loader_for(f"nosuch:{tmp_path}/d")


def test_missing_paths_are_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file '.*nothere.jsonl'"):
        loader_for(f"jsonl:{tmp_path}/nothere.jsonl")
    with pytest.raises(ConfigError, match=r"no files match '.*\*.parquet'"):
        loader_for(f"parquet:{tmp_path}/*.parquet")
    with pytest.raises(ConfigError, match="training.dataset_path"):
        build_train_loader(make_config(**{"training.dataset": "jsonl", "training.dataset_path": f"{tmp_path}/x.jsonl"}),
                           TOK, dp_rank=0, dp_world_size=1)


def test_megatron_inline_weights_and_a_kind_in_a_dataset_path(tmp_path, capsys, monkeypatch):
    """Megatron's ``--data-path 0.3 A 0.7 B`` habit written as data.sources, and KIND:PATH as a dataset path: the
    launcher's pre-flight and trainer data audit take both; a weight anywhere else is one line naming data.weights."""
    from tests.support.token_files import ASSETS
    from trainer.config.reference import main as config_main
    from trainer.data.cli import main as data_main

    monkeypatch.delenv("CONFIG_FILE", raising=False)
    a, b = (ASSETS / "megatron" / f"part{i}_text_document" for i in (0, 1))
    inline = ["--data.sources", f"0.3,megatron:{a},0.7,megatron:{b}"]
    check = ["--check", "--job.dump_folder", str(tmp_path / "out")]
    assert config_main([*check, *inline]) == 0
    assert config_main([*check, "--training.dataset_path", f"megatron:{a}", "--validation.enable", "true",
                        "--validation.dataset_path", f"megatron:{b}"]) == 0
    assert data_main(["audit", "--json", "--sequences", "400", "--training.seq_len", "16", *inline]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sources"] == [f"megatron:{a}", f"megatron:{b}"]
    assert [m["weight"] for m in report["mixture"]] == pytest.approx([0.3, 0.7])
    assert [m["share"] for m in report["mixture"]] == pytest.approx([0.3, 0.7], abs=0.03)
    assert data_main(["audit", "--json", "--training.seq_len", "16", "--training.dataset_path", f"megatron:{a}"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sources"] == [f"megatron:{a}"] and report["separator"] == "as stored"

    for args, words in (
            (["--data.sources", f"megatron:{a},0.7,megatron:{b}"],
             "data.sources[1]: '0.7' is a weight, not a source; give the weights with data.weights"),
            ([*inline, "--data.weights", "1,1"],
             "data.sources[0]: '0.3' is a weight, not a source; data.weights is set"),
            (["--data.sources", f"-1,megatron:{a},1,megatron:{b}"],
             "data.sources[0]: a weight must be a finite number"),
            (["--training.dataset", "numpy", "--training.dataset_path", f"megatron:{a}"],
             f"training.dataset_path 'megatron:{a}' names the kind 'megatron' but training.dataset is 'numpy'; set "
             "training.dataset megatron")):
        assert config_main([*check, *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, (args, err)


def test_the_data_page_gives_the_defaults_of_the_data_keys():
    """docs/data.md lists [data] keys with their defaults ("Keys of [data]"): each must be the key's default."""
    import dataclasses
    import re
    from pathlib import Path

    from trainer.data.config import Data

    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text(encoding="utf-8")
    listed = re.findall(r"`(\w+)` \(([^)]*)\)", text.split("## Keys of `[data]`", 1)[1])
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                for f in dataclasses.fields(Data)}
    assert len(listed) >= 10
    for key, shown in listed:
        value = defaults[key]
        want = "None" if value is None else json.dumps(value)
        assert shown.split(":")[0] == want, (key, shown, want)


# --------------------------------------------------------------------------------------------------
# Bad data
# --------------------------------------------------------------------------------------------------


def write_bad_corpus(path, huge_len=400):
    good = synthetic_texts(5, seed=6, min_len=20, max_len=40)
    lines = [json.dumps({"text": t}).encode() for t in good[:3]]
    lines += [
        b'{"text": "unterminated',  # malformed
        b'{"text": "caf\xe9 latin-1"}',  # not UTF-8: undecodable
        b'{"text": ""}',  # empty
        b"",  # blank line: empty
        b'{"id": 3}',  # no text: malformed
        b"[1, 2]",  # not an object: malformed
        b'{"text": "\\ud800 lone surrogate"}',  # undecodable
        json.dumps({"text": "H" * huge_len}).encode(),  # 400 tokens = 23 windows of 17
    ]
    lines += [json.dumps({"text": t}).encode() for t in good[3:]]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return set(good) | {"H" * huge_len}


def test_bad_documents_are_counted_and_skipped(tmp_path):
    good = write_bad_corpus(tmp_path / "bad.jsonl")
    # Unshuffled, so that the next epoch starts with good documents and the counts are of one pass.
    kw = {"data.num_shards": 1, "data.shuffle": False}
    loader = loader_for(f"jsonl:{tmp_path}/bad.jsonl", **kw, **{"data.long_document_windows": 10})
    batches = one_epoch(loader)
    assert texts_seen(batches) == good  # every good document whole, the huge one included
    s = loader.stats
    assert (s["skipped_malformed"], s["skipped_undecodable"], s["skipped_empty"]) == (3, 2, 2)
    assert s["long_documents"] == 1
    assert s["documents"] >= 6

    cut = loader_for(f"jsonl:{tmp_path}/bad.jsonl", **kw, **{"data.max_document_tokens": 50})
    one_epoch(cut)
    assert cut.stats["truncated_documents"] == 1


def test_unusable_data_raises_instead_of_stalling(tmp_path):
    (tmp_path / "allbad.jsonl").write_bytes(b'{"text": ""}\nnot json\n')
    with pytest.raises(DataError, match="no usable document"):
        next(loader_for(f"jsonl:{tmp_path}/allbad.jsonl", **{"data.num_shards": 1}))
    write_jsonl(tmp_path / "tiny.jsonl", ["one document"])
    with pytest.raises(ConfigError, match="data.num_shards"):  # more shards than documents: at start-up
        loader_for(f"jsonl:{tmp_path}/tiny.jsonl", **{"data.num_shards": 2})


# --------------------------------------------------------------------------------------------------
# Separators
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("separator", ["bos", "eos"])
def test_one_separator_per_boundary_even_if_the_tokenizer_adds_them(tmp_path, separator):
    write_jsonl(tmp_path / "c.jsonl", synthetic_texts(40, seed=7, max_len=50))
    adding = ByteTokenizer(add_bos=True, add_eos=True)
    kw = {"data.separator": separator}
    sep, other = (256, 257) if separator == "bos" else (257, 256)
    batches = one_epoch(loader_for(f"jsonl:{tmp_path}/c.jsonl", tokenizer=adding, **kw))
    for b in batches:
        tokens = torch.cat([b["input"], b["labels"][:, -1:]], 1)
        pos, docs = b["doc_positions"], b["doc_ids"]
        assert not (tokens == other).any()
        is_sep = tokens == sep
        assert not (is_sep[:, 1:] & is_sep[:, :-1]).any()
        if separator == "bos":
            assert torch.equal(is_sep, pos == 0)  # exactly the document starts
        else:
            ends = torch.zeros_like(is_sep)
            ends[:, :-1] = docs[:, 1:] != docs[:, :-1]
            assert (is_sep[:, :-1] == ends[:, :-1]).all()  # exactly the last token before each boundary

    c = make_config(**{"data.sources": [f"jsonl:{tmp_path}/c.jsonl"], "training.seq_len": 16, "data.num_shards": 2, **kw})
    report = audit(c, adding)
    assert report["doubled_separators"] == 0 and report["missing_separators"] == 0
    assert report["separators_per_boundary"] == 1.0
    assert report["stripped_separators"] == 2 * report["documents"] == 80


def test_audit_detects_doubled_separators(tmp_path, monkeypatch):
    """The audit is not blind: without the removal of tokenizer-added separators it reports doubles."""
    import dataclasses

    import trainer.data.audit as audit_module

    write_jsonl(tmp_path / "c.jsonl", synthetic_texts(10, seed=8))
    real = audit_module.build_plan
    monkeypatch.setattr(audit_module, "build_plan", lambda *a, **k: dataclasses.replace(real(*a, **k), strip_ids=()))
    c = make_config(**{"data.sources": [f"jsonl:{tmp_path}/c.jsonl"], "training.seq_len": 16, "data.num_shards": 1})
    report = audit_module.audit(c, ByteTokenizer(add_bos=True, add_eos=False))
    assert report["doubled_separators"] == report["boundaries"] + 1 > 0  # BOS BOS at every document start


# --------------------------------------------------------------------------------------------------
# Pre-tokenized
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_prepared_tokens_give_the_same_sequences(tmp_path, workers):
    write_bad_corpus(tmp_path / "c.jsonl", huge_len=100)
    with open(tmp_path / "c.jsonl", "a") as f:
        for t in synthetic_texts(60, seed=9):
            f.write(json.dumps({"text": t}) + "\n")
    adding = ByteTokenizer(add_eos=True)
    meta = prepare(f"jsonl:{tmp_path}/c.jsonl", tmp_path / "tok", adding, workers=workers, progress=False,
                   piece_bytes=700)  # several pieces, tokenized in parallel
    assert meta["dtype"] == "uint16" and meta["stats"]["skipped_malformed"] == 3
    kw = {"data.num_shards": 4, "data.shuffle_window": 5, "data.num_workers": 0}
    text_loader = loader_for(f"jsonl:{tmp_path}/c.jsonl", tokenizer=adding, **kw)
    token_loader = loader_for(f"tokens:{tmp_path}/tok", tokenizer=adding, **kw)
    for _ in range(120):  # past an epoch: shuffled blocks, file parts and doc ids all agree
        a, b = next(text_loader), next(token_loader)
        for k in a:
            assert torch.equal(a[k], b[k]), k
    sa, sb = text_loader.stats, token_loader.stats
    assert sa["epoch"] >= 1
    for k in ("documents", "tokens", "skipped_malformed", "skipped_undecodable", "skipped_empty", "stripped_separators"):
        assert sa[k] == sb[k], k

    with pytest.raises(ConfigError, match="was prepared with tokenizer"):
        loader_for(f"tokens:{tmp_path}/tok", tokenizer=TOK)
    with pytest.raises(ConfigError, match="already holds"):
        prepare(f"jsonl:{tmp_path}/c.jsonl", tmp_path / "tok", adding, workers=1, progress=False)


def test_prepared_tokens_refuse_a_vocabulary_differing_in_two_ids(tmp_path):
    """Two tokenizer.json files alike but for two ids swapped (same size, same specials, the same probe
    encoding): data prepared with one is refused with the other, in one line naming both."""
    from tokenizer import DEBUG_TOKENIZER_PATH, build_tokenizer
    from trainer.data.loader import tokenizer_fingerprint

    original = build_tokenizer(DEBUG_TOKENIZER_PATH)
    before = tokenizer_fingerprint(original)
    swapped_dir = tmp_path / "swapped"
    swapped_dir.mkdir()
    for extra in DEBUG_TOKENIZER_PATH.parent.iterdir():
        if extra.name != "tokenizer.json":
            (swapped_dir / extra.name).write_bytes(extra.read_bytes())
    ranked = sorted(json.loads(DEBUG_TOKENIZER_PATH.read_text())["model"]["vocab"].items(), key=lambda kv: -kv[1])
    for (a, _), (b, _) in zip(ranked, ranked[1:]):  # the last merges first: rare tokens the probe avoids
        data = json.loads(DEBUG_TOKENIZER_PATH.read_text())
        vocab = data["model"]["vocab"]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (swapped_dir / "tokenizer.json").write_text(json.dumps(data))
        swapped = build_tokenizer(swapped_dir)
        after = tokenizer_fingerprint(swapped)
        if [k for k in before if before[k] != after[k]] == ["vocabulary", "path"]:
            break  # only the vocabulary hash tells them apart
    else:
        raise AssertionError("no pair of ids leaves the probe alone")

    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in synthetic_texts(20, seed=3)))
    prepare(f"jsonl:{tmp_path}/c.jsonl", tmp_path / "tok", original, workers=1, progress=False)
    loader_for(f"tokens:{tmp_path}/tok", tokenizer=original, **{"data.num_shards": 2})  # the same one: fine
    with pytest.raises(ConfigError) as e:
        loader_for(f"tokens:{tmp_path}/tok", tokenizer=swapped, **{"data.num_shards": 2})
    line = str(e.value)
    assert "\n" not in line and "vocabulary" in line, line
    assert str(DEBUG_TOKENIZER_PATH) in line and str(swapped_dir) in line, line
