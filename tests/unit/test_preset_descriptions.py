"""The presets' descriptions (job.description, written to summary.json and shown at the top of each file)
say what the preset trains, in words."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

PRESETS = sorted((Path(__file__).resolve().parents[2] / "train_configs").glob("*.toml"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_description_names_the_model_in_words(path):
    text = path.read_text()
    description = tomllib.loads(text)["job"]["description"]
    assert len(description.split()) >= 4, description  # a sentence, not an identifier
    flavor = tomllib.loads(text)["model"]["flavor"]
    if flavor != "debug_gqa":
        size = re.search(r"_(\d+)b", flavor).group(1)
        assert f"{size}B" in description, (flavor, description)  # the size the flavor names
