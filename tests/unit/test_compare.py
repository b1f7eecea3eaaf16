"""trainer compare: runs (metrics.jsonl, TensorBoard) and reference CSVs aligned on tokens; table, PNG, and
messages for bad input."""

from __future__ import annotations

import csv
import json
import math

import pytest

from torchtitan_ext.compare import load_reference, load_run, main as compare_main, smooth

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(folder, offset: float, tokens_per_step: int = 1000, steps=range(10, 201, 10), extra=()):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step in steps:
            tokens = step * tokens_per_step
            f.write(json.dumps({"step": step, "loss": expected_loss(tokens, offset), "tokens_seen": tokens,
                                "lr": 1e-3}) + "\n")
        for line in extra:
            f.write(line + "\n")
    return folder


def expected_loss(tokens, offset):
    return 3.0 + 5.0 * math.exp(-tokens / 50_000) + offset


def test_compare_two_runs_and_a_reference(tmp_path, capsys):
    a = write_run(tmp_path / "run_a", 0.0)
    b = write_run(tmp_path / "run_b", 0.1, tokens_per_step=500, steps=range(20, 401, 20))  # other batch size
    ref = tmp_path / "ref.csv"
    ref.write_text("# recorded elsewhere (test data)\ntokens,loss\n10000,7.0\n100000,4.0\n200000,3.2\n")
    out = tmp_path / "plots" / "compare.png"
    table = tmp_path / "table.csv"
    rc = compare_main([str(a), f"B={b}", "--reference", f"paper={ref}", "--output", str(out),
                       "--at", "20000,50000,100000,150000", "--table", str(table)])
    assert rc == 0
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "run_a" in text and "B - run_a" in text and "paper - run_a" in text
    rows = list(csv.reader(open(table)))
    assert rows[0] == ["tokens", "run_a", "B", "paper", "B - run_a", "paper - run_a"]
    assert [float(r[0]) for r in rows[1:]] == [20000, 50000, 100000, 150000]
    for r in rows[1:]:
        tokens, la, lb = float(r[0]), float(r[1]), float(r[2])
        # Aligned on tokens: at equal tokens the curves differ by the offset only (up to interpolation).
        assert abs(la - expected_loss(tokens, 0.0)) < 0.05
        assert abs(lb - expected_loss(tokens, 0.1)) < 0.05
        assert abs(float(r[4]) - 0.1) < 0.05  # same curve shifted by 0.1, despite a different batch size
    assert float(rows[3][3]) == pytest.approx(4.0)  # the reference at a tabulated point, not smoothed


def test_compare_steps_axis_smoothing_and_tensorboard(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    tb = tmp_path / "tb_run" / "tb"
    writer = SummaryWriter(str(tb))
    for step in range(1, 51):
        writer.add_scalar("loss", 5.0 - step * 0.01, step)
        writer.add_scalar("tokens_seen", step * 256, step)
    writer.close()
    a = write_run(tmp_path / "run_a", 0.0, steps=range(1, 51))
    out = tmp_path / "steps.png"
    assert compare_main([str(tmp_path / "tb_run"), str(a), "--x", "steps", "--smooth", "0.8",
                         "--output", str(out), "--points", "4", "--logx"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    text = capsys.readouterr().out
    assert "tb_run: 50 points" in text and "EMA" in text
    curve = load_run(str(tmp_path / "tb_run"))
    assert curve.tokens is not None and curve.tokens[-1] == 50 * 256
    assert smooth(curve.loss, 0.0) is curve.loss


def test_resumed_run_keeps_the_later_record(tmp_path):
    folder = write_run(tmp_path / "r", 0.0, steps=range(1, 6),
                       extra=[json.dumps({"step": 3, "loss": 1.25, "tokens_seen": 3000}), '{"step": 7, "lo'])
    curve = load_run(str(folder))
    assert list(curve.steps) == [1, 2, 3, 4, 5] and curve.loss[2] == 1.25  # truncated last line skipped


def test_bad_input_says_what_is_missing(tmp_path, capsys):
    good = write_run(tmp_path / "good", 0.0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "noloss").mkdir()
    (tmp_path / "noloss" / "metrics.jsonl").write_text(json.dumps({"step": 1, "lr": 0.1}) + "\n")
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("x,y\n1,2\n")
    out = tmp_path / "x.png"
    rc = compare_main([str(good), str(tmp_path / "missing"), str(tmp_path / "empty"), str(tmp_path / "nothing"),
                       str(tmp_path / "noloss"), "--reference", str(bad_csv), "--output", str(out)])
    assert rc == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "run 'missing'" in err and "does not exist" in err
    assert "run 'empty'" in err and "is empty" in err
    assert "run 'nothing'" in err and "no metrics.jsonl and no TensorBoard" in err
    assert "run 'noloss'" in err and "no finite 'loss'" in err
    assert "reference 'bad'" in err and "'tokens' (or 'step') and 'loss'" in err
    # Runs that do not overlap: plot written, table skipped with the ranges named.
    late = write_run(tmp_path / "late", 0.0, steps=range(1000, 1100, 10))
    assert compare_main([str(good), str(late), "--output", str(out)]) == 0
    assert "no tokens range common" in capsys.readouterr().err and out.exists()
    # A run without token counts cannot be aligned on tokens.
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert compare_main([str(tmp_path / "old"), "--output", str(out)]) == 2
    assert "--x steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_main(["--output", str(out)])


def test_reference_csv_units(tmp_path):
    ref = tmp_path / "llama_digitised.csv"
    ref.write_text("tokens_b,loss\n0.5,2.1\n0.1,2.5\n")
    curve = load_reference(str(ref))
    assert curve.label == "llama_digitised" and list(curve.tokens) == [1e8, 5e8] and list(curve.loss) == [2.5, 2.1]
