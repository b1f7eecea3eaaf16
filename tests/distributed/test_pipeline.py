"""Pipeline parallel: every schedule reproduces the single-process loss (real processes, gloo on CPU, one
torchrun start per world size)."""

import pytest

from tests.support.batches import spec
from tests.support.parity import PP2, REFERENCE, SINGLE, STEPS, relative_diffs
from trainer.parallel.config import SCHEDULES

@pytest.mark.slow
@pytest.mark.parametrize("schedule", [pytest.param(s, marks=pytest.mark.runs(REFERENCE[s], f"pp2_{s}"))
                                      for s in SCHEDULES])
def test_schedule_matches_single_process(schedule, batches):
    diffs = relative_diffs(batches.get(f"pp2_{schedule}").losses(), batches.get(REFERENCE[schedule]).losses())
    assert max(diffs) <= 1e-5, diffs


COMPOSED = {
    "pp2_fsdp2": spec("pp2_fsdp2", 4, *STEPS, "--training.local_batch_size", "4", *PP2,
                      "--parallelism.data_parallel_shard_degree", "2"),
    "pp2_tp2": spec("pp2_tp2", 4, *STEPS, "--training.local_batch_size", "8", *PP2,
                    "--parallelism.tensor_parallel_degree", "2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.runs(SINGLE, n)) for n in COMPOSED])
def test_pp_composes_with_fsdp_and_tp(name, batches):
    diffs = relative_diffs(batches.get(name).losses(), batches.get(SINGLE).losses())
    assert max(diffs) <= 1e-5, diffs


CKPT_COMMON = ["--lr_scheduler.decay_type", "constant", "--debug.deterministic", "--training.global_batch_size", "8",
               "--checkpoint.interval", "3", "--checkpoint.last_save_model_only", "false"]
PP_CKPT = {
    "straight": spec("pp_ckpt_straight", 1, *CKPT_COMMON, "--training.local_batch_size", "8", "--training.steps", "6"),
    "pp": spec("pp_ckpt_pp2", 2, *CKPT_COMMON, "--checkpoint.enable", "--training.local_batch_size", "8", *PP2,
               "--training.steps", "3"),
}
for _name, _nproc, _batch, _extra in (("pp1", 1, "8", ()), ("fsdp2", 2, "4", ()), ("pp2", 2, "8", tuple(PP2))):
    PP_CKPT[_name] = spec(f"pp_ckpt_to_{_name}", _nproc, *CKPT_COMMON, "--checkpoint.enable",
                          "--training.local_batch_size", _batch, *_extra, "--training.steps", "6",
                          after=(PP_CKPT["pp"],),
                          copy=((f"{{root}}/{PP_CKPT['pp']}/checkpoint", f"{{root}}/pp_ckpt_to_{_name}/checkpoint"),))


@pytest.mark.slow
@pytest.mark.runs(*PP_CKPT.values())
def test_pp_checkpoint_loads_under_pp1_fsdp2_and_pp2(batches):
    """Saved under PP 2, resumed under 1 process, under FSDP 2 and under PP 2 again (each rank's optimizer
    param groups are its own parameters'): same losses as a straight run."""
    straight = batches.get(PP_CKPT["straight"]).losses()
    for name in ("pp1", "fsdp2", "pp2"):
        resumed = batches.get(PP_CKPT[name]).losses()
        assert sorted(resumed) == [4, 5, 6], resumed  # continued from step 3
        for step in (4, 5, 6):
            assert abs(resumed[step] - straight[step]) <= 1e-5 * straight[step], (name, step, resumed, straight)
