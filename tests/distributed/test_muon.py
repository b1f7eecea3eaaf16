"""optimizer.name = "Muon" in real runs over gloo: every parallel layout reproduces the one-process losses, each
block matrix is orthogonalised on exactly one rank per step (once per HSDP replica), resume is exact, and a
checkpoint of FSDP 4 resumes under FSDP 2. (One-process math against torch.optim.Muon: tests/unit/test_muon.py.)

A two-block debug model, 10 steps, a global batch of 8 sequences of 64 tokens, the constant schedule after
warmup (a resumed run sees the straight run's learning rates); the runs are batched into the shared torchrun
starts (tests/support/batches.py).
"""

from __future__ import annotations

import pytest

from tests.support.batches import spec
from tests.support.checkpoints import assert_same

STEPS = 10
MUON = ["--optimizer.name", "Muon", "--model.n_layers", "2", "--training.steps", str(STEPS), "--debug.deterministic",
        "--training.global_batch_size", "8", "--lr_scheduler.decay_type", "constant"]
SAVE = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.last_save_model_only", "false"]
MATRICES = 2 * 7  # wq, wk, wv, wo, w1, w2, w3 per block

SINGLE = spec("muon_single", 1, *MUON, "--training.local_batch_size", "8", *SAVE)
# name: (processes, local batch, extra args, HSDP replicas)
LAYOUTS = {
    "fsdp2": (2, 4, [], 1),
    "fsdp4": (4, 2, SAVE, 1),
    "hsdp2x2": (4, 2, ["--parallelism.data_parallel_replicate_degree", "2"], 2),
    "tp2": (2, 8, ["--parallelism.tensor_parallel_degree", "2"], 1),
    "fsdp2_tp2": (4, 4, ["--parallelism.tensor_parallel_degree", "2"], 1),
    "pp2": (2, 8, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size",
                   "2"], 1),
}
RUNS = {name: spec(f"muon_{name}", n, *MUON, "--training.local_batch_size", str(lb), *extra)
        for name, (n, lb, extra, _) in LAYOUTS.items()}
# Step 5's checkpoint of the one-process run, resumed by one process; of FSDP 4, resumed by FSDP 2.
RESUMED = spec("muon_single_resumed", 1, *MUON, "--training.local_batch_size", "8", *SAVE, after=(SINGLE,),
               copy=((f"{{root}}/{SINGLE}/checkpoint/step-5", "{root}/muon_single_resumed/checkpoint/step-5"),))
RESHARDED = spec("muon_fsdp4_to_fsdp2", 2, *MUON, "--training.local_batch_size", "4", *SAVE, after=(RUNS["fsdp4"],),
                 copy=((f"{{root}}/{RUNS['fsdp4']}/checkpoint/step-5",
                        "{root}/muon_fsdp4_to_fsdp2/checkpoint/step-5"),))


def _relative(run, reference, steps) -> float:
    got, ref = run.losses(), reference.losses()
    assert sorted(got) == list(steps), sorted(got)
    return max(abs(got[s] - ref[s]) / abs(ref[s]) for s in steps)


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.runs(SINGLE, RUNS[n])) for n in LAYOUTS])
def test_layout_matches_one_process_and_orthogonalises_each_matrix_once(name, batches):
    """Losses within 1e-5 relative of one process for 10 steps; every step, over all ranks, each matrix ran
    Newton-Schulz exactly once (HSDP: once per replica, which orthogonalises its own copy)."""
    run = batches.get(RUNS[name])
    assert _relative(run, batches.get(SINGLE), range(1, STEPS + 1)) <= 1e-5
    replicas = LAYOUTS[name][3]
    for step, record in run.records().items():
        assert record["muon_matrices"] == MATRICES, step
        assert record["muon_orthogonalised_per_matrix"] == [replicas, replicas], step
        assert record["muon_orthogonalised"] == MATRICES * replicas, step


@pytest.mark.slow
@pytest.mark.runs(SINGLE, RESUMED)
def test_exact_resume(batches):
    """Step 5's checkpoint resumed to step 10: bitwise the straight run (momentum buffers and AdamW's
    moments restored exactly)."""
    run = batches.get(RESUMED)
    assert "step-5 loaded" in run.log
    got = run.records()
    assert sorted(got) == list(range(6, STEPS + 1))
    assert_same(batches.get(SINGLE).records(), got, range(6, STEPS + 1))
    assert all(got[s]["muon_orthogonalised_per_matrix"] == [1, 1] for s in got)  # the load's set-up step not counted


@pytest.mark.slow
@pytest.mark.runs(SINGLE, RUNS["fsdp4"], RESHARDED)
def test_resume_fsdp4_checkpoint_under_fsdp2(batches):
    run = batches.get(RESHARDED)
    assert "step-5 loaded" in run.log
    assert_same(batches.get(SINGLE).records(), run.records(), range(6, STEPS + 1), rel=1e-5)
    assert sorted(run.records()) == list(range(6, STEPS + 1))
