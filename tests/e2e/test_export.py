"""End to end: train a few steps with checkpoints, export the real checkpoint to Hugging Face, check
transformers' logits, then start new runs from the export (initial_load_in_hf) and from the native checkpoint
and check that their first losses agree, also under FSDP on 2 processes through ./run_train.sh (the
one-process runs are the trainer in this process: a launch would add seconds of start-up and nothing under
test)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.launch import losses, run_train, train_in_process
from torchtitan_ext.hf import main as export_main
from torchtitan_ext.native import find_checkpoint, load_native

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

# Global batch fixed at 8 sequences so that 1 and 2 data-parallel processes see the same batch.
BATCH = ["--training.global_batch_size", "8", "--training.local_batch_size", "4"]


def train(dump, *args: str, monkeypatch) -> None:
    rc, out = train_in_process(dump, *args, *BATCH, monkeypatch=monkeypatch)
    assert rc == 0, out[-3000:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    dump = tmp / "pretrain"
    with pytest.MonkeyPatch.context() as mp:
        train(dump, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2", monkeypatch=mp)
    return tmp, dump


def test_export_real_checkpoint_then_continue_from_hf(trained, monkeypatch):
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
    from_hf = ["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf"]
    folders = {name: tmp / name for name in ("from_hf", "from_dcp", "from_hf_fsdp2")}
    rc, out = train_in_process(folders["from_hf"], "--training.steps", "1", *BATCH, *from_hf, monkeypatch=monkeypatch)
    assert rc == 0 and "Hugging Face" in out, out[-3000:]
    train(folders["from_dcp"], "--training.steps", "1", "--checkpoint.initial_load_path", str(step_dir),
          monkeypatch=monkeypatch)
    run_train(folders["from_hf_fsdp2"], "--training.steps", "1", *BATCH, *from_hf, nproc=2)
    first = {name: losses(folder)[1] for name, folder in folders.items()}
    assert abs(first["from_hf"] - first["from_dcp"]) <= 1e-5, first
    assert abs(first["from_hf_fsdp2"] - first["from_dcp"]) <= 1e-4, first  # sharded load (DTensor slices)
    # ... and the loss is that of the trained weights, not of a fresh initialisation.
    pretrain = losses(dump)
    assert first["from_dcp"] < pretrain[1] - 0.1, (first, pretrain)
