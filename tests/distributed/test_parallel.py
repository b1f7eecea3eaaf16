"""Parallel layouts reproduce the single-process loss: real multi-process runs over gloo on CPU.

Every run uses the same global batch (8 sequences) and the same initial weights (initialisation is
layout independent), so five deterministic steps must give the same losses up to float rounding. The runs
are batched: one torchrun start per world size (tests/support/batches.py).
"""

import pytest

from tests.support.batches import spec
from tests.support.parity import LAYOUTS, SINGLE, STEPS, relative_diffs


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.runs(SINGLE, f"layout_{n}")) for n in LAYOUTS])
def test_layout_matches_single_process(name, batches):
    diffs = relative_diffs(batches.get(f"layout_{name}").losses(), batches.get(SINGLE).losses())
    assert max(diffs) <= 1e-5, diffs


COMPILE = spec("compile", 1, *STEPS, "--training.local_batch_size", "8", "--compile.enable",
               "--compile.cache_dir", "{root}/compile_inductor_cache", lane="compile")


@pytest.mark.slow
@pytest.mark.runs(SINGLE, COMPILE)
def test_compile_matches_eager(batches):
    run = batches.get(COMPILE)
    diffs = relative_diffs(run.losses(), batches.get(SINGLE).losses())
    assert max(diffs) <= 1e-4, diffs
    cache = run.dump.parent / "compile_inductor_cache"
    assert any(p.is_file() for p in cache.rglob("*")), "compile.cache_dir was not used by Inductor"


BF16 = spec("fsdp2_bf16", 2, *STEPS, "--training.local_batch_size", "4", "--training.mixed_precision_param", "bfloat16")


@pytest.mark.slow
@pytest.mark.runs(SINGLE, BF16)
def test_fsdp_bf16_params_close_to_fp32(batches):
    diffs = relative_diffs(batches.get(BF16).losses(), batches.get(SINGLE).losses())
    assert max(diffs) <= 1e-2, diffs
    assert max(diffs) > 0  # bf16 really ran: not bitwise equal to fp32


FLOAT8_COMMON = ["--training.steps", "20", "--training.local_batch_size", "8", "--metrics.log_freq", "20",
                 "--training.mixed_precision_param", "bfloat16"]
# Three 20-step runs: a torchrun start of their own, beside the other single-process runs.
FLOAT8 = {"bf16": spec("float8_bf16_reference", 1, *FLOAT8_COMMON, lane="float8")}
for _recipe in ("tensorwise", "rowwise"):
    FLOAT8[_recipe] = spec(f"float8_{_recipe}", 1, *FLOAT8_COMMON, "--model.converters", "quantize.linear.float8",
                           "--quantize.linear.float8.recipe_name", _recipe, lane="float8")


@pytest.mark.slow
@pytest.mark.runs(*FLOAT8.values())
def test_float8_trains_close_to_bf16(batches):
    """float8 matmuls (torchao, emulated scaling on CPU) track bf16 within 5% after 20 steps."""
    reference = batches.get(FLOAT8["bf16"]).losses()[20]
    for recipe in ("tensorwise", "rowwise"):
        got = batches.get(FLOAT8[recipe]).losses()[20]
        assert abs(got - reference) / reference <= 0.05, (recipe, got, reference)
