"""``trainer compare``: loss curves of several runs and reference curves, aligned on tokens (or steps).

    trainer compare outputs/run_a outputs/run_b --reference llama2_7b=my_digitised_curve.csv \
        --smooth 0.9 --output compare.png

A RUN is a dump folder (its ``metrics.jsonl``, else its TensorBoard events under ``tb/``), a
``metrics.jsonl`` file, or a TensorBoard event folder/file; ``LABEL=PATH`` names it in the legend and the
table. A reference is a CSV with a header and columns ``tokens`` (or ``step``) and ``loss``
(``tokens_b``/``tokens_billions`` are read as billions of tokens).

No numeric loss curve was published with Llama 2 (the paper shows a figure only), and none is bundled
here: reference CSVs are curves *you* digitised from a figure or recorded from another run.

The table lists each curve's (smoothed) loss at token counts common to all curves, linearly interpolated
between logged points, and the difference to the first curve.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger("trainer")

__all__ = ["Curve", "CompareError", "load_run", "load_reference", "smooth", "common_points", "build_table",
           "plot", "main"]


class CompareError(ValueError):
    """Input that cannot be compared; the message says what is missing."""


@dataclass
class Curve:
    label: str
    steps: np.ndarray
    tokens: np.ndarray | None
    loss: np.ndarray
    source: str
    reference: bool = False
    notes: list[str] = field(default_factory=list)

    def smoothed(self, weight: float) -> np.ndarray:
        """The loss with EMA smoothing; reference curves (already clean, often sparse) are never smoothed."""
        return self.loss if self.reference else smooth(self.loss, weight)

    def x(self, axis: str) -> np.ndarray:
        if axis == "tokens":
            if self.tokens is None:
                raise CompareError(f"{self.label}: no token counts ({self.source}); use --x steps")
            return self.tokens
        if self.steps is None:
            raise CompareError(f"{self.label}: no step numbers ({self.source}); use --x tokens")
        return self.steps


def _split_label(spec: str) -> tuple[str | None, str]:
    """``LABEL=PATH`` -> (LABEL, PATH); a bare path (even one containing '=') when the whole exists."""
    if "=" in spec and not Path(spec).exists():
        label, path = spec.split("=", 1)
        if label and path:
            return label, path
    return None, spec


def _default_label(path: Path) -> str:
    if path.is_file() and path.name in ("metrics.jsonl",):
        return path.parent.name
    if path.name in ("tb",):
        return path.parent.name
    return path.name if path.name else str(path)


def _read_jsonl(path: Path, metric: str) -> tuple[list[int], list[float | None], list[float]]:
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise CompareError(f"{path} is empty: the run logged no step yet (records are written every "
                           "metrics.log_freq steps)")
    by_step: dict[int, dict] = {}
    bad = 0
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1  # e.g. a line cut short by a crash
            continue
        if isinstance(rec, dict) and "step" in rec:
            by_step[int(rec["step"])] = rec  # a resumed run re-logs steps: the later record wins
    if bad:
        logger.warning("%s: skipped %d malformed line(s)", path, bad)
    steps, tokens, values = [], [], []
    for step in sorted(by_step):
        rec = by_step[step]
        value = rec.get(metric)
        if value is None or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        steps.append(step)
        tokens.append(rec.get("tokens_seen"))
        values.append(float(value))
    if not values:
        found = sorted({k for r in by_step.values() for k in r})
        raise CompareError(f"{path} has {len(by_step)} record(s) but no finite '{metric}' values"
                           + (f" (fields: {', '.join(found)})" if found else ""))
    return steps, tokens, values


def _tb_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path] if "tfevents" in path.name else []
    return sorted(path.rglob("*tfevents*"))


def _read_tensorboard(path: Path, metric: str) -> tuple[list[int], list[float | None], list[float]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        raise CompareError(f"{path}: reading TensorBoard events needs the tensorboard package ({e})") from None
    values: dict[int, float] = {}
    tokens: dict[int, float] = {}
    for f in _tb_files(path):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags().get("scalars", [])
        if metric in tags:
            values.update({e.step: e.value for e in acc.Scalars(metric)})
        if "tokens_seen" in tags:
            tokens.update({e.step: e.value for e in acc.Scalars("tokens_seen")})
    if not values:
        raise CompareError(f"{path}: TensorBoard events hold no '{metric}' scalar")
    steps = sorted(s for s in values if math.isfinite(values[s]))
    return steps, [tokens.get(s) for s in steps], [values[s] for s in steps]


def load_run(spec: str, metric: str = "loss") -> Curve:
    """A run's curve from a dump folder, metrics.jsonl, or TensorBoard events."""
    label, raw = _split_label(spec)
    path = Path(raw).expanduser()
    label = label or _default_label(path)
    if not path.exists():
        raise CompareError(f"run '{label}': {path} does not exist")
    if path.is_dir():
        jsonl = path / "metrics.jsonl"
        if jsonl.is_file():
            source = jsonl
        elif _tb_files(path):
            source = path
        else:
            raise CompareError(f"run '{label}': no metrics.jsonl and no TensorBoard event files in {path} "
                               "(expected a dump folder with metrics.jsonl or tb/)")
    else:
        source = path
    try:
        if source.suffix == ".jsonl" or source.name.endswith(".jsonl"):
            steps, tokens, values = _read_jsonl(source, metric)
        elif _tb_files(source):
            steps, tokens, values = _read_tensorboard(source, metric)
        else:
            raise CompareError(f"{source} is neither a metrics.jsonl nor a TensorBoard event file")
    except CompareError as e:
        raise CompareError(f"run '{label}': {e}") from None
    tok = None
    if all(t is not None for t in tokens):
        tok = np.asarray(tokens, dtype=float)
    return Curve(label=label, steps=np.asarray(steps, dtype=float), tokens=tok, loss=np.asarray(values, dtype=float),
                 source=str(source))


_TOKEN_COLUMNS = {"tokens": 1.0, "tokens_seen": 1.0, "token": 1.0, "tokens_b": 1e9, "tokens_billions": 1e9,
                  "btokens": 1e9, "tokens_m": 1e6, "tokens_millions": 1e6}
_LOSS_COLUMNS = ("loss", "train_loss", "training_loss", "value")


def load_reference(spec: str) -> Curve:
    """A reference curve from a CSV with a header: tokens (or step) and loss columns."""
    label, raw = _split_label(spec)
    path = Path(raw).expanduser()
    label = label or path.stem
    if not path.is_file():
        raise CompareError(f"reference '{label}': {path} does not exist")
    with open(path, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.reader(line for line in f if line.strip() and not line.lstrip().startswith("#"))]
    if len(rows) < 2:
        raise CompareError(f"reference '{label}': {path} needs a header row and at least one data row")
    header = [h.strip().lower() for h in rows[0]]
    tok_col = next((c for c in header if c in _TOKEN_COLUMNS), None)
    step_col = "step" if "step" in header else ("steps" if "steps" in header else None)
    loss_col = next((c for c in _LOSS_COLUMNS if c in header), None)
    if loss_col is None or (tok_col is None and step_col is None):
        raise CompareError(f"reference '{label}': {path} needs columns 'tokens' (or 'step') and 'loss'; "
                           f"found: {', '.join(header)}")
    tokens, steps, loss = [], [], []
    for n, row in enumerate(rows[1:], start=2):
        try:
            rec = dict(zip(header, (v.strip() for v in row)))
            loss.append(float(rec[loss_col]))
            if tok_col:
                tokens.append(float(rec[tok_col]) * _TOKEN_COLUMNS[tok_col])
            if step_col:
                steps.append(float(rec[step_col]))
        except (KeyError, ValueError):
            raise CompareError(f"reference '{label}': {path} line {n} is not numeric: {','.join(row)}") from None
    order = np.argsort(np.asarray(tokens if tok_col else steps))
    arr = lambda xs: np.asarray(xs, dtype=float)[order] if xs else None  # noqa: E731
    return Curve(label=label, steps=arr(steps), tokens=arr(tokens), loss=arr(loss), source=str(path),
                 reference=True)


def smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard-style exponential moving average with bias correction (weight 0: unchanged)."""
    if weight <= 0 or len(values) == 0:
        return values
    out = np.empty_like(values, dtype=float)
    acc, norm = 0.0, 0.0
    for i, v in enumerate(values):
        acc = weight * acc + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out[i] = acc / norm
    return out


def common_points(curves: list[Curve], axis: str, n: int, at: list[float] | None = None,
                  log: bool = False) -> np.ndarray:
    """x values inside every curve's range: ``at`` if given (filtered), else ``n`` evenly spaced ones."""
    lo = max(float(c.x(axis).min()) for c in curves)
    hi = min(float(c.x(axis).max()) for c in curves)
    if at:
        return np.asarray([x for x in at if lo <= x <= hi], dtype=float)
    if lo > hi:
        return np.asarray([])
    if lo == hi:
        return np.asarray([lo])
    points = np.geomspace(lo, hi, n) if log and lo > 0 else np.linspace(lo, hi, n)
    if axis == "steps":  # steps are integers: compare at logged steps, not between them
        points = np.unique(np.round(points))
    return points


def human(x: float) -> str:
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.4g}"


def build_table(curves: list[Curve], axis: str, points: np.ndarray, smoothing: float) -> tuple[list[str], list[list]]:
    """Header and rows: x, each curve's loss at x, each curve's difference to the first curve."""
    base = curves[0]
    header = [axis] + [c.label for c in curves] + [f"{c.label} - {base.label}" for c in curves[1:]]
    rows = []
    for x in points:
        values = [float(np.interp(x, c.x(axis), c.smoothed(smoothing))) for c in curves]
        rows.append([float(x)] + values + [v - values[0] for v in values[1:]])
    return header, rows


def format_table(header: list[str], rows: list[list]) -> str:
    """Fixed-width text: x, one loss column per curve, then signed differences to the first curve."""
    n_curves = len(header) // 2  # header = [x] + n labels + (n - 1) differences
    cells = [header] + [[human(r[0])] + [f"{v:.4f}" for v in r[1:1 + n_curves]]
                        + [f"{v:+.4f}" for v in r[1 + n_curves:]] for r in rows]
    widths = [max(len(row[j]) for row in cells) for j in range(len(header))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(curves: list[Curve], axis: str, output: Path, smoothing: float, logx: bool = False,
         title: str | None = None, points: np.ndarray | None = None, metric: str = "loss") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    with_diff = len(curves) > 1 and points is not None and len(points) > 0
    fig, axes = plt.subplots(2 if with_diff else 1, 1, figsize=(10, 7.5 if with_diff else 5.5), sharex=True,
                             gridspec_kw={"height_ratios": [3, 1.3]} if with_diff else None, squeeze=False)
    ax = axes[0][0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, c in enumerate(curves):
        color = colors[i % len(colors)]
        x = c.x(axis)
        style = "--" if c.reference else "-"
        name = f"{c.label} (reference)" if c.reference else c.label
        if smoothing > 0 and len(x) > 1 and not c.reference:
            ax.plot(x, c.loss, style, color=color, alpha=0.25, linewidth=1)
            ax.plot(x, c.smoothed(smoothing), style, color=color, linewidth=2, label=f"{name}, EMA {smoothing:g}")
        else:
            ax.plot(x, c.loss, style, color=color, linewidth=2, label=name,
                    marker="o" if len(x) < 30 else None, markersize=3)
    ax.set_ylabel("training loss" if metric == "loss" else metric.replace("_", " "))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=10, framealpha=0.9)
    ax.set_title(title or f"{metric.replace('_', ' ').capitalize()} vs {'tokens' if axis == 'tokens' else 'steps'}")
    if logx:
        ax.set_xscale("log")
    if with_diff:
        dx = axes[1][0]
        base = curves[0]
        xs = np.linspace(points.min(), points.max(), 200) if len(points) > 1 else points
        base_y = np.interp(xs, base.x(axis), base.smoothed(smoothing))
        for i, c in enumerate(curves[1:], start=1):
            y = np.interp(xs, c.x(axis), c.smoothed(smoothing)) - base_y
            dx.plot(xs, y, "--" if c.reference else "-", color=colors[i % len(colors)], linewidth=1.5,
                    label=f"{c.label} - {base.label}")
        dx.axhline(0.0, color="black", linewidth=0.8)
        dx.set_ylabel(f"difference to\n{base.label}")
        dx.grid(True, alpha=0.3)
        dx.legend(loc="best", fontsize=9)
    bottom = axes[-1][0]
    bottom.set_xlabel("tokens" if axis == "tokens" else "step")
    if axis == "tokens":
        bottom.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human(v)))
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainer compare",
        description="Compare the loss curves of runs (metrics.jsonl or TensorBoard) and reference CSVs: a table "
                    "of losses at common token counts and a PNG plot. No Llama 2 loss numbers are published or "
                    "bundled; reference CSVs (columns tokens,loss) are ones you digitised or recorded.")
    parser.add_argument("runs", nargs="*", metavar="RUN", help="dump folder, metrics.jsonl or TensorBoard folder; "
                        "LABEL=PATH sets the legend label")
    parser.add_argument("--reference", action="append", default=[], metavar="CSV",
                        help="reference curve CSV with columns tokens (or step) and loss; LABEL=PATH allowed; "
                        "repeatable")
    parser.add_argument("--output", required=True, help="PNG file to write")
    parser.add_argument("--x", choices=["tokens", "steps"], default="tokens", help="align on tokens (default) or steps")
    parser.add_argument("--metric", default="loss", help="record field to compare (loss, validation_loss, ...)")
    parser.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1) (TensorBoard-style); 0: off")
    parser.add_argument("--points", type=int, default=8, help="rows of the table (evenly spaced common x values)")
    parser.add_argument("--at", default=None, help="comma-separated x values for the table instead, e.g. 1e9,2e9")
    parser.add_argument("--logx", action="store_true", help="logarithmic x axis")
    parser.add_argument("--title", default=None)
    parser.add_argument("--table", default=None, help="also write the table as CSV to this file")
    args = parser.parse_args(argv)
    if not 0.0 <= args.smooth < 1.0:
        parser.error("--smooth must be in [0, 1)")
    if not args.runs and not args.reference:
        parser.error("nothing to compare: give at least one RUN or --reference")

    curves, errors = [], []
    for spec in args.runs:
        try:
            curves.append(load_run(spec, args.metric))
        except CompareError as e:
            errors.append(str(e))
    for spec in args.reference:
        try:
            curves.append(load_reference(spec))
        except CompareError as e:
            errors.append(str(e))
    for c in curves:
        try:
            c.x(args.x)
        except CompareError as e:
            errors.append(str(e))
    if errors:
        print("trainer compare: cannot compare:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 2

    at = [float(v) for v in args.at.split(",")] if args.at else None
    points = common_points(curves, args.x, args.points, at, log=args.logx)
    print("curves:")
    for c in curves:
        x = c.x(args.x)
        print(f"  {c.label}: {len(x)} points, {args.x} {human(x.min())}..{human(x.max())}, "
              f"final {args.metric} {c.loss[-1]:.4f}  ({c.source})")
    if len(points) == 0:
        ranges = "; ".join(f"{c.label} {human(c.x(args.x).min())}..{human(c.x(args.x).max())}" for c in curves)
        print(f"no {args.x} range common to all curves ({ranges}): table skipped", file=sys.stderr)
        header, rows = [], []
    else:
        header, rows = build_table(curves, args.x, points, args.smooth)
        print(f"\n{args.metric} at common {args.x}" + (f" (runs EMA-smoothed {args.smooth:g})" if args.smooth else "")
              + f"; differences to {curves[0].label}:")
        print(format_table(header, rows))
    if args.table and header:
        with open(args.table, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(rows)
    output = Path(args.output)
    plot(curves, args.x, output, args.smooth, logx=args.logx, title=args.title, points=points, metric=args.metric)
    print(f"\nplot written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
