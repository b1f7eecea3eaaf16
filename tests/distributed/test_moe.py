"""The mixture-of-experts debug model (debug_moe) in real runs over gloo: FSDP, expert parallel (EP 2 and 4,
EP x FSDP, EP x HSDP, EP x PP with full activation checkpointing) and tensor parallel (TP, EP x TP) reproduce
the one-process losses, auxiliary losses and expert loads, and EP x FSDP and EP x TP checkpoints resume in one
process. (The layer against its definition, resume in one process: tests/unit/test_moe.py.)

Two MoE blocks, 10 steps, a global batch of 8 sequences of 64 tokens, the sequence-wise auxiliary loss and a
fast expert bias on (so that both the loss and the routing depend on every rank's counts); the runs are
batched into the shared torchrun starts (tests/support/batches.py).
"""

from __future__ import annotations

import pytest

from tests.support.batches import spec

STEPS = 10
MOE = ["--model.flavor", "debug_moe", "--model.n_layers", "2", "--training.steps", str(STEPS), "--debug.deterministic",
       "--training.global_batch_size", "8", "--lr_scheduler.decay_type", "constant",
       "--model.moe.aux_loss_coeff", "0.01", "--model.moe.load_balance_coeff", "0.01"]
SAVE = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.last_save_model_only", "false"]
# The fields that must match one process: the loss and the MoE record (counts scaled to the step's tokens).
FIELDS = ("moe_aux_loss", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max", "moe_load_imbalance")

SINGLE = spec("moe_single", 1, *MOE, "--training.local_batch_size", "8")
# name: (processes, local batch, extra args)
EP2 = ["--parallelism.expert_parallel_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"]
LAYOUTS = {
    "fsdp2": (2, 4, []),
    # Expert parallel: the experts split over 2 or 4 ranks; with FSDP over the ranks holding the same experts
    # (efsdp 2), with HSDP replicas, in each stage of a pipeline with full activation checkpointing (the
    # schedule's shape-inference pass and the recomputation are not counted), and with TP below.
    "ep2": (2, 4, EP2),
    "ep4": (4, 2, ["--parallelism.expert_parallel_degree", "4"]),
    "ep2_fsdp2": (4, 2, [*EP2, *SAVE]),
    "hsdp2_ep2": (4, 2, [*EP2, "--parallelism.data_parallel_replicate_degree", "2"]),
    "pp2_ep2_ac_full": (4, 4, [*EP2, *PP2, "--activation_checkpoint.mode", "full"]),
    # Tensor parallel: each expert's hidden units (and the shared expert's) split over 2 ranks, the router
    # replicated; alone, and under EP 2 (efsdp 1) with the experts split on both dimensions.
    "tp2": (2, 8, TP2),
    "ep2_tp2": (4, 4, [*EP2, *TP2, "--parallelism.expert_tensor_parallel_degree", "2", *SAVE]),
}
RUNS = {name: spec(f"moe_{name}", n, *MOE, "--training.local_batch_size", str(lb), *extra)
        for name, (n, lb, extra) in LAYOUTS.items()}
# Step 5's checkpoint of EP 2 x FSDP 2 (experts split over two ranks, each share sharded over two more),
# resumed by one process.
RESUMED = spec("moe_ep2_fsdp2_to_single", 1, *MOE, "--training.local_batch_size", "8", *SAVE,
               after=(RUNS["ep2_fsdp2"],),
               copy=((f"{{root}}/{RUNS['ep2_fsdp2']}/checkpoint/step-5",
                      "{root}/moe_ep2_fsdp2_to_single/checkpoint/step-5"),))
# EP 2 x TP 2's (each expert on one EP rank, its hidden units split over two TP ranks), likewise.
RESUMED_TP = spec("moe_ep2_tp2_to_single", 1, *MOE, "--training.local_batch_size", "8", *SAVE,
                  after=(RUNS["ep2_tp2"],),
                  copy=((f"{{root}}/{RUNS['ep2_tp2']}/checkpoint/step-5",
                         "{root}/moe_ep2_tp2_to_single/checkpoint/step-5"),))


def _assert_matches(run, reference, steps) -> None:
    got, ref = run.records(), reference.records()
    assert sorted(got) == list(steps), sorted(got)
    for step in steps:
        assert abs(got[step]["loss"] - ref[step]["loss"]) <= 1e-5 * abs(ref[step]["loss"]), step
        assert got[step]["moe_aux_loss"] == pytest.approx(ref[step]["moe_aux_loss"], rel=1e-5), step
        # Routing decisions are discrete: one flipped token would show here.
        assert [got[step][k] for k in FIELDS[1:3]] == [ref[step][k] for k in FIELDS[1:3]], step
        assert got[step]["moe_load_imbalance"] == pytest.approx(ref[step]["moe_load_imbalance"], rel=1e-9), step


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.runs(SINGLE, RUNS[n])) for n in LAYOUTS])
def test_layout_matches_one_process(name, batches):
    """Losses within 1e-5 relative of one process for 10 steps, the auxiliary loss too, and every step's expert
    loads (least, most, imbalance) the same: the counts are summed over the data-parallel ranks and the
    pipeline's shape-inference pass is not counted."""
    _assert_matches(batches.get(RUNS[name]), batches.get(SINGLE), range(1, STEPS + 1))
    assert batches.get(SINGLE).records()[STEPS]["moe_aux_loss"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("layout, resumed", [
    pytest.param("ep2_fsdp2", RESUMED, marks=pytest.mark.runs(SINGLE, RUNS["ep2_fsdp2"], RESUMED)),
    pytest.param("ep2_tp2", RESUMED_TP, marks=pytest.mark.runs(SINGLE, RUNS["ep2_tp2"], RESUMED_TP)),
])
def test_checkpoint_resumes_in_one_process(layout, resumed, batches):
    """EP 2 x FSDP 2's and EP 2 x TP 2's step-5 checkpoints (each expert on one EP rank, sharded over two FSDP
    ranks or split over two TP ranks; expert biases replicated) continue in one process as the straight runs do."""
    run = batches.get(resumed)
    assert "step-5 loaded" in run.log
    _assert_matches(run, batches.get(SINGLE), range(6, STEPS + 1))
