"""Docs that quote a command's output say what the command prints today: each quoted block is run in-process
and compared, so a change that moves a number fails until the page follows.

A quoted block is a fenced block right after the line ``<!-- output checked by tests/unit/test_docs_output.py -->``;
its first line is ``$ trainer COMMAND ...`` (run from the repository root), the rest the output. Every other
line must be a line of the output, in order; a line ``...`` stands for any number of lines.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.support.launch import ROOT

MARKER = "<!-- output checked by tests/unit/test_docs_output.py -->"
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def quoted_blocks() -> list[tuple[str, list[str]]]:
    """(where, lines) of every checked block: the command line first."""
    blocks = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARKER:
                continue
            assert lines[i + 1].startswith("```"), f"{page.name}:{i + 1}: the marker must precede a fenced block"
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            blocks.append((f"{page.name}:{i + 1}", lines[i + 2:end]))
    return blocks


def missing_lines(quoted: list[str], output: list[str]) -> list[str]:
    """The quoted lines not found in the output in order (``...`` skips any number of output lines; other
    lines must follow the previous one directly)."""
    output = [line.rstrip() for line in output]
    at, skipping, missing = 0, True, []
    for line in quoted:
        if line.strip() == "...":
            skipping = True
            continue
        line = line.rstrip()
        if skipping:
            found = next((k for k in range(at, len(output)) if output[k] == line), None)
        else:
            found = at if at < len(output) and output[at] == line else None
        if found is None:
            missing.append(line)
            continue
        at, skipping = found + 1, False
    return missing


def test_the_matching_is_strict():
    out = ["a", "b", "c", "d"]
    assert missing_lines(["a", "b", "...", "d"], out) == []
    assert missing_lines(["b", "c"], out) == []  # a block may start anywhere
    assert missing_lines(["a", "c"], out) == ["c"]  # not directly after "a"
    assert missing_lines(["a", "...", "x"], out) == ["x"]
    assert missing_lines(["c", "...", "b"], out) == ["b"]  # order matters


BLOCKS = quoted_blocks()


def test_the_pages_quote_checked_output():
    assert any(lines[0].startswith("$ trainer plan ") for _, lines in BLOCKS), "performance.md's example went"


@pytest.mark.parametrize("where, lines", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_quoted_output_is_what_the_command_prints(where, lines, capsys, monkeypatch):
    from trainer.cli import main

    assert lines and lines[0].startswith("$ trainer "), f"{where}: the block must start with '$ trainer ...'"
    argv = shlex.split(lines[0][2:])[1:]
    monkeypatch.chdir(ROOT)  # the commands' paths are relative to the repository
    assert main(argv) == 0, where
    output = capsys.readouterr().out.splitlines()
    missing = missing_lines(lines[1:], output)
    assert not missing, f"{where}: {lines[0]} no longer prints these lines:\n" + "\n".join(missing) + \
        "\n\nit prints:\n" + "\n".join(output)


def _simulation_table() -> tuple[list[list[str]], list[list[str]]]:
    """performance.md's table of simulated presets (its rows' cells) and the commands that reproduce it."""
    text = (ROOT / "docs" / "performance.md").read_text()
    section = text[text.index("### The presets on"):text.index("### What the simulation showed")]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| llama3_")]
    block = section[section.index("Reproduce"):]
    block = block[block.index("```") + 3:]
    commands = [shlex.split(line) for line in block[:block.index("```")].splitlines() if line.strip()]
    return rows, commands


def test_the_simulation_tables_plan_column_is_what_trainer_plan_gives(capsys, monkeypatch):
    """The `plan` column (GiB, and its difference to the simulated peak) of each row is `trainer plan`'s
    estimate for that row's command (the same arguments as its `trainer simulate` line)."""
    from trainer.tools.plan.cli import main

    rows, commands = _simulation_table()
    assert len(rows) == len(commands) == 6
    monkeypatch.chdir(ROOT)
    for row, command in zip(rows, commands):
        assert command[:2] == ["trainer", "simulate"], command
        assert main([*command[2:], "--json", "-"]) == 0
        total = json.loads(capsys.readouterr().out)["configured"]["estimate_gib"]["total"]
        simulated = float(row[3])
        plan, percent = re.fullmatch(r"([\d.]+) \(([-+]\d+\.\d) %\)", row[4]).groups()
        assert float(plan) == round(total, 1), (row, total)
        # The difference is the simulated peak's to the plan's; both are rounded on the page.
        assert abs(float(percent) - 100 * (simulated / total - 1)) <= 0.2, (row, total)
