"""Context parallelism reproduces the single-process loss (real gloo processes, batched runs): CP 2 and CP 4 with both
rotate methods, and CP beside FSDP, HSDP, tensor and pipeline parallelism, each with causal and block_causal
attention, for 10 steps within 1e-5 relative, with activation checkpointing and validation in some of them. A
checkpoint saved at CP 2 resumes at CP 1 and at FSDP 2, and one saved at CP 1 resumes at CP 2, with the same data
and losses. The data are short token-file documents (tests/assets/token_files), so every sequence packs several
documents and block_causal's mask matters."""

import pytest

from tests.support.batches import spec

STEPS = ["--training.steps", "10", "--debug.deterministic", "--training.global_batch_size", "8"]
DOCS = ["--training.dataset", "numpy", "--training.dataset_path", "tests/assets/token_files/numpy"]
MASKS = {"causal": [], "block": ["--model.attn_mask_type", "block_causal", "--model.rope_per_document"]}
CP2, CP4 = (["--parallelism.context_parallel_degree", str(n)] for n in (2, 4))
VALIDATION = ["--validation.enable", "--validation.freq", "5", "--validation.steps", "2", "--validation.dataset",
              "numpy", "--validation.dataset_path", "tests/assets/token_files/numpy"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.last_save_model_only", "false"]


def method(name: str) -> list[str]:
    return ["--parallelism.context_parallel_rotate_method", name]


# The causal reference also checkpoints (step 5 resumes at CP 2 below).
REFERENCE = {mask: spec(f"cp_reference_{mask}", 1, *STEPS, *DOCS, *extra, *VALIDATION, "--training.local_batch_size",
                        "8", *(CKPT if mask == "causal" else []))
             for mask, extra in MASKS.items()}

# name: (processes, local batch size (x data-parallel degree = 8), arguments); each runs with both masks.
# The methods alternate over the composed layouts, so each composition
# meets each method once with one of the masks. Some also validate (the validation loss is compared too; only
# without data parallelism, where the validation batches are the single process's) or checkpoint
# activations (which must change nothing).
LAYOUTS = {
    "cp2_allgather": (2, 8, [*CP2, *method("allgather")]),
    "cp2_alltoall": (2, 8, [*CP2, *method("alltoall"), *VALIDATION]),
    "cp4_allgather": (4, 8, [*CP4, *method("allgather")]),
    "cp4_alltoall": (4, 8, [*CP4, *method("alltoall")]),
    "fsdp2_cp2": (4, 4, [*CP2, "--activation_checkpoint.mode", "selective"]),
    "tp2_cp2": (4, 8, [*CP2, "--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full",
                       *VALIDATION]),
    "pp2_cp2": (4, 8, [*CP2, "--parallelism.pipeline_parallel_degree", "2",
                       "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    "hsdp2_cp2": (4, 4, [*CP2, "--parallelism.data_parallel_replicate_degree", "2"]),
}
COMPOSED_METHOD = {("causal", 0): "allgather", ("causal", 1): "alltoall", ("block", 0): "alltoall",
                   ("block", 1): "allgather"}
RUNS: dict[tuple[str, str], str] = {}
for _i, (_name, (_nproc, _batch, _extra)) in enumerate(LAYOUTS.items()):
    for _mask, _mask_args in MASKS.items():
        _method = [] if _name.startswith("cp") else method(COMPOSED_METHOD[(_mask, _i % 2)])
        _ckpt = CKPT if (_name, _mask) == ("cp2_allgather", "causal") else []
        RUNS[(_name, _mask)] = spec(f"cp_{_name}_{_mask}", _nproc, *STEPS, *DOCS, *_mask_args, *_extra, *_method,
                                    "--training.local_batch_size", str(_batch), *_ckpt)

# Saved at CP 2 (step 5), resumed at CP 1 and at FSDP 2; saved at CP 1, resumed at CP 2.
SOURCE = RUNS[("cp2_allgather", "causal")]
RESUMED = {
    "single": spec("cp2_to_single", 1, *STEPS, *DOCS, *CKPT, "--training.local_batch_size", "8", after=(SOURCE,),
                   copy=((f"{{root}}/{SOURCE}/checkpoint/step-5", "{root}/cp2_to_single/checkpoint/step-5"),)),
    "fsdp2": spec("cp2_to_fsdp2", 2, *STEPS, *DOCS, *CKPT, "--training.local_batch_size", "4", after=(SOURCE,),
                  copy=((f"{{root}}/{SOURCE}/checkpoint/step-5", "{root}/cp2_to_fsdp2/checkpoint/step-5"),)),
    "cp2_from_cp1": spec("cp1_to_cp2", 2, *STEPS, *DOCS, *CKPT, *CP2, "--training.local_batch_size", "8",
                         after=(REFERENCE["causal"],),
                         copy=((f"{{root}}/{REFERENCE['causal']}/checkpoint/step-5",
                                "{root}/cp1_to_cp2/checkpoint/step-5"),)),
}


def relative_diffs(a: dict[int, float], b: dict[int, float], steps) -> list[float]:
    assert set(steps) <= a.keys() and set(steps) <= b.keys(), (a, b)
    return [abs(a[s] - b[s]) / abs(b[s]) for s in steps]


@pytest.mark.slow
@pytest.mark.parametrize("layout,mask", [pytest.param(*key, marks=pytest.mark.runs(REFERENCE[key[1]], run))
                                         for key, run in RUNS.items()])
def test_context_parallel_matches_single_process(layout, mask, batches):
    reference = batches.get(REFERENCE[mask]).records()
    got = batches.get(RUNS[(layout, mask)]).records()
    assert sorted(got) == list(range(1, 11))
    losses = {s: r["loss"] for s, r in got.items()}
    diffs = relative_diffs(losses, {s: r["loss"] for s, r in reference.items()}, range(1, 11))
    assert max(diffs) <= 1e-5, diffs
    # CP ranks of one data-parallel rank read the same batch: the data are the single process's.
    assert [got[s]["data_fingerprint"] for s in got] == [reference[s]["data_fingerprint"] for s in got]
    assert got[10]["tokens_seen"] == reference[10]["tokens_seen"]
    if "--validation.enable" in LAYOUTS[layout][2]:
        for step in (5, 10):
            assert abs(got[step]["validation_loss"] / reference[step]["validation_loss"] - 1) <= 1e-5, step


@pytest.mark.slow
@pytest.mark.runs(*REFERENCE.values(), *RESUMED.values())
def test_checkpoints_move_between_context_parallel_degrees(batches):
    causal, block = (batches.get(REFERENCE[m]).records() for m in ("causal", "block"))
    # The mask is in effect on these data: block_causal trains differently.
    assert min(relative_diffs({s: r["loss"] for s, r in block.items()},
                              {s: r["loss"] for s, r in causal.items()}, range(1, 11))) > 1e-6
    for name, run in RESUMED.items():
        resumed = batches.get(run)
        got = resumed.records()
        assert sorted(got) == list(range(6, 11)), name
        assert "step-5 loaded" in resumed.log, name
        diffs = relative_diffs({s: r["loss"] for s, r in got.items()}, {s: r["loss"] for s, r in causal.items()},
                               range(6, 11))
        assert max(diffs) <= 1e-5, (name, diffs)
        assert [got[s]["data_fingerprint"] for s in got] == [causal[s]["data_fingerprint"] for s in got], name
