"""Token files other trainers write (Megatron .bin/.idx, OLMo numpy arrays, fms-fsdp Arrow), written by the real
writers (megatron-core's IndexedDatasetBuilder, numpy, pyarrow's RecordBatchFileWriter): the same documents give
the same batches and the same losses in every format; exact resumption; every damaged input is one line with the
data exit code."""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.data import make_config
from tests.support.launch import read_metrics, train_in_process
from tests.support.token_files import (
    documents, write_all, write_arrow, write_megatron, write_mmidx, write_numpy,
)
from trainer.data.cli import main as data_main
from trainer.data.loader import build_train_loader, merge_states
from trainer.data.sources import parse_source
from trainer.errors import ConfigError, DataError

DOCS = documents(240, seed=3)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizer import DEBUG_TOKENIZER_PATH, build_tokenizer

    return build_tokenizer(DEBUG_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict[str, Path]:
    """The same 240 documents in two files per format, plus variants of each format."""
    root = tmp_path_factory.mktemp("token_files")
    paths = write_all(root, DOCS)
    halves = np.array_split(np.arange(len(DOCS)), 2)
    for name, writer in (("numpy_header", lambda p, d: write_numpy(p.with_suffix(".npy"), d, header=True)),
                         ("numpy_sidecar", lambda p, d: write_numpy(p.with_suffix(".npy"), d, sidecar=True)),
                         ("arrow_rows", lambda p, d: write_arrow(p.with_suffix(".arrow"), d, per_batch=False)),
                         ("arrow_stream", lambda p, d: write_arrow(p.with_suffix(".arrow"), d, stream=True))):
        (root / name).mkdir()
        for i, idx in enumerate(halves):
            writer(root / name / f"part{i}", [DOCS[j] for j in idx])
        paths[name] = root / name
    return paths


def kind_of(name: str) -> str:
    return name.split("_")[0]


def loader(path, kind, tokenizer, rank=0, world=1, **extra):
    config = make_config(**{"training.dataset": kind, "training.dataset_path": str(path), "training.seq_len": 32,
                            "training.local_batch_size": 4 // world, "training.global_batch_size": 4,
                            "data.num_shards": 4, "data.debug_doc_ids": True, **extra})
    return build_train_loader(config, tokenizer, dp_rank=rank, dp_world_size=world)


def draw(ld, n: int) -> list[dict]:
    out = [{k: v.clone() for k, v in next(ld).items()} for _ in range(n)]
    return out


def test_the_same_documents_give_the_same_batches_in_every_format(formats, tokenizer):
    reference = None
    for name, path in formats.items():
        ld = loader(path, kind_of(name), tokenizer)
        batches = draw(ld, 12)
        stats = ld.stats
        ld.close()
        assert stats["documents_without_eos"] == 0 and stats["skipped_empty"] == 0, name
        if reference is None:
            reference = batches
            # Trained as stored: each document's own tokens, its EOS included, and nothing added.
            flat = torch.cat([b["input"].flatten() for b in batches])
            assert (flat == tokenizer.bos_id).sum() == 0
            continue
        for a, b in zip(reference, batches):
            assert torch.equal(a["input"], b["input"]) and torch.equal(a["doc_ids"], b["doc_ids"]), name


@pytest.mark.parametrize("name", ["megatron", "numpy_sidecar", "arrow", "arrow_rows"])
def test_packing_whole_blocks_matches_reading_document_by_document(formats, tokenizer, monkeypatch, name):
    """The loader packs runs of checked token-file documents at once (the rest of a block, DocumentReader.take_block);
    reading every document as a run of its own (no block layout) instead gives the same batches and the same states
    (positions, counters) after every micro-batch. Short windows and long ones (documents of ~100 tokens)."""
    from trainer.data import pipeline

    for seq_len in (32, 400):
        extra = {"training.seq_len": seq_len, "data.document_positions": True, "data.shuffle_window": 50}
        runs = []
        for whole_blocks in (True, False):
            if not whole_blocks:
                monkeypatch.setattr(pipeline, "block_layout", lambda *a, **k: None)
            ld = loader(formats[name], kind_of(name), tokenizer, **extra)
            got = []
            for _ in range(14):
                batch = next(ld)
                got.append(({k: v.clone() for k, v in batch.items()}, batch.fingerprint, ld.state_dict()))
            ld.close()
            runs.append(got)
            monkeypatch.undo()
        for (a, fa, sa), (b, fb, sb) in zip(*runs):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, seq_len)
            assert fa == fb and sa == sb, (name, seq_len)


def test_documents_are_read_as_stored(formats, tokenizer):
    config = make_config(**{"data.num_shards": 1, "data.shuffle": False, "training.seq_len": 32})
    from trainer.data.loader import build_plan

    for name, path in formats.items():
        spec = parse_source(f"{kind_of(name)}:{path}", key="test")
        plan = build_plan(config, tokenizer, [spec], [1.0], num_shards=1, shuffle=False, max_epochs=1)
        src = plan.sources[0]
        got = []
        for unit in range(len(src.units)):
            lo, hi = src.part(unit, 0, 1)
            for coord, nxt, payload in src.iter_docs(unit, lo, hi, lo, shard=0, num_shards=1, epoch=0):
                got.append(np.asarray(src.decode(src.load(unit, coord, nxt, payload))[1], dtype=np.int64))
        assert len(got) == len(DOCS) and all(np.array_equal(a, b) for a, b in zip(got, DOCS)), name


def test_exact_resume_and_another_data_parallel_degree(formats, tokenizer):
    path = formats["megatron"]
    straight = draw(loader(path, "megatron", tokenizer), 8)
    first = loader(path, "megatron", tokenizer)
    draw(first, 3)
    again = loader(path, "megatron", tokenizer)
    again.load_state_dict(first.state_dict())
    assert all(torch.equal(a["input"], b["input"]) for a, b in zip(straight[3:], draw(again, 5)))
    # Two ranks (2 sequences each) for 3 steps, then one rank: the same global batches.
    ranks = [loader(formats["numpy"], "numpy", tokenizer, rank=r, world=2) for r in range(2)]
    for _ in range(3):
        for ld in ranks:
            next(ld)
    one = loader(formats["numpy"], "numpy", tokenizer)
    one.load_state_dict(merge_states([ld.state_dict() for ld in ranks]))
    rest = draw(one, 5)
    for a, b in zip(straight[3:], rest):
        assert sorted(map(tuple, a["input"].tolist())) == sorted(map(tuple, b["input"].tolist()))


def test_a_mixture_of_two_formats_follows_the_weights(formats, tokenizer):
    config = make_config(**{"data.sources": [f"megatron:{formats['megatron']}", f"arrow:{formats['arrow']}"],
                            "data.weights": [3, 1], "training.seq_len": 16, "training.local_batch_size": 8,
                            "data.num_shards": 4})
    ld = build_train_loader(config, tokenizer, dp_rank=0, dp_world_size=1)
    for _ in range(40):
        next(ld)
    shares = [s["share"] for s in ld.stats["sources"]]
    ld.close()
    assert abs(shares[0] - 0.75) < 0.02 and abs(shares[1] - 0.25) < 0.02, shares


def test_documents_without_eos_are_counted_and_append_eos_adds_it(tmp_path, tokenizer):
    docs = [d[:-1] for d in DOCS[:40]]  # fms-fsdp stores documents without the delimiter
    write_arrow(tmp_path / "a.arrow", docs)
    ld = loader(tmp_path / "a.arrow", "arrow", tokenizer, **{"data.num_shards": 1})
    batch = next(ld)
    assert ld.stats["documents_without_eos"] > 0 and (batch["input"] == tokenizer.eos_id).sum() == 0
    ld.close()
    ld = loader(tmp_path / "a.arrow", "arrow", tokenizer, **{"data.num_shards": 1, "data.append_eos": True})
    batch = next(ld)
    assert (batch["input"] == tokenizer.eos_id).sum() > 0
    ld.close()


def test_numpy_dtype_against_an_npy_header_is_said(formats, tokenizer, caplog):
    """A header names its file's type: data.numpy_dtype set to another is not used for it, and the run says so."""
    with caplog.at_level(logging.WARNING, logger="trainer.data.readers"):
        same = loader(formats["numpy_header"], "numpy", tokenizer, **{"data.numpy_dtype": "uint16"})
        assert not caplog.records
        other = loader(formats["numpy_header"], "numpy", tokenizer, **{"data.numpy_dtype": "uint32"})
    assert [r.getMessage() for r in caplog.records] == [
        f"training.dataset_path: data.numpy_dtype = uint32 is for raw files; 2 file(s) have an NPY header of "
        f"another type and are read as it says (e.g. {formats['numpy_header'] / 'part0.npy'}: uint16)"]
    assert torch.equal(next(same)["input"], next(other)["input"])
    same.close()
    other.close()


def test_a_separator_set_for_token_files_is_said_to_add_nothing(formats, tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="trainer.data.loader"):
        plain = loader(formats["megatron"], "megatron", tokenizer)
        assert "adds nothing" not in caplog.text
        bos = loader(formats["megatron"], "megatron", tokenizer, **{"data.separator": "bos"})
    assert "data.separator = bos adds nothing to these token files" in caplog.text
    assert torch.equal(next(plain)["input"], next(bos)["input"])  # (trained as stored either way)
    plain.close()
    bos.close()


def test_kinds_are_inferred_and_a_folder_of_mixed_kinds_is_refused(formats, tmp_path):
    prefix = formats["megatron"] / "part0_text_document"
    assert parse_source(str(prefix), key="k").kind == "megatron"
    assert parse_source(f"{prefix}.idx", key="k").kind == "megatron"
    assert parse_source(str(formats["numpy"] / "part0.npy"), key="k").kind == "numpy"
    assert parse_source(str(formats["numpy"]), key="k").kind == "numpy"
    mixed = tmp_path / "mixed"
    shutil.copytree(formats["numpy"], mixed)
    shutil.copy(formats["arrow"] / "part0.arrow", mixed)
    with pytest.raises(ConfigError, match="several kinds"):
        parse_source(str(mixed), key="k")


def test_inspect_reports_documents_lengths_ids_and_separators(formats, capsys):
    assert data_main(["inspect", "--json", "--source", f"megatron:{formats['megatron']}",
                      "--source", f"arrow:{formats['arrow_rows']}"]) == 0
    import json

    reports = json.loads(capsys.readouterr().out)
    want_tokens = sum(len(d) for d in DOCS)
    for r in reports:
        assert r["documents"] == len(DOCS) and r["tokens"] == want_tokens
        assert r["largest_id"] == max(int(d.max()) for d in DOCS) and r["documents_without_eos"] == 0
        assert sum(r["length_histogram"].values()) == len(DOCS)


def _damaged(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name -> (source spec, what the one line must say)."""
    docs = DOCS[:20]
    cases = {}

    def mega(name, **kw):
        prefix = str(tmp_path / name)
        write_mmidx(prefix, docs, **kw)
        return prefix

    cases["bad magic"] = (f"megatron:{mega('magic', magic=b'NOTMMIDX!')}", "not a Megatron index")
    cases["bad version"] = (f"megatron:{mega('version', version=2)}", "version 2")
    p = mega("truncated")
    os.truncate(p + ".bin", os.path.getsize(p + ".bin") - 10)
    cases["truncated bin"] = (f"megatron:{p}", "the .bin is truncated")
    p = mega("nobin")
    os.remove(p + ".bin")
    cases["idx without bin"] = (f"megatron:{p}", "nobin.bin is missing")
    p = mega("noidx")
    os.remove(p + ".idx")
    cases["bin without idx"] = (f"megatron:{p}.bin", "noidx.idx is missing")
    big = [d.copy() for d in docs]
    big[7][2] = 5000
    cases["id beyond vocabulary"] = (f"numpy:{write_numpy(tmp_path / 'big.npy', big)}",
                                     "big.npy: document 7 holds token id 5000")
    cases["dtype too small"] = (f"megatron:{mega('small', dtype=np.uint8)}", "cannot hold the tokenizer's 2048 ids")
    (tmp_path / "empty.npy").write_bytes(b"")
    cases["empty numpy"] = (f"numpy:{tmp_path / 'empty.npy'}", "empty file")
    cases["empty megatron"] = (f"megatron:{_empty_megatron(tmp_path)}", "holds no documents")
    (tmp_path / "odd.npy").write_bytes(b"\x01\x02\x03")
    cases["partial token"] = (f"numpy:{tmp_path / 'odd.npy'}", "not a whole number of uint16 tokens")
    return cases


def _empty_megatron(tmp_path: Path) -> str:
    prefix = str(tmp_path / "emptymega")
    write_mmidx(prefix, [])
    return prefix


def test_every_damaged_input_is_one_line_with_the_data_exit_code(tmp_path, capsys):
    for name, (spec, words) in _damaged(tmp_path).items():
        rc = data_main(["inspect", "--source", spec])
        err = capsys.readouterr().err
        assert rc == 4, (name, err)
        assert words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (name, err)


def test_a_damaged_file_stops_training_with_exit_code_4(tmp_path, monkeypatch):
    big = [d.copy() for d in DOCS[:30]]
    big[4][1] = 9999
    path = write_megatron(tmp_path / "ids_text_document", big)
    rc, log = train_in_process(tmp_path / "out", "--training.steps", "2", "--data.num_shards", "1",
                               "--data.shuffle", "false", "--training.dataset", "megatron",
                               "--training.dataset_path", str(path), monkeypatch=monkeypatch)
    assert rc == 4 and "document 4 holds token id 9999" in log and "Traceback" not in log, log[-3000:]


def test_an_index_without_its_bin_stops_training_with_exit_code_4(tmp_path, monkeypatch):
    """Refused where the worker opens its sources (the launcher's pre-flight checks keys, not files); the
    launcher passes a worker's one line and exit code on (tests/e2e/test_launcher_errors.py)."""
    from tests.support.token_files import ASSETS

    shutil.copy(ASSETS / "megatron" / "part0_text_document.idx", tmp_path / "lonely.idx")
    rc, log = train_in_process(tmp_path / "out", "--training.steps", "2", "--data.sources",
                               f"megatron:{tmp_path / 'lonely'}", monkeypatch=monkeypatch)
    assert rc == 4 and "lonely.bin is missing" in log and "Traceback" not in log, log[-3000:]


def test_a_bad_id_is_named_by_the_loader_in_every_format(tmp_path, tokenizer):
    """Blocks are checked at once; a bad id makes the loader check document by document and name it."""
    big = [d.copy() for d in DOCS[:30]]
    big[4][1] = 9999
    for kind, path in write_all(tmp_path, big).items():
        ld = loader(path, kind, tokenizer, **{"data.num_shards": 1, "data.shuffle": False})
        with pytest.raises(DataError, match="document 4 holds token id 9999"):
            draw(ld, 10)
        ld.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_after_an_error_mid_batch_the_state_is_the_last_one_known(tmp_path, tokenizer, prefetch):
    """A loader reading in its own thread takes its state from its live streams: after an error in the middle
    of a micro-batch it says its position is unknown (rather than give one past the batches trained on); one
    that carries states with its batches keeps the last good one. Either way close() does not raise."""
    from trainer.errors import DataStateError

    big = [d.copy() for d in DOCS[:40]]
    big[30][1] = 9999
    path = write_all(tmp_path, big)["megatron"]
    ld = loader(path, "megatron", tokenizer, **{"data.num_shards": 1, "data.shuffle": False,
                                                "data.prefetch_batches": prefetch})
    good = []
    with pytest.raises(DataError, match="document 10 holds token id 9999"):  # (document 10 of the second file)
        for _ in range(40):
            next(ld)
            good.append(ld.state_dict())
    if prefetch:
        assert ld.state_dict() == good[-1]
    else:
        with pytest.raises(DataStateError, match="position is not known"):
            ld.state_dict()
    ld.close()
    if not prefetch:
        with pytest.raises(DataStateError):
            next(ld)
    ld.load_state_dict(good[-1])  # a known state makes it usable again
    assert ld.state_dict() == good[-1]
    ld.close()


RUN = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--data.num_shards", "4",
       "--debug.deterministic", "--lr_scheduler.decay_type", "constant"]


@pytest.fixture(scope="module")
def losses(formats, tmp_path_factory, mp) -> dict[str, dict[int, float]]:
    """10 steps straight on numpy and on arrow; megatron stopped after 5 steps and resumed to 10 (four runs:
    the straight runs are the reference of the resumed one)."""
    out = {}
    root = tmp_path_factory.mktemp("runs")
    before = set(prefetch_threads())
    for name in ("numpy", "arrow"):
        rc, log = train_in_process(root / name, "--training.steps", "10", *RUN, "--training.dataset", name,
                                   "--training.dataset_path", str(formats[name]), monkeypatch=mp)
        assert rc == 0, log[-3000:]
        out[name] = {r["step"]: r["loss"] for r in read_metrics(root / name)}
        # (right after the run, before anything collects garbage)
        out.setdefault("prefetch_threads_left", []).extend(t.name for t in prefetch_threads() if t not in before)
    for steps in (5, 10):
        rc, log = train_in_process(root / "megatron", "--training.steps", str(steps), *RUN, "--checkpoint.enable",
                                   "--checkpoint.interval", "5", "--checkpoint.last_save_model_only", "false",
                                   "--training.dataset", "megatron", "--training.dataset_path",
                                   str(formats["megatron"]), monkeypatch=mp)
        assert rc == 0, log[-3000:]
    records = read_metrics(root / "megatron")
    out["megatron"] = {r["step"]: r["loss"] for r in records}
    out["megatron_steps"] = [r["step"] for r in records]
    return out


def prefetch_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "batch-prefetch" and t.is_alive()]


def test_an_in_process_run_leaves_no_prefetch_thread(losses):
    """The training loop closes its loader at the end of a run: its batch-prefetch thread (data.prefetch_batches
    is 2 in these runs) has ended when main() returns."""
    assert losses["prefetch_threads_left"] == []


def test_three_formats_give_bitwise_equal_losses_for_ten_steps(losses):
    assert sorted(losses["numpy"]) == list(range(1, 11))
    assert losses["numpy"] == losses["arrow"]
    # Megatron's steps 1-5 come from a straight run, 6-10 from the resumed one (test below).
    assert {s: v for s, v in losses["megatron"].items() if s <= 5} == {s: losses["numpy"][s] for s in range(1, 6)}


def test_train_stop_resume_is_bitwise(losses):
    # Each step logged once: the second run continued at step 6 rather than starting over.
    assert losses["megatron_steps"] == list(range(1, 11))
    assert losses["megatron"] == losses["numpy"]


def test_megatron_fixture_is_the_real_builder_or_the_same_bytes(tmp_path):
    """Where megatron-core is installed the fixtures come from its builder; the hand-written MMIDIDX writer
    (damaged variants) must produce the same bytes."""
    from tests.support.token_files import HAVE_MEGATRON

    if not HAVE_MEGATRON:  # (importorskip would import megatron.core's __init__: seconds of model-parallel layers)
        pytest.skip("megatron-core is not installed")
    write_megatron(tmp_path / "real", DOCS[:30])
    write_mmidx(str(tmp_path / "mine"), DOCS[:30])
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"real{suffix}").read_bytes() == (tmp_path / f"mine{suffix}").read_bytes()


def test_sidecar_out_of_bounds_is_a_data_error(tmp_path, tokenizer):
    path = write_numpy(tmp_path / "x.npy", DOCS[:10])
    with gzip.open(tmp_path / "x.csv.gz", "wt") as f:
        f.write("0,5\n5,999999\n")
    with pytest.raises(DataError, match="sidecar belongs to another file"):
        ld = loader(path, "numpy", tokenizer, **{"data.num_shards": 1})
        next(ld)


def test_the_committed_assets_are_what_the_writers_write(tmp_path):
    """tests/assets/token_files (read by the multi-process and launcher runs) is the writers' output for
    asset_documents(): regenerate with ``python -m tests.support.token_files`` when the writers change."""
    from tests.support.token_files import ASSETS, write_assets

    fresh = write_assets(tmp_path)
    for kind, folder in fresh.items():
        names = sorted(p.name for p in folder.iterdir())
        assert names == sorted(p.name for p in (ASSETS / kind).iterdir()), kind
        for name in names:
            assert (folder / name).read_bytes() == (ASSETS / kind / name).read_bytes(), (kind, name)


def test_across_epoch_boundaries_the_formats_stay_equal(tmp_path, tokenizer):
    """24 short documents, 4 shards: 30 micro-batches wrap every shard's epoch several times."""
    paths = write_all(tmp_path, DOCS[:24])
    runs = {}
    for kind, path in paths.items():
        ld = loader(path, kind, tokenizer)
        runs[kind] = draw(ld, 30)
        assert ld.stats["epoch"] >= 2, kind
        ld.close()
    for a, b, c in zip(runs["megatron"], runs["numpy"], runs["arrow"]):
        assert torch.equal(a["input"], b["input"]) and torch.equal(a["input"], c["input"])


def test_audit_walks_token_files(formats, capsys):
    import json

    assert data_main(["audit", "--json", "--training.dataset", "numpy", "--training.dataset_path",
                      str(formats["numpy_sidecar"]), "--training.seq_len", "32", "--data.num_shards", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["documents"] == len(DOCS) and report["tokens"] == sum(len(d) for d in DOCS)
    assert report["separator"] == "as stored" and report["documents_without_eos"] == 0
    assert report["separators_per_boundary"] == 1.0 and report["doubled_separators"] == 0


def test_null_rows_are_skipped_and_counted(tmp_path, tokenizer):
    import pyarrow as pa

    rows = [list(map(int, d)) for d in DOCS[:30]]
    rows[3] = None
    schema = pa.schema([("tokens", pa.list_(pa.int32()))])
    with pa.OSFile(str(tmp_path / "n.arrow"), "wb") as sink, pa.ipc.RecordBatchFileWriter(sink, schema) as w:
        w.write_batch(pa.record_batch([pa.array(rows, type=pa.list_(pa.int32()))], schema=schema))
    ld = loader(tmp_path / "n.arrow", "arrow", tokenizer, **{"data.num_shards": 1})
    draw(ld, 12)
    stats = ld.stats
    ld.close()
    assert stats["skipped_malformed"] >= 1 and stats["last_skipped"]["at"] == 3


def test_token_files_as_the_validation_source(formats, tokenizer):
    from trainer.data.loader import build_val_loader

    config = make_config(**{"validation.enable": True, "validation.dataset": "megatron",
                            "validation.dataset_path": str(formats["megatron"] / "part1_text_document"),
                            "training.seq_len": 32, "validation.local_batch_size": 4})
    batches = list(build_val_loader(config, tokenizer, dp_rank=0, dp_world_size=1))
    half = sum(len(d) for d in DOCS[len(DOCS) // 2:])
    assert len(batches) == (half // 33) // 4
    assert batches[0]["input"][0].tolist() == np.concatenate(DOCS[len(DOCS) // 2:])[:32].tolist()


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_raw_file_at_the_other_width_is_refused_naming_numpy_dtype(formats, tmp_path, tokenizer, capsys,
                                                                     monkeypatch):
    """Headerless files written by numpy in both widths, for a 16-bit vocabulary: read at the other width, every
    reader of them (training, inspect, audit) stops in the same line naming data.numpy_dtype; read at their own
    width, both give the same batches."""
    wide = write_numpy(tmp_path / "wide.npy", DOCS, np.uint32)
    narrow = write_numpy(tmp_path / "narrow.npy", DOCS, np.uint16)
    lines = {}
    for tool in (["inspect", "--source", f"numpy:{wide}"],
                 ["audit", "--training.dataset", "numpy", "--training.dataset_path", str(wide)]):
        assert data_main(tool) == 4
        lines[tool[0]] = _one_line(capsys)
    assert lines["inspect"] == lines["audit"] == (
        f"data error: {wide}: looks like uint32 tokens, read here as uint16 (100% of its odd uint16 values are 0); "
        "set data.numpy_dtype = uint32 (a raw file carries no type)")
    rc, log = train_in_process(tmp_path / "out", "--training.steps", "1", "--training.dataset", "numpy",
                               "--training.dataset_path", str(wide), monkeypatch=monkeypatch)
    assert rc == 4 and lines["inspect"].split(": ", 1)[1] in log and "Traceback" not in log, log[-3000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # stopped before training a step

    # (an odd count of uint16 is not a whole number of uint32: then one more document, its EOS alone)
    even = DOCS if sum(map(len, DOCS)) % 2 == 0 else [*DOCS, DOCS[0][-1:]]
    narrow_even = write_numpy(tmp_path / "narrow_even.npy", even, np.uint16)
    assert data_main(["inspect", "--source", f"numpy:{narrow_even}", "--data.numpy_dtype", "uint32"]) == 4
    assert "looks like uint16 tokens, read here as uint32" in _one_line(capsys)

    as_wide = loader(wide, "numpy", tokenizer, **{"data.numpy_dtype": "uint32"})
    as_narrow = loader(narrow, "numpy", tokenizer)
    for a, b in zip(draw(as_wide, 6), draw(as_narrow, 6)):
        assert torch.equal(a["input"], b["input"]) and torch.equal(a["doc_ids"], b["doc_ids"])
    as_wide.close()
    as_narrow.close()


def test_an_explicit_kind_on_half_of_a_megatron_pair_is_refused_naming_megatron(tmp_path, capsys, monkeypatch):
    """numpy:A_text_document.bin would train the .bin as flat tokens without the .idx's documents: refused in one
    line naming megatron:, by the launcher's checks and by every reader (a glob, another kind, the bare prefix)."""
    prefix = str(write_megatron(tmp_path / "A_text_document", DOCS[:40]))
    rc, log = train_in_process(tmp_path / "out", "--training.steps", "1", "--data.sources",
                               f"numpy:{prefix}.bin", monkeypatch=monkeypatch)
    assert rc == 2 and "Traceback" not in log, log[-3000:]
    assert (f"data.sources[0]: {prefix}.bin is half of a Megatron .bin/.idx pair, which the numpy kind would read "
            f"without the .idx's document boundaries; write megatron:{prefix}") in log
    for spec, words in ((f"numpy:{prefix}.bin", f"write megatron:{prefix}"),
                        (f"text:{tmp_path}/A*", f"{prefix}.bin is half of a Megatron .bin/.idx pair"),
                        (f"numpy:{prefix}", f"it is the prefix of a Megatron .idx/.bin pair: write megatron:{prefix}")):
        tool = ["inspect", "--source", spec] if spec.startswith("numpy") else ["audit", "--data.sources", spec]
        assert data_main(tool) == 2, spec
        assert words in _one_line(capsys), spec
    assert data_main(["inspect", "--json", "--source", f"megatron:{prefix}.bin"]) == 0  # the right kind reads it
    capsys.readouterr()


def test_audit_exits_4_when_token_files_do_not_give_one_separator_per_boundary(tmp_path, capsys):
    """Documents stored without EOS (0 per boundary) and with BOS and EOS (2 per boundary): the report, then one
    line with the reason and the data exit code; data.append_eos makes the first one pass."""
    no_eos = write_arrow(tmp_path / "no_eos.arrow", [d[:-1] for d in DOCS[:60]])
    both = write_numpy(tmp_path / "both.npy", [np.concatenate([[0], d]) for d in DOCS[:60]])
    common = ["audit", "--json", "--training.seq_len", "32", "--data.num_shards", "2"]
    assert data_main([*common, "--data.sources", f"arrow:{no_eos}"]) == 4
    out, err = capsys.readouterr()
    assert json.loads(out)["missing_separators"] > 0 and len(err.strip().splitlines()) == 1
    assert "0.0000 separators per document boundary, not 1" in err and "set data.append_eos = true" in err
    assert data_main([*common, "--data.sources", f"arrow:{no_eos}", "--data.append_eos", "true"]) == 0
    assert json.loads(capsys.readouterr().out)["separators_per_boundary"] == 1.0
    assert data_main([*common, "--data.sources", f"numpy:{both}"]) == 4
    err = _one_line(capsys)
    assert "2.0000 separators per document boundary, not 1" in err and "hold a separator at both ends" in err


MEGATRON_PREFIX = "tests/assets/token_files/megatron/part0_text_document"  # relative, as a user would write it
MEGATRON_ARGS = ("--training.seq_len", "32", "--training.local_batch_size", "2", "--data.num_shards", "2",
                 "--checkpoint.enable", "true", "--training.dataset", "megatron", "--training.dataset_path",
                 MEGATRON_PREFIX)


def test_train_stop_and_resume_on_a_megatron_prefix(tmp_path, monkeypatch):
    """A Megatron dataset named by its relative path prefix (as in Megatron's --data-path), from the repository
    root as a user runs it: two steps, then the same folder continued to four, give the losses of four steps
    straight, bit for bit."""
    from tests.support.launch import ROOT

    monkeypatch.chdir(ROOT)
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    for dump, steps in ((straight, 4), (stopped, 2), (stopped, 4)):
        rc, out = train_in_process(dump, *MEGATRON_ARGS, "--training.steps", str(steps), monkeypatch=monkeypatch)
        assert rc == 0, out[-3000:]
    assert "step-2 loaded" in out
    records = read_metrics(stopped)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["tokens_seen"] == 4 * 2 * 32
    want = {r["step"]: (r["loss"], r["data_fingerprint"]) for r in read_metrics(straight)}
    assert {r["step"]: (r["loss"], r["data_fingerprint"]) for r in records} == want
