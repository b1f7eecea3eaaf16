"""block_causal attention under FSDP, tensor and pipeline parallelism reproduces the single-process loss (real gloo
processes, batched runs). The data are short token-file documents (tests/assets/token_files), so every
sequence packs several documents and the mask matters."""

import pytest

from tests.support.batches import spec
from tests.support.parity import STEPS, relative_diffs

DOCUMENTS = ["--training.dataset", "numpy", "--training.dataset_path", "tests/assets/token_files/numpy",
             "--model.attn_mask_type", "block_causal", "--model.rope_per_document"]
REFERENCE = spec("block_causal_single", 1, *STEPS, "--training.local_batch_size", "8", *DOCUMENTS)
CAUSAL = spec("block_causal_data_causal", 1, *STEPS, "--training.local_batch_size", "8", *DOCUMENTS[:4])
LAYOUTS = {
    "fsdp2": spec("block_causal_fsdp2", 2, *STEPS, "--training.local_batch_size", "4", *DOCUMENTS),
    "tp2": spec("block_causal_tp2", 2, *STEPS, "--training.local_batch_size", "8", *DOCUMENTS,
                "--parallelism.tensor_parallel_degree", "2"),
    # Every stage masks its blocks from the positions the schedule hands it with each micro-batch.
    "pp2": spec("block_causal_pp2", 2, *STEPS, "--training.local_batch_size", "8", *DOCUMENTS,
                "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.runs(REFERENCE, CAUSAL, run))
                                  for n, run in LAYOUTS.items()])
def test_block_causal_layout_matches_single_process(name, batches):
    reference = batches.get(REFERENCE).losses()
    diffs = relative_diffs(batches.get(LAYOUTS[name]).losses(), reference)
    assert max(diffs) <= 1e-5, diffs
    # The same data under causal attention trains differently: the mask was in effect.
    assert min(relative_diffs(batches.get(CAUSAL).losses(), reference)) > 1e-6
