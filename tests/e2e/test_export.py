"""End to end through ./run_train.sh: train a few steps with checkpoints, export the real checkpoint to
Hugging Face, check transformers' logits, then start new runs from the export (initial_load_in_hf) and from
the native checkpoint and check that their first losses agree, also under FSDP on 2 processes."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.support.launch import losses, run_train
from torchtitan_ext.hf import main as export_main
from torchtitan_ext.native import find_checkpoint, load_native

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

# Global batch fixed at 8 sequences so that 1 and 2 data-parallel processes see the same batch.
BATCH = ["--training.global_batch_size", "8", "--training.local_batch_size", "4"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    dump = tmp / "pretrain"
    run_train(dump, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2", *BATCH)
    return tmp, dump


def test_export_real_checkpoint_then_continue_from_hf(trained):
    tmp, dump = trained
    step_dir = find_checkpoint(dump)
    assert step_dir.name == "final-step-2"  # the final export, next to the full step-2
    hf = tmp / "hf"
    assert export_main(["--checkpoint", str(dump), "--output", str(hf), "--dtype", "fp32"]) == 0

    # transformers loads it offline with no missing/unexpected keys and the same logits.
    native = load_native(dump)
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(hf), dtype=torch.float32,
                                                               output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokens = torch.tensor([native.tokenizer.encode("First Citizen: Before we proceed any further, hear me speak.",
                                                   bos=True)])
    with torch.no_grad():
        diff = (model(tokens).logits - native.model(tokens)).abs().max().item()
    assert diff <= 1e-4, diff

    # Continued pretraining from the export vs from the native checkpoint (same weights, same data).
    runs = {
        "from_hf": (tmp / "from_hf", ["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf"], 1),
        "from_dcp": (tmp / "from_dcp", ["--checkpoint.initial_load_path", str(step_dir)], 1),
        "from_hf_fsdp2": (tmp / "from_hf_fsdp2",
                          ["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf"], 2),
    }

    def launch(item):
        folder, extra, nproc = item
        return run_train(folder, "--training.steps", "1", *BATCH, *extra, nproc=nproc)

    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        procs = dict(zip(runs, pool.map(launch, runs.values())))
    assert "Hugging Face" in procs["from_hf"].stdout + procs["from_hf"].stderr
    first = {name: losses(folder)[1] for name, (folder, _, _) in runs.items()}
    assert abs(first["from_hf"] - first["from_dcp"]) <= 1e-5, first
    assert abs(first["from_hf_fsdp2"] - first["from_dcp"]) <= 1e-4, first  # sharded load (DTensor slices)
    # ... and the loss is that of the trained weights, not of a fresh initialisation.
    pretrain = losses(dump)
    assert first["from_dcp"] < pretrain[1] - 0.1, (first, pretrain)
