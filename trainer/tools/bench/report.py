"""The table ``trainer bench`` prints, with each target marked."""

from __future__ import annotations

from typing import Any

from .gpu import _gpu_row

# Targets on CPU (docs/benchmarks.md): (metric, comparison, bound).
TARGETS = {
    "overhead_ratio": ("<=", 1.05),
    "loader_vs_consumption": (">=", 10.0),
    "async_block_fraction": ("<", 0.20),
    "overhead_ratio_processes": ("<=", 1.03),
    "ours_vs_torchtitan": ("<=", 1.00),
    "eval_ratio_2_over_1": ("<=", 0.65),
}



def _check(metric: str, value: float | None) -> str:
    if metric not in TARGETS or value is None:
        return ""
    op, bound = TARGETS[metric]
    ok = {"<=": value <= bound, ">=": value >= bound, "<": value < bound}[op]
    return f"target {op} {bound:g}: {'PASS' if ok else 'MISS'}"


class _Rows(list):
    """Rows (name, value, target verdict) of the table."""

    def add(self, name: str, value: Any, fmt: str = "{:.4g}", metric: str | None = None) -> None:
        shown = "-" if value is None else (fmt.format(value) if isinstance(value, (int, float)) else str(value))
        self.append((name, shown, _check(metric or name, value) if isinstance(value, (int, float)) else ""))


def _overhead_rows(rows: _Rows, o: dict) -> None:
    add = rows.add
    if "step_time_trainer_s" in o:
        add("overhead: device", o["device"])
        add("overhead: trainer step time (s)", o["step_time_trainer_s"])
        add("overhead: bare loop step time (s)", o["step_time_bare_s"])
        add("overhead: trainer step, in-memory data (s)", o["step_time_trainer_no_loader_s"])
        add("overhead_ratio (trainer / bare)", o["overhead_ratio"], "{:.4f}", "overhead_ratio")
        add("overhead_ratio_no_loader", o["overhead_ratio_no_loader"], "{:.4f}")
        add("overhead: CPU-time ratio (with / without loader)",
            f"{o['overhead_ratio_cpu_time']:.4f} / {o['overhead_ratio_cpu_time_no_loader']:.4f}")
        add("overhead: loss step 1 trainer / bare", f"{o['loss_step1_trainer']:.6f} / {o['loss_step1_bare']:.6f}")
    if "processes" in o:
        p = o["processes"]
        add("overhead, separate processes: trainer / bare step (s)",
            f"{p['step_time_trainer_s']:.4f} / {p['step_time_bare_s']:.4f}")
        add("overhead_ratio_processes (trainer / bare script)", p["overhead_ratio_processes"], "{:.4f}",
            "overhead_ratio_processes")
        add("overhead, separate processes: CPU-time ratio", p["overhead_ratio_processes_cpu_time"], "{:.4f}")
        add("overhead, separate processes: fastest cycle / fastest cycle", p["overhead_ratio_processes_best_cycle"],
            "{:.4f}")
        add("overhead, separate processes: ratio per repeat (min..max)",
            f"{min(p['ratio_per_repeat']):.4f} .. {max(p['ratio_per_repeat']):.4f}")


def _data_rows(rows: _Rows, d: dict) -> None:
    add = rows.add
    add("data: loader tokens/s, on the fly", d["tokens_per_s_on_the_fly"], "{:,.0f}")
    add("data: loader tokens/s, pre-tokenized", d["tokens_per_s_pretokenized"], "{:,.0f}")
    add("data: model consumes tokens/s", d["tokens_per_s_consumed"], "{:,.0f}")
    add("loader_vs_consumption (slowest loader / model)", d["loader_vs_consumption"], "{:,.1f}",
        "loader_vs_consumption")
    add("data: fraction of step time waiting for data", d["data_wait_fraction"], "{:.4f}")


def _data_files_rows(rows: _Rows, d: dict) -> None:
    for r in d["rows"]:
        rows.add(f"data-files: seq {r['seq_len']} {r['kind']} tokens/s (x plain memmap)",
                 f"{r['tokens_per_s']:,.0f} ({r['vs_plain']:.3f}x)")


def _checkpoint_rows(rows: _Rows, c: dict) -> None:
    add = rows.add
    if "disk" in c:
        from .checkpoint_disk import DISK_TARGETS, disk_rows

        for name, value, fmt, metric in disk_rows(c["disk"]):
            verdict = ""
            if metric is not None and isinstance(value, (int, float)):
                op, bound = DISK_TARGETS[metric]
                ok = value >= bound if op == ">=" else value <= bound
                verdict = f"target {op} {bound:g}: {'PASS' if ok else 'MISS'}"
            rows.append((name, fmt.format(value) if isinstance(value, (int, float)) else str(value), verdict))
    if "staging" in c:
        _staging_rows(rows, c["staging"])
    add("checkpoint: size (MB)", c["checkpoint_bytes"] / 1e6, "{:.1f}")
    for mode, m in c.get("modes", {c["async_mode"]: c}).items():
        add(f"checkpoint: sync save (s) [{mode} run]", m["sync_save_s"], "{:.3f}")
        add(f"checkpoint: async, the save thread's copy (s) [{mode}]", m.get("async_copy_s"), "{:.3f}")
        add(f"checkpoint: async save blocks the loop (s) [{mode}]", m["async_blocking_s"], "{:.3f}")
        add(f"checkpoint: async, extra time of the next step (s) [{mode}]", m["async_first_step_extra_s"], "{:.3f}")
        add(f"checkpoint: async block / sync save [{mode}]", m["async_block_fraction"], "{:.3f}")
    add("checkpoint: copy, reused buffers / fresh (async_with_pinned_mem / async)", c.get("copy_reused_vs_fresh"),
        "{:.3f}")
    add(f"async_block_fraction (best mode: {c['async_mode']})", c["async_block_fraction"], "{:.3f}",
        "async_block_fraction")
    add("checkpoint: sync save GB/s", c["sync_save_gb_per_s"], "{:.3f}")
    add("checkpoint: async save, call to written (s)", c["async_write_s"], "{:.3f}")
    add("checkpoint: async save GB/s (call to written)", c["async_save_gb_per_s"], "{:.3f}")
    add("checkpoint: load GB/s", c["load_gb_per_s"], "{:.3f}")
    add("checkpoint: step time / during async write (s)",
        f"{c['step_time_s']:.3f} / {c['step_time_during_async_write_s']:.3f}")


def _staging_rows(rows: _Rows, s: dict) -> None:
    from .staging import staging_rows

    for name, value in staging_rows(s):
        rows.append((name, value, ""))


def _gpu_rows(rows: _Rows, g: dict) -> None:
    for case in g["cases"]:
        rows.append((f"gpu: {case['flavor']} {case['variant']}", _gpu_row(case).strip(), ""))


def _kernel_rows(rows: _Rows, k: dict) -> None:
    for c in k["rope"]:
        mode = "compile" if c["compile"] else "eager"
        rows.add(f"rope {c['shape']} {mode}: real / complex (ms)", f"{c['real_ms']:.3f} / {c['complex_ms']:.3f}")
        rows.add(f"rope {c['shape']} {mode}: complex / real", c["complex_over_real"], "{:.3f}")
        rows.add(f"rope {c['shape']} {mode}: max |diff| out / grad",
                 f"{c['max_abs_diff_out']:.2e} / {c['max_abs_diff_grad']:.2e}")
    m = k["model"]
    rows.add(f"debug model fwd+bwd {m['batch']}x{m['seq_len']}: real / complex RoPE (CPU ms)",
             f"{m['real_ms']:.1f} / {m['complex_ms']:.1f}")
    rows.add("debug model fwd+bwd: complex / real RoPE (CPU time / wall)",
             f"{m['complex_over_real']:.3f} / {m['complex_over_real_wall']:.3f}")


def _generic_rows(rows: _Rows, suite: str, r: dict) -> None:
    """A suite without rows of its own here: its scalar results, one row each."""
    if "skipped" in r:
        rows.add(suite, f"skipped ({r['skipped']})")
        return
    for key, value in r.items():
        if isinstance(value, (int, float, str)) and not isinstance(value, bool) and key != "seconds":
            rows.add(f"{suite}: {key}", value, metric=key)


ROWS = {"overhead": _overhead_rows, "data": _data_rows, "data-files": _data_files_rows,
        "checkpoint": _checkpoint_rows, "staging": _staging_rows, "gpu": _gpu_rows, "kernels": _kernel_rows}


def format_table(results: dict[str, Any]) -> str:
    rows = _Rows()
    for suite, result in results.items():
        if suite in ROWS and "skipped" not in result:
            ROWS[suite](rows, result)
        else:
            _generic_rows(rows, suite, result)
    width = max((len(r[0]) for r in rows), default=10)
    vwidth = max((len(r[1]) for r in rows), default=10)
    return "\n".join(f"{n:<{width}}  {v:>{vwidth}}  {t}".rstrip() for n, v, t in rows)
