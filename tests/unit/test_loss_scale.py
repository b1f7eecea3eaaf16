"""float16 training with dynamic loss scaling: the scale's arithmetic against torch.amp.GradScaler's, its
config rules, and real runs of the trainer in this process (``trainer.train.main``, world size 1, a
one-block debug model): float16 tracks float32, the overflow drill skips exactly its step and backs the
scale off without tripping the non-finite guard, and a resume restores the scale bitwise.
(FSDP with the overflow on one rank only: tests/distributed/test_parallel.py.)"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.launch import read_metrics, train_in_process
from trainer.config import ConfigError, load_config, validate
from trainer.optim.config import LossScale
from trainer.optim.loss_scale import LossScaler
from trainer.step import PipelineLoss, loss_fn

# ---------------------------------------------------------------------------------------------------
# The scale's arithmetic
# ---------------------------------------------------------------------------------------------------


def grad_scaler_scales(init: float, interval: int, overflows: list[bool]) -> list[float]:
    """torch.amp.GradScaler's scale after each step of an SGD run whose gradient is inf where asked."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
    out = []
    for inf in overflows:
        scaler.scale(torch.ones(()))  # GradScaler's scale exists from its first use on
        p.grad = torch.full((1,), math.inf if inf else 1.0)
        scaler.step(opt)
        scaler.update()
        out.append(scaler.get_scale())
    return out


def loss_scaler_scales(init: float, interval: int, overflows: list[bool]) -> list[float]:
    scaler = LossScaler(LossScale(init_scale=init, growth_interval=interval), torch.device("cpu"))
    model = torch.nn.Linear(1, 1, bias=False)
    out = []
    for inf in overflows:
        model.weight.grad = torch.full((1, 1), math.inf if inf else 1.0)
        scaler.unscale_([model])
        scaler.found_overflow(torch.linalg.vector_norm(model.weight.grad))
        scaler.update()
        out.append(float(scaler.scale))
    return out


@pytest.mark.parametrize("init", [1024.0, 2.0**126])  # 2**126: growing twice would overflow float32
def test_scale_follows_grad_scaler(init):
    pattern = [False] * 3 + [True] + [False] * 7 + [True, True] + [False] * 4
    assert loss_scaler_scales(init, 3, pattern) == grad_scaler_scales(init, 3, pattern)


def test_unscale_divides_and_state_round_trips_bitwise():
    scaler = LossScaler(LossScale(init_scale=3.0), torch.device("cpu"))  # not a power of two
    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.tensor([[3.0, 6.0]])
    scaler.unscale_([model])
    assert torch.equal(model.weight.grad, torch.tensor([[3.0, 6.0]]) * torch.tensor(1 / 3.0))
    scaler.scale.fill_(0.1)  # a float32 value with many mantissa bits
    scaler.growth_tracker.fill_(7)
    other = LossScaler(LossScale(), torch.device("cpu"))
    other.load_state_dict(json.loads(json.dumps(scaler.state_dict())))
    assert other.scale.dtype == torch.float32 and torch.equal(other.scale, scaler.scale)
    assert int(other.growth_tracker) == 7


def test_pipeline_loss_runs_backward_on_the_scaled_loss_and_keeps_the_loss():
    logits, labels = torch.randn(1, 4, 8), torch.randint(0, 8, (1, 4))
    pl = PipelineLoss()
    pl.tokens_per_rank = 4
    plain = pl(logits, labels)
    pl.scale = torch.tensor(8.0)
    pl(torch.randn(1, 4, 8), labels)  # as torch's shape inference calls it, on the first step
    scaled = pl(logits, labels)
    assert torch.equal(scaled, plain * 8.0) and torch.equal(pl.unscaled_of(scaled), loss_fn(logits, labels) / 4)


# ---------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, match", [
    (["--training.mixed_precision_reduce", "float16"], r"mixed_precision_reduce = \"float16\" is safe only with float16"),
    (["--training.loss_scale.init_scale", "8"], r"training.loss_scale.init_scale is set but .* is 'bfloat16'"),
    (["--debug.overflow_at_steps", "3"], "debug.overflow_at_steps drills float16's loss scaling"),
    (["--training.mixed_precision_param", "float16", "--fault_tolerance.enable"], "fault_tolerance.enable is not"),
    (["--training.mixed_precision_param", "float16", "--training.loss_scale.backoff_factor", "1"], r"in \(0, 1\)"),
    (["--training.mixed_precision_param", "float16", "--training.loss_scale.growth_interval", "0"], ">= 1"),
])
def test_config_refuses_in_one_line(args, match):
    with pytest.raises(ConfigError, match=match) as e:
        validate(load_config(args, env={}))
    assert "\n" not in str(e.value)


def test_float16_reduction_is_accepted_with_float16_training():
    validate(load_config(["--training.mixed_precision_param", "float16", "--training.mixed_precision_reduce",
                          "float16", "--training.loss_scale.init_scale", "1024"], env={}))


def test_plan_counts_float16_parameters_as_bfloat16():
    from trainer.tools.plan.cli import plan

    est = {dtype: plan(load_config(["--training.mixed_precision_param", dtype], env={}), 8, top=1)["configured"]
           for dtype in ("bfloat16", "float16", "float32")}
    assert est["float16"] == est["bfloat16"] != est["float32"]


# ---------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------

TINY = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--debug.deterministic", "--training.steps", "4"]
FP16 = ["--training.mixed_precision_param", "float16"]
# The drill at step 1; the scale grows after 3 clean steps: 1024 -> 512 (step 1), 512, 512, 1024 (step 4).
# max_consecutive_bad_steps 1: were the overflow a non-finite step to the guard, the run would stop at once.
DRILL = [*FP16, "--debug.overflow_at_steps", "1", "--training.loss_scale.init_scale", "1024",
         "--training.loss_scale.growth_interval", "3", "--stability.max_consecutive_bad_steps", "1",
         "--checkpoint.enable", "--checkpoint.interval", "2"]


def by_step(dump: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(dump)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """float32, float16 and the drilled float16 run, once for the module."""
    dumps = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, extra in (("fp32", []), ("fp16", FP16), ("drill", DRILL)):
            dumps[name] = tmp_path_factory.mktemp(name)
            rc, log = train_in_process(dumps[name], *TINY, *extra, monkeypatch=mp)
            assert rc == 0, log[-4000:]
    return dumps


def test_float16_tracks_float32(runs):
    fp32, fp16 = by_step(runs["fp32"]), by_step(runs["fp16"])
    diffs = [abs(fp16[s]["loss"] - fp32[s]["loss"]) / fp32[s]["loss"] for s in range(1, 5)]
    assert max(diffs) <= 1e-2, diffs  # the bf16 parity tolerance (tests/distributed/test_parallel.py)
    assert max(diffs) > 0  # float16 really ran
    assert [fp16[s]["loss_scale"] for s in range(1, 5)] == [65536.0] * 4 and fp16[4]["overflow_skipped"] == 0
    assert "loss_scale" not in fp32[4]


def test_overflow_drill_skips_its_step_and_backs_off(runs):
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.state import unpickle_bytes

    dump = runs["drill"]
    rec = by_step(dump)
    assert [rec[s]["skipped"] for s in range(1, 5)] == [True, False, False, False]
    assert rec[1]["skip_reason"] == "float16 gradient overflow: loss scale 1024 -> 512"
    assert [rec[s]["loss_scale"] for s in range(1, 5)] == [512.0, 512.0, 512.0, 1024.0]
    assert rec[4]["overflow_skipped"] == 1 and rec[4]["skipped_steps"] == 1
    assert rec[4]["skipped_nonfinite_steps"] == 0 and rec[1]["consecutive_bad_steps"] == 0  # no NaN failure
    assert all(math.isfinite(rec[s]["loss"]) for s in rec) and rec[1]["loss"] == by_step(runs["fp16"])[1]["loss"]
    summary = json.loads((dump / "summary.json").read_text())
    assert (summary["status"], summary["overflow_skipped"], summary["loss_scale"], summary["skipped_steps"]) == (
        "completed", 1, 1024.0, 1)
    # Step 2's checkpoint: AdamW stepped once (step 1's update was skipped), and the scaler's state.
    state = {"callbacks": b"", "optimizer": {"state": {"output.weight": {"step": torch.zeros(())}}}}
    dcp.load(state, checkpoint_id=str(dump / "checkpoint" / "step-2"), no_dist=True)
    assert float(state["optimizer"]["state"]["output.weight"]["step"]) == 1.0
    assert unpickle_bytes(state["callbacks"])["loss_scaler"] == {"scale": 512.0, "growth_tracker": 1,
                                                                 "overflow_skipped": 1}


def test_a_nonfinite_loss_in_float16_is_still_a_bad_step(tmp_path, monkeypatch):
    """A NaN loss is no overflow the scale can cure: the non-finite guard counts it and stops the run."""
    rc, log = train_in_process(tmp_path, *TINY, *FP16, "--stability.inject_nonfinite_loss_steps", "2",
                               "--stability.max_consecutive_bad_steps", "1", monkeypatch=monkeypatch)
    assert rc == 3 and "1 consecutive bad steps (steps 2-2; last: non-finite loss nan" in log, log[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["overflow_skipped"] == 1  # backed off all the same


def test_resume_restores_the_scale_bitwise(runs, tmp_path, monkeypatch):
    """From step 2 (scale 512, one clean step counted towards growth): steps 3-4 exactly as the unbroken run,
    the growth at step 4 included (a fresh scale, or a lost count, would differ)."""
    dump = tmp_path / "resumed"
    shutil.copytree(runs["drill"], dump)
    for ckpt in (dump / "checkpoint").iterdir():
        if ckpt.name != "step-2":
            shutil.rmtree(ckpt)
    kept = [r for r in read_metrics(dump) if r["step"] <= 2]
    (dump / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    rc, log = train_in_process(dump, *TINY, *DRILL, monkeypatch=monkeypatch)
    assert rc == 0, log[-4000:]
    ref, run = by_step(runs["drill"]), by_step(dump)
    for s in (3, 4):
        for key in ("loss", "grad_norm", "loss_scale", "overflow_skipped", "skipped_steps"):
            assert run[s][key] == ref[s][key], (s, key)
